"""Train Megatron-core's GPTModel under a hetu_ext plan; Megatron-LM's flag names plus --hetu-*.

    torchrun --nproc-per-node 4 launch/pretrain_gpt.py --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 64 --num-attention-heads 4 \
        --seq-length 128 --micro-batch-size 2 --global-batch-size 8 --train-iters 20 --lr 1e-3 --mock-data
"""

import sys

from hetu_ext.cli.train import main

if __name__ == "__main__":
    sys.exit(main())

"""Train Megatron-core's GPTModel (TP 1, PP 1) with DeepSpeed ZeRO-0/1/2/3: resume at any world size,
straggler-weighted microbatches and length-aware packing (ZeRO-0/1), DeepSpeed or hetu checkpoints
(docs/deepspeed.md). Megatron-LM's flag names plus ``--zero-stage``, ``--deepspeed-config`` and
``--hetu-microbatches``; on a machine without CUDA it runs on CPU (gloo, DS_ACCELERATOR=cpu).

    torchrun --nproc-per-node 4 launch/pretrain_gpt_deepspeed.py --zero-stage 2 --num-layers 4 \
        --hidden-size 64 --num-attention-heads 4 --seq-length 128 --micro-batch-size 1 --global-batch-size 12 \
        --train-iters 20 --lr 1e-3 --mock-data --save /tmp/ds_ckpt --save-interval 5
    torchrun --nproc-per-node 3 launch/pretrain_gpt_deepspeed.py ... --load /tmp/ds_ckpt   # the same flags, 3 ranks
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 launch/pretrain_gpt_deepspeed.py ...        # DeepSpeed's launcher
    python launch/pretrain_gpt_deepspeed.py ...                                           # one rank, no launcher

``--load DIR`` takes a DeepSpeed ZeRO checkpoint (``DIR/latest``) or a hetu one, saved on any number of ranks, in
process; ``--save DIR`` writes DeepSpeed's format (``--hetu-ckpt-format auto``) or hetu's (``hetu``: asynchronous,
atomic, ``--hetu-ckpt-keep`` retention), every ``--save-interval`` steps and at the end. ``--load DIR --save DIR``
continues in place, so a supervisor that restarts the job on the ranks left resumes from the newest checkpoint at
the new world size (``launch/elastic.py --launcher deepspeed`` does it, docs/deepspeed.md). Bad input is one line
and exit code 2. Rank 0 prints Megatron-LM's log lines (every ``--log-interval`` steps), as launch/pretrain_gpt.py
does.
"""

import sys

from hetu_ext.cli.deepspeed import main

if __name__ == "__main__":
    sys.exit(main())

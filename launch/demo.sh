#!/usr/bin/env bash
# The README's main command (make demo): tokenize the shipped sample offline, show the plan, then train
# Megatron-core's GPTModel with TP 2 x PP 2 on 4 CPU ranks under torchrun, saving a checkpoint at the end.
set -euo pipefail
NPROC=${1:-4}
OUT=${2:-runs/demo}
PY=.venv/bin/python
mkdir -p "$OUT"
export PYTHONWARNINGS=ignore

$PY -m hetu_ext.megatron.preprocess_data --input hetu_ext/data/samples/python_reference.jsonl \
    --output-prefix "$OUT/pyref" --tokenizer-type ByteLevelTokenizer --append-eod

$PY -m torch.distributed.run --nproc-per-node "$NPROC" --rdzv-backend c10d --rdzv-endpoint localhost:0 \
    launch/pretrain_gpt.py \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
    --micro-batch-size 4 --global-batch-size 16 --train-iters 60 \
    --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 5 --weight-decay 0.01 --clip-grad 1.0 \
    --data-path "$OUT/pyref_text_document" --split 98,2,0 --tokenizer-type ByteLevelTokenizer \
    --data-cache-path "$OUT/cache" --log-interval 5 --save "$OUT/checkpoints" --seed 1234

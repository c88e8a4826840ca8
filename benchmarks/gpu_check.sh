#!/usr/bin/env bash
# hetu_ext's trainer on one lent GPU (H100 or H200), beside Megatron's local spec and plan predict (issue 47).
# One run, under 8 minutes: every step has its own time limit, and the optional ones are skipped once the
# budget (BUDGET_S, default 450 s) would be passed. Each Python step is benchmarks.gpu_check (its docstring):
#
#   1. probe (<= 45 s): which SDPA kernel torch runs for the trainer's cases (bf16 GQA causal, with dropout, fp32;
#      "math" would mean materialised scores), and packed FlexAttention compiled at 32K tokens (first call with
#      compilation, warm time, peak memory).
#   2. hetu (<= 110 s): hetu_ext's trainer, default attention (sdpa), TinyLlama's 1.1B shape, seq 4096, bf16,
#      4 microbatches of 1 a step, 8 steps, a TP 1 -> 1 migration after step 3 (its seconds): step time,
#      tokens/s, TFLOP/s, MFU, peak memory.
#   3. local (<= 100 s): the same run with Megatron's local-spec attention (--hetu-attention megatron); if it
#      fails (out of memory: [b, 32, 4096, 4096] scores per layer), local_selective retries it with selective
#      recomputation, if the budget allows.
#   4. predict (<= 20 s): hetu-plan predict of the same configuration (--use-flash-attn) on the device profile.
#   5. thd32k (<= 150 s): packed THD training at 32K tokens a pack under HotSPa with two one-GPU strategies
#      (documents <= 8K, <= 32K), full recomputation: step time, and each switch's seconds.
#   6. hetu_compile (<= 100 s, optional): step 2 with --hetu-compile; the summary compares it with step 2 (compile
#      on vs off) and says whether --hetu-compile should be on by default on CUDA (>= 5% faster steps).
#   7. hetu_loss_chunk (<= 80 s, optional): step 2 with --hetu-loss-chunk-tokens 1024: peak memory and step time
#      of the chunked loss beside step 2's.
#   8. layer_table (<= 60 s, optional): gpu_calibrate.sh's per-layer table (python -m hetu_ext.cli.calibrate) for
#      the 1B layer at 1024-4096 tokens.
#   9. summary: the table, issue 47's checks (MFU >= 35%, >= 2x the local spec's tokens/s, within 15% of plan
#      predict), the two defaults' decisions and one JSON line, in $OUT/summary.log.
#
# Usage, from the repository root on the GPU machine:   bash benchmarks/gpu_check.sh
# Output folder: $OUT if set (the device tool sets it), else runs/gpu_check. Python: $PYTHON if set, else the
# first of .venv/bin/python, python3 that imports torch. Without a CUDA device it stops at once (exit 2).
#
# Wheels: the GPU image has torch but not megatron-core. Download once on a machine with network access, in the
# repository root (and keep .whl/ out of git: echo /.whl/ >> .git/info/exclude):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl megatron-core==0.16.1
# and carry .whl with the run (the device tool's carry: [".whl"]); this script installs every .whl/*.whl into
# /tmp/hetu_site first. Its output files come back from $OUT: at most 8 files, so the logs are joined into few.
set -euo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-runs/gpu_check}"
BUDGET_S="${BUDGET_S:-450}"

SCRIPT=gpu_check.sh DOCS=docs/training.md
source benchmarks/gpu_env.sh  # PYTHON, the CUDA check, .whl/ wheels, hetu_ext from this tree
export PYTHONWARNINGS=ignore

mkdir -p "$OUT"
RUNS="$OUT/runs"  # the per-step JSON files (joined into $OUT/results.json at the end)
mkdir -p "$RUNS"
GPU="$("$PYTHON" -c 'import torch; print(torch.cuda.get_device_name())')"
case "$GPU" in
    *H200*) PROFILE=h200 ;;
    *) PROFILE=h100-sxm ;;
esac
LOG="$OUT/gpu_check.log"
TORCH="$("$PYTHON" -c 'import torch; print(torch.__version__)')"
echo "gpu_check.sh: $GPU (profile $PROFILE), python $PYTHON, torch $TORCH, output $OUT, $(date -u +%FT%TZ)" \
    | tee "$LOG"
FAILED=()

step() {  # step NAME LIMIT_S COMMAND...: run it, its output appended to $LOG; a failure is noted, not fatal
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit} s, at ${SECONDS} s): $*" | tee -a "$LOG"
    local start=$SECONDS rc=0
    timeout --kill-after=10 "$limit" "$@" > >(tee -a "$LOG") 2>&1 || rc=$?
    echo "== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$LOG"
    if [[ $rc -ne 0 ]]; then FAILED+=("$name (exit $rc)"); fi
    return $rc
}

fits() {  # fits LIMIT_S: whether a step of at most LIMIT_S ends inside the budget
    if (( SECONDS + $1 <= BUDGET_S )); then return 0; fi
    echo "== skipped: a step of ${1} s would end after the ${BUDGET_S} s budget (at ${SECONDS} s)" | tee -a "$LOG"
    return 1
}

CHECK=("$PYTHON" -m benchmarks.gpu_check)
step probe 45 "${CHECK[@]}" probe --out "$RUNS/probe.json" || true
step hetu 110 "${CHECK[@]}" train --out "$RUNS/train_hetu.json" --attention sdpa --migrate || true
if ! step local 100 "${CHECK[@]}" train --out "$RUNS/train_local.json" --attention megatron; then
    if fits 100; then
        step local_selective 100 "${CHECK[@]}" train --out "$RUNS/train_local.json" --attention megatron \
            --recompute selective || true
    fi
fi
step predict 20 "$PYTHON" -m hetu_ext.plan predict --num-layers 22 --hidden-size 2048 --ffn-hidden-size 5632 \
    --num-attention-heads 32 --group-query-attention --num-query-groups 4 --swiglu --normalization RMSNorm \
    --position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights --vocab-size 32000 \
    --seq-length 4096 --tensor-model-parallel-size 1 --gpus 1 --micro-batch-size 1 --global-batch-size 4 \
    --use-flash-attn --device "$PROFILE" > >(tee "$RUNS/predict.json") || true
if fits 150; then
    step thd32k 150 "${CHECK[@]}" train --out "$RUNS/train_thd32k.json" --seq-length 32768 --hotspa \
        --microbatches 2 --iters 5 --recompute full || true
fi
if fits 100; then
    step hetu_compile 100 "${CHECK[@]}" train --out "$RUNS/train_hetu_compile.json" --attention sdpa --compile || true
fi
if fits 80; then
    step hetu_loss_chunk 80 "${CHECK[@]}" train --out "$RUNS/train_hetu_loss_chunk.json" --attention sdpa \
        --loss-chunk-tokens 1024 || true
fi
if fits 60; then
    step layer_table 60 "$PYTHON" -m hetu_ext.cli.calibrate --out "$RUNS/layer_cost_tp1.yaml" \
        --hidden-size 2048 --num-attention-heads 32 --ffn-hidden-size 5632 --seq-lengths 1024,2048,4096 \
        --repeats 2 || true
fi
step summary 20 "${CHECK[@]}" summary "$RUNS" > >(tee "$OUT/summary.log") || true

# what comes back: gpu_check.log, summary.log, results.json (every step's JSON), layer_cost_tp1.yaml
"$PYTHON" - "$RUNS" "$OUT/results.json" <<'EOF' || true
import json, sys
from pathlib import Path
runs = Path(sys.argv[1])
joined = {p.name: (json.loads(p.read_text()) if p.suffix == ".json" and p.read_text().lstrip().startswith("{")
                   else p.read_text()) for p in sorted(runs.iterdir()) if p.is_file()}
Path(sys.argv[2]).write_text(json.dumps(joined, indent=1, default=str))
EOF
[[ -f "$RUNS/layer_cost_tp1.yaml" ]] && cp "$RUNS/layer_cost_tp1.yaml" "$OUT/"
rm -rf "$RUNS"

echo "gpu_check.sh: done in ${SECONDS} s; results in $OUT" | tee -a "$LOG"
if [[ ${#FAILED[@]} -gt 0 ]]; then
    echo "gpu_check.sh: failed steps: ${FAILED[*]}" | tee -a "$LOG" >&2
    exit 1
fi

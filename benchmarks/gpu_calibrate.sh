#!/usr/bin/env bash
# Calibrate the cost models on one lent GPU (H100 or H200) and re-price the planners' benchmarks with what it
# measured. One run, under 8 minutes (each step has its own time limit below; about 7 minutes at worst):
#
#   1. kernels (benchmarks.gpu_kernels, <= 120 s): bf16 GEMM efficiency by size, HBM bandwidth, and the packed
#      attention kernels (SDPA per document, FlexAttention eager and compiled, on THD packs of 1/4/16 documents);
#      writes $OUT/device_measured.yaml, a device profile with the measured curve (--device for plan predict).
#   2. layer table (python -m hetu_ext.cli.calibrate, <= 150 s): one Megatron-core layer of the 7B shape the
#      benchmarks use (hidden 4096, 32 heads, ffn 11008) on packs of 512 .. 8192 tokens, fitted to
#      a s^2 + b s + c; TP 2/4/8 derived from it by python -m hetu_ext.plan.cost.calibration (one GPU measures TP 1
#      only): $OUT/layer_cost.yaml. Note: that module builds the layer in fp32 (no --bf16 option yet), so the
#      table prices an fp32 layer; the kernels of step 1 are bf16.
#   3. re-priced benchmarks (<= 50 s each, predicted parts only): benchmarks.hotspa, .hydraulis, .lobra with
#      --cost-model $OUT/layer_cost.yaml; their tables and final JSON lines in $OUT/*.log.
#   4. plan predict with the measured profile beside the shipped one (seconds).
#
# Usage, from the repository root on the GPU machine:   bash benchmarks/gpu_calibrate.sh
# Output folder: $OUT if set (the device tool sets it), else runs/gpu_calibrate. Python: $PYTHON if set, else the
# first of .venv/bin/python, python3 that imports torch. Without a CUDA device it stops at once (exit 2).
#
# Wheels: the GPU image has torch but not megatron-core. Download once on a machine with network access, in the
# repository root (and keep .whl/ out of git: echo /.whl/ >> .git/info/exclude):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl megatron-core==0.16.1
# and carry .whl with the run; this script installs every .whl/*.whl into /tmp/hetu_site first.
set -euo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-runs/gpu_calibrate}"

SCRIPT=gpu_calibrate.sh DOCS=docs/cost_model.md
source benchmarks/gpu_env.sh  # PYTHON, the CUDA check, .whl/ wheels, hetu_ext from this tree

mkdir -p "$OUT"
GPU="$("$PYTHON" -c 'import torch; print(torch.cuda.get_device_name())')"
case "$GPU" in
    *H200*) PROFILE=h200 ;;
    *A100*) PROFILE=a100-80gb-sxm ;;
    *) PROFILE=h100-sxm ;;
esac
echo "gpu_calibrate.sh: $GPU (profile $PROFILE), python $PYTHON, output $OUT, $(date -u +%FT%TZ)"
FAILED=()

step() {  # step NAME LIMIT_S COMMAND...: run it with its output in $OUT/NAME.log; a failure is noted, not fatal
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit} s): $*"
    local start=$SECONDS rc=0
    timeout --kill-after=10 "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1 || rc=$?
    echo "== $name: exit $rc after $((SECONDS - start)) s"
    if [[ $rc -ne 0 ]]; then FAILED+=("$name (exit $rc)"); fi
}

step kernels 120 "$PYTHON" -m benchmarks.gpu_kernels --base-profile "$PROFILE" \
    --profile-out "$OUT/device_measured.yaml" --json-out "$OUT/kernels.json" --repeats 10
step layer_table 150 "$PYTHON" -m hetu_ext.cli.calibrate --out "$OUT/layer_cost_tp1.yaml" \
    --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008 \
    --seq-lengths 512,1024,2048,3072,4096,6144,8192 --repeats 3
if [[ -f "$OUT/layer_cost_tp1.yaml" ]]; then
    step layer_table_tp 30 "$PYTHON" -m hetu_ext.plan.cost.calibration --table "$OUT/layer_cost_tp1.yaml" \
        --out "$OUT/layer_cost.yaml" --device "$PROFILE" --hidden-size 4096 --num-attention-heads 32 \
        --ffn-hidden-size 11008 --tp 2,4,8
fi
if [[ -f "$OUT/layer_cost.yaml" ]]; then
    step hotspa 50 "$PYTHON" -m benchmarks.hotspa --skip-emulated --batches 2 --cost-model "$OUT/layer_cost.yaml"
    step hydraulis 50 "$PYTHON" -m benchmarks.hydraulis --batches 2 --cost-model "$OUT/layer_cost.yaml"
    step lobra 50 "$PYTHON" -m benchmarks.lobra --part predicted --steps 4 --cost-model "$OUT/layer_cost.yaml"
else
    FAILED+=("benchmarks (no layer table)")
fi
LLAMA7B=(--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008 --swiglu
         --normalization RMSNorm --position-embedding-type rope --disable-bias-linear
         --untie-embeddings-and-output-weights --vocab-size 32000 --seq-length 4096 --tensor-model-parallel-size 1
         --gpus 8 --micro-batch-size 1 --global-batch-size 64 --recompute-granularity selective
         --use-distributed-optimizer --overlap-grad-reduce --use-flash-attn)
step predict_shipped 20 "$PYTHON" -m hetu_ext.plan predict "${LLAMA7B[@]}" --device "$PROFILE"
if [[ -f "$OUT/device_measured.yaml" ]]; then
    step predict_measured 20 "$PYTHON" -m hetu_ext.plan predict "${LLAMA7B[@]}" --device "$OUT/device_measured.yaml"
fi

echo "gpu_calibrate.sh: done in ${SECONDS} s; results in $OUT"
if [[ ${#FAILED[@]} -gt 0 ]]; then
    echo "gpu_calibrate.sh: failed steps: ${FAILED[*]}" >&2
    exit 1
fi

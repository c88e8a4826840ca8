"""The flags of Megatron-LM's own example scripts at tag core_v0.16.1, copied here as data (the fixture in
../shared/thirdparty holds no examples/): ``examples/llama/train_llama3_8b_h100_fp8.sh`` (mock-data branch; the
real-data branch adds ``--data-path --tokenizer-type HuggingFaceTokenizer --tokenizer-model``, listed in
:data:`LLAMA_REAL_DATA`), ``examples/gpt3/train_gpt3_175b_distributed.sh`` and
``examples/mixtral/train_mixtral_8x7b_distributed.sh``. Each list is the script's arrays in order, with its
shell variables at their defaults (paths as placeholders).
"""

from __future__ import annotations

LLAMA3_8B_FP8 = [
    # MODEL_ARGS
    "--use-mcore-models", "--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
    "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8", "--kv-channels", "128",
    "--seq-length", "8192", "--max-position-embeddings", "8192", "--position-embedding-type", "rope",
    "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--swiglu", "--init-method-std", "0.0134", "--attention-backend", "fused", "--apply-layernorm-1p",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    # TRAINING_ARGS
    "--micro-batch-size", "1", "--global-batch-size", "128", "--train-samples", "1953125000",
    "--lr-decay-samples", "1949218748", "--lr-warmup-samples", "3906252", "--lr", "0.00015", "--min-lr", "0.00001",
    "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5", "--lr-decay-style", "cosine", "--clip-grad", "1.0",
    "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16",
    "--cross-entropy-loss-fusion", "--calculate-per-token-loss", "--manual-gc", "--empty-unused-memory-level", "1",
    "--exit-duration-in-mins", "235",
    # DDP_ARGS (appended to TRAINING_ARGS)
    "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
    # DTYPE_ARGS (DTYPE=fp8)
    "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max",
    "--fp8-param-gather",
    # MODEL_PARALLEL_ARGS
    "--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--sequence-parallel",
    # DATA_ARGS_LIST (MOCK)
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128256", "--data-cache-path", "CACHE",
    "--tiktoken-pattern", "v2", "--split", "99,1,0", "--no-create-attention-mask-in-dataloader",
    "--no-mmap-bin-files", "--num-workers", "1",
    # EVAL_AND_LOGGING_ARGS
    "--log-interval", "1", "--eval-iters", "32", "--eval-interval", "100", "--save-interval", "1000",
    "--log-throughput", "--profile", "--profile-step-start", "4", "--profile-step-end", "6", "--ckpt-format",
    "torch_dist", "--distributed-timeout-minutes", "60", "--save", "CKPT", "--load", "CKPT", "--tensorboard-dir",
    "TB",
]
LLAMA_REAL_DATA = ["--data-path", "DATA", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "TOK"]

GPT3_175B = [
    "--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96", "--seq-length", "2048",
    "--max-position-embeddings", "2048", "--attention-backend", "auto",
    "--micro-batch-size", "1", "--global-batch-size", "1536", "--rampup-batch-size", "16", "16", "5859375",
    "--train-iters", "500000", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
    "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5", "--lr-decay-style", "cosine",
    "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001", "--lr-decay-iters", "430000",
    "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
    "--data-path", "DATA", "--vocab-file", "VOCAB", "--merge-file", "MERGES", "--split", "949,50,1",
    "--log-interval", "100", "--save-interval", "10000", "--eval-interval", "1000", "--save", "CKPT", "--load",
    "CKPT", "--eval-iters", "10", "--tensorboard-dir", "TB",
]

MIXTRAL_8X7B = [
    "--use-mcore-models", "--disable-bias-linear", "--seq-length", "4096", "--max-position-embeddings", "32768",
    "--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336", "--num-attention-heads", "32",
    "--init-method-std", "0.01", "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--normalization",
    "RMSNorm", "--position-embedding-type", "rope", "--swiglu", "--untie-embeddings-and-output-weights",
    "--group-query-attention", "--num-query-groups", "8", "--no-masked-softmax-fusion", "--no-position-embedding",
    "--rotary-base", "1000000",
    "--num-experts", "8", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
    "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
    "--overlap-param-gather", "--overlap-grad-reduce",
    "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "TOK", "--data-path", "DATA", "--split",
    "99990,8,2",
    "--micro-batch-size", "1", "--global-batch-size", "256", "--lr", "1e-4", "--train-iters", "500000",
    "--lr-decay-iters", "320000", "--lr-decay-style", "cosine", "--min-lr", "1.0e-5", "--weight-decay", "0.1",
    "--lr-warmup-iters", "500", "--clip-grad", "1.0", "--bf16",
    "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "4", "--expert-model-parallel-size", "8",
    "--use-distributed-optimizer", "--sequence-parallel",
    "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000", "--eval-iters", "10", "--save",
    "CKPT", "--load", "CKPT", "--tensorboard-dir", "TB", "--no-load-optim", "--no-load-rng",
    # with WANDB_API_KEY set
    "--wandb-project", "Mixtral", "--wandb-exp-name", "Mixtral_8x7B",
]

EXAMPLES = {"examples/llama/train_llama3_8b_h100_fp8.sh": LLAMA3_8B_FP8 + LLAMA_REAL_DATA,
            "examples/gpt3/train_gpt3_175b_distributed.sh": GPT3_175B,
            "examples/mixtral/train_mixtral_8x7b_distributed.sh": MIXTRAL_8X7B}


def resized(argv: list[str], sizes: dict[str, str], paths: dict[str, str]) -> list[str]:
    """``argv`` with only the values of the flags in ``sizes`` replaced (and the path placeholders in ``paths``):
    the recipe "unchanged but for sizes"."""
    out = []
    for i, token in enumerate(argv):
        prev = argv[i - 1] if i else ""
        out.append(sizes.get(prev, paths.get(token, token)) if prev in sizes else paths.get(token, token))
    missing = set(sizes) - set(argv)
    if missing:
        raise KeyError(f"not flags of the recipe: {sorted(missing)}")
    return out


LLAMA_CPU_SIZES = {"--num-layers": "4", "--hidden-size": "64", "--ffn-hidden-size": "96",
                   "--num-attention-heads": "4", "--num-query-groups": "2", "--kv-channels": "16",
                   "--seq-length": "128", "--max-position-embeddings": "128", "--vocab-size": "1000",
                   "--global-batch-size": "8", "--train-samples": "96", "--lr-decay-samples": "88",
                   "--lr-warmup-samples": "8", "--eval-iters": "2", "--eval-interval": "4", "--save-interval": "6",
                   "--profile-step-start": "2", "--profile-step-end": "3"}
"""The Llama 3 8B recipe at CPU sizes: the issue's (4 layers, hidden 64, ffn 96, 4 heads, 2 query groups,
kv-channels 16, seq 128, vocab 1000, global batch 8, 96 samples = 12 iterations), evaluation every 4 iterations."""


if __name__ == "__main__":  # rewrite docs/megatron-lm.md's flag table from the code's rules
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_megatron_lm_recipe import DOC, TABLE_BEGIN, TABLE_END, example_flag_table

    head, rest = DOC.read_text().split(TABLE_BEGIN, 1)
    DOC.write_text(f"{head}{TABLE_BEGIN}\n{example_flag_table()}{TABLE_END}{rest.split(TABLE_END, 1)[1]}")

"""Typed configuration: one frozen dataclass per component, each field one setting.

Every field is at once a command-line flag (Megatron-LM's name, or ``--hetu-*``; :mod:`hetu_ext.config.parse`
builds the parser from these classes, so the two cannot drift) and a key of a ``--hetu-config`` YAML file under
its section (``model:``, ``training:``, ...). Components receive their section, never the argparse namespace: a
signature says what a component reads. A system that adds settings adds a section here (and its flags come with it).

Pure: no torch, no host framework.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

TOKENIZER_TYPES = ("ByteLevelTokenizer", "NullTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer", "Llama2Tokenizer")
PACKING_METHODS = ("off", "unpacked", "concat", "concat-causal", "ffd", "greedy", "balanced")
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")


def setting(default: Any = None, *, help: str = "", flag: str | None = None, choices: tuple | None = None,
            required: bool = False, nargs: str | None = None, metavar: str | None = None,
            path: bool = False) -> Any:
    """A field that is also a flag. ``flag``: the flag's name (default ``--field-name``); ``required``: no default
    (given by a flag or the file); ``path``: a file path, relative to the YAML file that gives it; bool fields are
    ``store_true`` flags."""
    return field(default=default, metadata={"help": help, "flag": flag, "choices": choices, "required": required,
                                            "nargs": nargs, "metavar": metavar, "path": path})


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """torchrun's flags, taken when pretrain_gpt.py is its own launcher (not under torchrun)."""

    nproc_per_node: int | None = setting(help="ranks on this machine (default 1); under torchrun this flag is "
                                              "torchrun's, not the script's")
    nnodes: int = setting(1, help="machines of the job (torchrun's flag)")
    node_rank: int = setting(0, help="this machine's index (torchrun's flag)")
    master_addr: str = setting("127.0.0.1", help="rank 0's machine (torchrun's flag)")
    master_port: int | None = setting(help="default: a free port (single node), 29500 (several nodes)")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The GPT model's shape and regularisation (Megatron-LM's flags)."""

    num_layers: int = setting(required=True, help="transformer layers")
    hidden_size: int = setting(required=True, help="hidden size")
    ffn_hidden_size: int | None = setting(help="default: 4 x hidden size")
    num_attention_heads: int = setting(required=True, help="attention heads")
    seq_length: int = setting(required=True, help="tokens of a sample (with packing: the most tokens of a pack)")
    max_position_embeddings: int | None = setting(help="default: --seq-length")
    make_vocab_size_divisible_by: int = setting(128, help="the vocabulary is padded to a multiple of this")
    untie_embeddings_and_output_weights: bool = setting(False, help="a separate output layer")
    hidden_dropout: float = setting(0.1, help="dropout after attention and MLP")
    attention_dropout: float = setting(0.1, help="dropout of attention probabilities")
    init_method_std: float = setting(0.02, help="std of the normal weight initialisation")
    position_embedding_type: str = setting("learned_absolute", choices=("learned_absolute", "rope", "none"),
                                           help="position embeddings: a learned table, rotary (Llama) or none")
    rotary_base: int = setting(10000, help="RoPE's base period (with --position-embedding-type rope)")
    rotary_percent: float = setting(1.0, help="the share of each head's dimensions RoPE rotates")
    use_rope_scaling: bool = setting(False, help="Llama 3.1's RoPE frequency scaling (with --position-embedding-type "
                                                 "rope)")
    rope_scaling_factor: float = setting(8.0, help="the factor of --use-rope-scaling")
    normalization: str = setting("LayerNorm", choices=("LayerNorm", "RMSNorm"), help="the norm of every layer")
    norm_epsilon: float = setting(1e-5, help="epsilon of the norms")
    apply_layernorm_1p: bool = setting(False, help="zero-centred norms: each weight is stored as gamma - 1 "
                                                   "(initialised to 0) and scales by 1 + weight (Megatron-LM's)")
    swiglu: bool = setting(False, help="a gated MLP with SiLU (Llama's SwiGLU); --ffn-hidden-size is each half")
    group_query_attention: bool = setting(False, help="grouped-query attention (with --num-query-groups)")
    num_query_groups: int = setting(1, help="query groups under --group-query-attention; every stage's TP degree "
                                            "must divide it")
    kv_channels: int | None = setting(help="the head dimension; default: hidden size / attention heads")
    disable_bias_linear: bool = setting(False, help="no biases on the linear layers (Llama)")
    add_qkv_bias: bool = setting(False, help="a bias on the QKV projection even with --disable-bias-linear (Qwen2)")
    qk_layernorm: bool = setting(False, help="a norm over each query and key head")
    recompute_granularity: str | None = setting(choices=("full", "selective"),
                                                help="activation recomputation: whole layers, or the modules of "
                                                     "--recompute-modules")
    recompute_method: str | None = setting(choices=("uniform", "block"),
                                           help="with full recomputation: which layers (Megatron-LM's meaning)")
    recompute_num_layers: int | None = setting(help="layers per recomputed unit (uniform) or per stage (block)")
    recompute_modules: list[str] | None = setting(nargs="*", help="with selective recomputation (default: "
                                                                  "core_attn)")
    attention: str = setting("sdpa", flag="--hetu-attention", choices=("sdpa", "megatron"),
                             help="core attention of hetu_ext's layers: sdpa (torch's scaled_dot_product_attention, "
                                  "FlexAttention for packs on CUDA; never materialises the s x s scores) or "
                                  "megatron (the local spec's DotProductAttention)")
    compile: bool = setting(False, flag="--hetu-compile",
                            help="torch.compile each transformer layer (fuses norms, SwiGLU, RoPE); CUDA only")
    transformer_impl: str = setting("local", choices=("local", "transformer_engine"),
                                    help="the layer spec: local (Megatron-core's torch modules) or transformer_engine "
                                         "(Megatron-core's Transformer Engine spec: fused norm+GEMM, fused "
                                         "attention; needs transformer_engine and a CUDA device)")
    loss_chunk_tokens: str = setting("auto", flag="--hetu-loss-chunk-tokens", metavar="{N,auto}",
                                     help="compute the output layer and cross entropy over chunks of N tokens of "
                                          "the rank's sequence, each recomputed in backward, so the [tokens, "
                                          "vocab / TP] fp32 logits are never held whole; 0: the whole microbatch "
                                          "(Megatron's); auto: chunks of 1 GiB of fp32 logits, only in "
                                          "microbatches whose logits exceed that")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Where ranks sit: Megatron's uniform TP x PP x DP grid, or a hetu_ext plan."""

    tensor_model_parallel_size: int = setting(1, help="TP degree of the uniform plan")
    pipeline_model_parallel_size: int = setting(1, help="pipeline stages of the uniform plan")
    context_parallel_size: int = setting(1, help="CP degree of the uniform plan: each stage's TP groups split every "
                                                 "sequence into 2 CP load-balanced chunks (plan runtime)")
    use_distributed_optimizer: bool = setting(False, help="ZeRO-1: optimizer state sharded over data parallelism")
    sequence_parallel: bool = setting(False, help="Megatron's sequence parallelism in every stage of TP > 1: norms, "
                                                  "dropout and the stage boundary keep 1/TP of the sequence")
    distributed_backend: str | None = setting(choices=("gloo", "nccl"), help="default: nccl with CUDA, gloo "
                                                                             "without")
    distributed_timeout_minutes: float = setting(10.0, help="collective timeout")
    hang_timeout: float = setting(0.0, flag="--hetu-hang-timeout",
                                  help="seconds without a completed step after which a rank exits (code 3) so that "
                                       "launch/elastic.py restarts the job; 0: off")
    plan: str | None = setting(flag="--hetu-plan", path=True,
                               help="plan YAML; default: the uniform plan of the TP/PP flags")
    runtime: str = setting("auto", flag="--hetu-runtime", choices=("auto", "megatron", "plan"),
                           help="megatron: parallel_state's uniform grid; plan: any plan (stage models with their "
                                "own groups); auto: megatron for uniform plans, plan otherwise")
    cpu_patches: str = setting("auto", flag="--hetu-cpu-patches", choices=("auto", "on", "off"),
                               help="Megatron-core CPU patches: auto applies them only when no CUDA device is "
                                    "present")


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """Batch, optimizer and learning-rate schedule (Megatron-LM's flags)."""

    micro_batch_size: int = setting(required=True, help="samples per microbatch")
    global_batch_size: int | None = setting(help="default: micro batch size x data-parallel size")
    train_iters: int | None = setting(help="training steps (give this or --train-samples)")
    train_samples: int | None = setting(help="training samples instead of --train-iters (Megatron-LM's "
                                             "sample-based training: steps = samples // --global-batch-size; the LR "
                                             "schedule counts samples)")
    rampup_batch_size: tuple[int, ...] | None = setting(
        nargs=3,
        help="START INCREMENT SAMPLES: Megatron-LM's batch-size ramp-up (with --train-samples): the global "
             "batch starts at START and grows by INCREMENT every SAMPLES / ((--global-batch-size - START) / "
             "INCREMENT) consumed samples up to --global-batch-size; each step's microbatches are shared "
             "among the pipelines in proportion to the plan's counts")
    optimizer: str = setting("adam", choices=("adam", "sgd"), help="optimizer")
    lr: float = setting(required=True, help="peak learning rate")
    min_lr: float = setting(0.0, help="learning rate at the end of the decay")
    lr_decay_style: str = setting("linear", choices=LR_DECAY_STYLES, help="decay after warmup")
    lr_decay_iters: int | None = setting(help="default: --train-iters")
    lr_warmup_iters: int = setting(0, help="linear warmup steps")
    lr_decay_samples: int | None = setting(help="with --train-samples: decay over this many samples (default: "
                                                "--train-samples)")
    lr_warmup_samples: int = setting(0, help="with --train-samples: linear warmup over this many samples")
    lr_warmup_fraction: float | None = setting(help="warmup over this share of the decay (instead of "
                                                    "--lr-warmup-iters / --lr-warmup-samples)")
    decoupled_lr: float | None = setting(help="the learning rate of the input embedding and the output layer "
                                              "(Megatron-LM's; default: --lr)")
    decoupled_min_lr: float | None = setting(help="the minimum learning rate of the input embedding and the output "
                                                  "layer (default: --min-lr)")
    weight_decay: float = setting(0.01, help="decoupled weight decay")
    override_opt_param_scheduler: bool = setting(
        False, flag="--override-opt_param-scheduler",
        help="on --load, use the flags' LR schedule (--lr, --min-lr, --lr-warmup-iters, --lr-decay-iters, "
             "--lr-decay-style, --weight-decay) from the checkpoint's position; default: a difference is an error")
    use_checkpoint_opt_param_scheduler: bool = setting(
        False, flag="--use-checkpoint-opt_param-scheduler",
        help="on --load, keep the checkpoint's LR schedule whatever the flags say; default: a difference is an error")
    clip_grad: float = setting(1.0, help="global gradient-norm clipping (0: off)")
    adam_beta1: float = setting(0.9, help="Adam beta1")
    adam_beta2: float = setting(0.999, help="Adam beta2")
    adam_eps: float = setting(1e-8, help="Adam epsilon")
    seed: int = setting(1234, help="seed of weights, data order and dropout")
    bf16: bool = setting(False, help="bf16 weights and activations, fp32 master weights")
    fp16: bool = setting(False, help="fp16 weights and activations, fp32 master weights, the loss scaled (dynamic "
                                     "unless --loss-scale); a step whose gradients overflow is skipped "
                                     "(Megatron-LM's)")
    loss_scale: float | None = setting(help="with --fp16: a constant loss scale (default: dynamic, from "
                                            "--initial-loss-scale)")
    initial_loss_scale: float = setting(2.0**32, help="with --fp16: the dynamic loss scale's start")
    min_loss_scale: float = setting(1.0, help="with --fp16: the dynamic loss scale's floor")
    loss_scale_window: float = setting(1000.0, help="with --fp16: steps without overflow before the dynamic loss "
                                                    "scale doubles")
    hysteresis: int = setting(2, help="with --fp16: overflowing steps (since the scale last grew) before the dynamic "
                                           "loss scale halves; each further one halves it")
    grad_reduce_in_bf16: bool = setting(False, help="with --bf16: gradients accumulated and reduced over data "
                                                    "parallelism in bf16 (default: fp32, as Megatron-LM)")
    exit_duration_in_mins: int | None = setting(help="stop (and save, with --save) after the first step that ends "
                                                     "this many minutes after the process started (Megatron-LM's)")
    # --- evaluation (issue 45) ---
    eval_iters: int = setting(0, help="global batches of the validation split each evaluation runs forward only "
                                      "(Megatron-LM's default is 100; here 0: no evaluation unless asked)")
    eval_interval: int | None = setting(help="evaluate every N steps (and always after the last); default "
                                             "(Megatron-LM's): only after the last step")
    skip_train: bool = setting(False, help="no training: evaluate (validation, then test) at the step of --load "
                                           "and stop, saving nothing (Megatron-LM's; needs --eval-iters)")
    # --- end evaluation ---

    def __post_init__(self) -> None:
        if self.fp16 and self.bf16:
            raise ValueError("--fp16 and --bf16 are exclusive (Megatron-LM's rule: one half-precision type); "
                             "give one of them")
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise ValueError(f"--loss-scale must be > 0, got {self.loss_scale}; drop it for the dynamic loss scale")
        if self.min_loss_scale <= 0 or self.initial_loss_scale < self.min_loss_scale:
            raise ValueError(f"the dynamic loss scale needs 0 < --min-loss-scale <= --initial-loss-scale, got "
                             f"{self.min_loss_scale} and {self.initial_loss_scale}")
        if self.loss_scale_window < 1 or self.hysteresis < 1:
            raise ValueError(f"--loss-scale-window and --hysteresis count steps and must be >= 1, got "
                             f"{self.loss_scale_window} and {self.hysteresis}")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """``--save`` / ``--load`` (Elastor's layout-agnostic format, or Megatron's torch_dist)."""

    save: str | None = setting(path=True, help="directory to save checkpoints into")
    load: str | None = setting(path=True, help="directory to resume from")
    save_interval: int | None = setting(help="save every N steps (and at the end)")
    format: str = setting("auto", flag="--hetu-ckpt-format", choices=("auto", "hetu", "torch_dist"),
                          help="--save format: hetu (layout-agnostic shards, async, any plan) or torch_dist "
                               "(Megatron's dist_checkpointing, uniform runtime); auto: hetu, or torch_dist with "
                               "--use-distributed-optimizer. --load recognises either")
    fallback: bool = setting(False, flag="--hetu-ckpt-fallback",
                             help="if the latest checkpoint is corrupt or incomplete, load the previous complete one")
    keep: int = setting(2, flag="--hetu-ckpt-keep",
                        help="complete hetu checkpoints of this run kept (>= 1); other runs' are never deleted")
    reuse_dir: bool = setting(False, flag="--hetu-ckpt-reuse-dir",
                              help="let --save write into a directory that holds another run's checkpoints "
                                   "(refused by default); they stay untouched, never deleted or replaced, and the "
                                   "tracker then names this run's")
    read: str = setting("node", flag="--hetu-ckpt-read", choices=("node", "once"),
                        help="hetu --load: node (each host reads the shards its ranks need, through its page cache; "
                             "no network traffic) or once (each shard read by one rank, sent point to point)")


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """Log lines, the metrics file, TensorBoard and W&B."""

    log_interval: int = setting(1, help="print a Megatron-LM log line every N steps")
    metrics_file: str | None = setting(flag="--hetu-metrics-file", path=True,
                                       help="JSONL file of one record per step and per event (default: "
                                            "metrics.jsonl in --save or --tensorboard-dir, if given)")
    tensorboard_dir: str | None = setting(path=True, help="write the step records' scalars as TensorBoard events")
    wandb_project: str | None = setting(help="log the step records to this W&B project (needs wandb)")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where samples come from (Megatron-LM's flags)."""

    mock_data: bool = setting(False, help="Megatron's MockGPTDataset")
    data_path: tuple[str, ...] | None = setting(nargs="+", path=True, help="indexed dataset prefix(es)")
    split: str = setting("969,30,1", help="train,valid,test weights")
    tokenizer_type: str = setting("ByteLevelTokenizer", choices=TOKENIZER_TYPES,
                                  help="tokenizer; HuggingFaceTokenizer, GPT2BPETokenizer and Llama2Tokenizer "
                                       "(SentencePiece) are read from local files (nothing downloaded)")
    vocab_size: int | None = setting(help="for NullTokenizer; with a file tokenizer, set from its files (a "
                                          "different value is refused)")
    tokenizer_model: str | None = setting(path=True, help="HuggingFaceTokenizer: a local directory with "
                                                          "tokenizer.json and tokenizer_config.json; "
                                                          "Llama2Tokenizer: a SentencePiece model file")
    vocab_file: str | None = setting(path=True, help="GPT2BPETokenizer: GPT-2's vocab.json")
    merge_file: str | None = setting(path=True, help="GPT2BPETokenizer: GPT-2's merges.txt")
    data_cache_path: str | None = setting(path=True, help="where Megatron's dataset builder caches indexes")


@dataclass(frozen=True, kw_only=True)
class PackingConfig:
    """Hydraulis: variable-length documents packed into THD microbatches."""

    method: str = setting("off", flag="--hetu-packing", choices=PACKING_METHODS,
                          help="off: Megatron's fixed-length samples; else documents packed into THD microbatches "
                               "of at most --seq-length tokens: unpacked (one per microbatch), concat "
                               "(Megatron-style cut, per-document attention), concat-causal (the same packs, "
                               "attention over the whole pack), ffd, greedy (DeepSpeed-style by tokens), balanced "
                               "(two-stage, length-aware)")
    global_batch_tokens: int | None = setting(flag="--hetu-global-batch-tokens",
                                              help="a global batch is as many sequences as fit in this many tokens "
                                                   "(default: --global-batch-size sequences)")
    cost_model: str | None = setting(flag="--hetu-cost-model", metavar="YAML", path=True,
                                     help="per-layer time a*s^2+b*s+c per TP degree (python -m "
                                          "hetu_ext.cli.calibrate); default: built-in coefficients")
    varlen_mock: str | None = setting(flag="--hetu-varlen-mock", metavar="JSON",
                                      help='with --mock-data: document lengths, {"mode": "file", "path": ...} or '
                                           '{"mode": "distribution", "type": "lognormal", "min_seq_len": ..., '
                                           '"max_seq_len": ..., "mean_seq_len": ..., "lognormal_sigma": ...}')
    mock_documents: int = setting(100_000, flag="--hetu-mock-documents", help="documents drawn for "
                                                                              "--hetu-varlen-mock")
    hotspa: str | None = setting(flag="--hetu-hotspa", metavar="FILE|auto",
                                 help="HotSPa: train each length group of a step under its own strategy (YAML list "
                                      "of strategies with max_len; auto: chosen per step), switching weights and "
                                      "gradients to and from the home strategy that holds the optimizer")
    strategies: str | None = setting(flag="--hetu-strategies", metavar="FILE|auto",
                                     help="Hydraulis: train each step under the candidate plan (YAML list of "
                                          "strategies, as --hetu-hotspa's; auto: candidates from the data's lengths) "
                                          "with the lowest predicted time for its lengths, switching weights and "
                                          "gradients to and from the home candidate that holds the optimizer")
    hotspa_bandwidth_gbs: float = setting(100.0, flag="--hetu-hotspa-bandwidth",
                                          help="GB/s per device assumed for the predicted switch time (HotSPa auto "
                                               "grouping, Hydraulis selection)")


@dataclass(frozen=True, kw_only=True)
class StragglerConfig:
    """Malleus: per-rank slowdowns measured, re-planning online, emulation on CPU."""

    interval: int = setting(0, flag="--hetu-straggler-interval",
                            help="measure per-rank slowdowns every N steps and propose a Malleus plan (0: off)")
    threshold: float = setting(1.3, flag="--hetu-straggler-threshold", help="slowdown that counts as a straggler")
    min_change: float = setting(0.2, flag="--hetu-straggler-min-change", help="change of an estimate that counts")
    window: int = setting(5, flag="--hetu-straggler-window", help="steps an estimate is averaged over")
    replan: str = setting("off", flag="--hetu-straggler-replan", choices=("off", "online"),
                          help="online: migrate to the Malleus plan the monitor proposes, without restarting")
    gpus_per_node: int | None = setting(flag="--hetu-gpus-per-node", help="for planning (default: one node)")
    replan_output: str | None = setting(flag="--hetu-replan-output", path=True,
                                        help="write the proposed plan here (YAML)")
    migrate: str | None = setting(flag="--hetu-migrate", metavar="SCHEDULE",
                                  help='move the running job to other plans: "step=3:plan=a.yaml[,step=8:plan=b.yaml]"'
                                       " (after step 3, ...), parameters and optimizer state resharded online")
    emulate_slowdown: str | None = setting(flag="--hetu-emulate-slowdown", metavar="SCHEDULE",
                                           help='emulate stragglers: "step=20:rank=3:x=4[,step=60:rank=3:x=1]" pads '
                                                "each layer of rank 3 to 4x its time from step 20")
    emulate_layer_ms: float | None = setting(flag="--hetu-emulate-layer-ms",
                                             help="emulated device time of one layer's forward per microbatch "
                                                  "(backward 2x) on every rank (needs the straggler monitor)")
    emulate_cost: str | None = setting(flag="--hetu-emulate-cost", path=True, metavar="FILE",
                                       help="pad each layer's forward and backward to the time a cost table "
                                            "(YAML of python -m hetu_ext.cli.calibrate) gives for the "
                                            "microbatch it ran at its stage's TP degree (forward 1/3, backward 2/3)")


# --- LobRA (issue 16): joint multi-LoRA fine-tuning ---
@dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """LobRA: many tenants' LoRA adapters trained jointly over one frozen base (hetu_ext.lora)."""

    tenants: str | None = setting(flag="--hetu-lora-tenants", path=True, metavar="YAML",
                                  help="train the tenants of this file (data, per-step share, LoRA settings; "
                                       "configs/lobra/) jointly, each its own adapter over the frozen base")
    # --- LobRA pretrained base (issue 16) ---
    pretrained_checkpoint: str | None = setting(flag="--pretrained-checkpoint", path=True, metavar="DIR",
                                                help="with --hetu-lora-tenants: the frozen base's weights from the "
                                                     "latest hetu checkpoint under DIR (a --save directory of a "
                                                     "pretraining run, any layout; weights only), before --load "
                                                     "resumes the adapters")
    # --- end LobRA pretrained base ---
# --- end LobRA ---


SECTIONS: dict[str, type] = {
    "launch": LaunchConfig, "model": ModelConfig, "parallel": ParallelConfig, "training": TrainingConfig,
    "checkpoint": CheckpointConfig, "logging": LoggingConfig, "data": DataConfig, "packing": PackingConfig,
    "straggler": StragglerConfig,
    "lora": LoRAConfig,  # LobRA (issue 16)
}
"""YAML section -> its dataclass; also the groups of ``--help``."""


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Every setting of a pretrain_gpt.py run, one section per component."""

    launch: LaunchConfig = field(default_factory=LaunchConfig)
    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    packing: PackingConfig = field(default_factory=PackingConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # LobRA (issue 16)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The YAML form: ``{section: {key: value}}`` (a file of this reproduces the run). Steps derived from
        ``--train-samples`` are written as null: the file gives the samples, as the command line did."""
        out = {name: {f.name: _plain(getattr(getattr(self, name), f.name))
                      for f in dataclasses.fields(SECTIONS[name])} for name in SECTIONS}
        if self.training.train_samples is not None:
            out["training"]["train_iters"] = None
        return out

    def to_flat_dict(self) -> dict[str, Any]:
        """``{flag destination: value}`` (``num_layers``, ``hetu_packing``, ...): the form checkpoint manifests
        record, as the argparse namespace did."""
        return {dest_of(f): _plain(getattr(getattr(self, name), f.name))
                for name in SECTIONS for f in dataclasses.fields(SECTIONS[name])}


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def flag_of(f: dataclasses.Field) -> str:
    """The command-line flag of a setting."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def dest_of(f: dataclasses.Field) -> str:
    """The argparse destination of a setting (the flag without dashes)."""
    return flag_of(f)[2:].replace("-", "_")

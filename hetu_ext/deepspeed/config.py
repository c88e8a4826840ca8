"""What the DeepSpeed path is asked for beyond Megatron-LM's flags, and the DeepSpeed config made from both (pure:
no process group, DeepSpeed not imported): ``--zero-stage``, ``--deepspeed-config``, ``--hetu-microbatches``, and the
hetu_ext features the path refuses with one line each."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from hetu_ext.config import RunConfig

ZERO_STAGES = (0, 1, 2, 3)


FP16_REFUSAL = ("--fp16 is not supported on the DeepSpeed path: Megatron-LM's dynamic loss scaling is not mapped to "
                "DeepSpeed's fp16 config (nor its scaler state to hetu checkpoints); use --bf16 with --zero-stage "
                "1, 2 or 3")


def add_deepspeed_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("deepspeed")
    g.add_argument("--zero-stage", type=int, choices=ZERO_STAGES, default=2,
                   help="ZeRO stage (default 2; 0: DeepSpeed without ZeRO; with --bf16 its BF16_Optimizer)")
    g.add_argument("--deepspeed-config", default=None,
                   help="a DeepSpeed JSON config merged over the one built from the flags (its batch sizes, "
                        "optimizer and precision must agree with the flags)")
    g.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")
    g.add_argument("--hetu-microbatches", type=_counts, default=None, metavar="N,N,...",
                   help="microbatches per rank per global batch (ZeRO-0/1; they sum to the global batch's "
                        "microbatches), e.g. 3,1 for a rank 3x slower; with --hetu-straggler-interval the "
                        "starting counts, then the measured speeds decide")
    g.add_argument("--exit-interval", type=_positive, default=None, metavar="N",
                   help="stop after the first step whose number is a multiple of N, saving first with --save "
                        "(Megatron-LM's flag)")
    g.add_argument("--ckpt-step", type=_positive, default=None, metavar="N",
                   help="with --load: resume from the checkpoint of step N instead of the newest (Megatron-LM's flag)")
    return parser


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a step count of at least 1")
    return value


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(c) for c in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected microbatch counts like 3,1") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every rank needs at least 1 microbatch")
    return counts


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """What DeepSpeed is asked for beyond the Megatron-LM flags."""

    stage: int = 2
    """ZeRO stage: 0 (nothing partitioned: data parallel with an all-reduce per step), 1 (optimizer state
    partitioned), 2 (+ gradients), 3 (+ parameters)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Entries of a user's DeepSpeed config, merged over the built one."""
    microbatches: tuple[int, ...] | None = None
    """Microbatches per rank (``--hetu-microbatches``); None: equal shares, or the straggler monitor's."""
    straggler_interval: int = 0
    """``--hetu-straggler-interval``: follow measured speeds with the microbatch counts (weighting.py)."""
    packing: str = "off"
    """``--hetu-packing``: the caller's backwards make a step (pack counts evened out under ZeRO-2/3)."""

    def __post_init__(self) -> None:
        from .weighting import check_stage

        if self.stage not in ZERO_STAGES:
            raise ValueError(f"ZeRO stage {self.stage} is not one of {ZERO_STAGES}; pass --zero-stage 0, 1, 2 or 3")
        check_stage(self.stage, self.microbatches)

    @property
    def weighted(self) -> bool:
        """Per-rank shares of the global batch: DeepSpeed's unmanaged gradient accumulation."""
        return bool(self.microbatches or self.straggler_interval or self.packing != "off")


_FROM_FLAGS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
               "gradient_clipping")


def deepspeed_config(config: RunConfig, zero: ZeroConfig, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config of the settings: ZeRO stage, batch sizes, clipping (``bf16`` is added by ``--bf16``)."""
    training = config.training
    mbs = training.micro_batch_size
    gbs = training.global_batch_size or mbs * world_size
    if gbs % (mbs * world_size):
        raise ValueError(f"--global-batch-size {gbs} must be a multiple of --micro-batch-size {mbs} x world size "
                         f"{world_size}")
    ds = {"train_batch_size": gbs, "train_micro_batch_size_per_gpu": mbs,
          "gradient_accumulation_steps": gbs // (mbs * world_size), "gradient_clipping": training.clip_grad,
          "zero_optimization": {"stage": zero.stage}, "zero_allow_untested_optimizer": True,
          "steps_per_print": 2**31 - 1, "wall_clock_breakdown": False}
    if zero.microbatches is not None and (len(zero.microbatches) != world_size
                                          or sum(zero.microbatches) * mbs != gbs):
        raise ValueError(f"--hetu-microbatches {','.join(map(str, zero.microbatches))} must give each of the "
                         f"{world_size} ranks a count, summing to --global-batch-size {gbs} / --micro-batch-size "
                         f"{mbs} = {gbs // mbs}; give {world_size} counts with that sum")
    if zero.weighted:  # the caller's backwards make a step: per-rank counts may differ (weighting.py)
        ds["managed_gradient_accumulation"] = False
    for key, value in zero.extra.items():
        if key in ("optimizer", "scheduler") or (key in ("fp16", "bf16") and dict(value).get("enabled", False)):
            raise ValueError(f"--deepspeed-config sets {key}={value!r}; this path takes precision, torch's AdamW "
                             "and Megatron's LR schedule from the flags: remove it and use --bf16, --lr, "
                             "--lr-decay-style, --adam-* instead")
        stage = dict(value).get("stage", zero.stage) if key == "zero_optimization" else zero.stage
        if (key in _FROM_FLAGS and ds[key] != value) or stage != zero.stage:
            raise ValueError(f"--deepspeed-config sets {key}={value!r} but the flags give {ds.get(key)!r}; "
                             "make them agree (set batch sizes, clipping and --zero-stage through the flags)")
        ds[key] = {**ds[key], **value} if key == "zero_optimization" else value
    return ds


def check_supported(config: RunConfig) -> None:
    """The hetu_ext features this path does not take, refused before launch with one line each."""
    refused = {"--hetu-plan": config.parallel.plan, "--use-distributed-optimizer":
               config.parallel.use_distributed_optimizer, "--hetu-hotspa": config.packing.hotspa,
               "--hetu-strategies": config.packing.strategies, "--hetu-lora-tenants": config.lora.tenants,
               "--hetu-migrate": config.straggler.migrate,
               "--hetu-straggler-replan online": config.straggler.replan == "online",
               "--hetu-ckpt-format torch_dist": config.checkpoint.format == "torch_dist",
               "--hetu-emulate-cost": config.straggler.emulate_cost}
    t = config.training
    if t.fp16:
        raise ValueError(FP16_REFUSAL)
    refused.update({"--eval-iters": t.eval_iters, "--skip-train": t.skip_train, "--decoupled-lr": t.decoupled_lr,
                    "--decoupled-min-lr": t.decoupled_min_lr, "--grad-reduce-in-bf16": t.grad_reduce_in_bf16,
                    "--exit-duration-in-mins": t.exit_duration_in_mins, "--rampup-batch-size": t.rampup_batch_size})
    for flag, value in refused.items():
        if value:
            raise ValueError(f"{flag} is a feature of launch/pretrain_gpt.py; the DeepSpeed path shards with ZeRO "
                             "over data-parallel ranks and weights microbatches per rank (--zero-stage 1 "
                             f"--hetu-straggler-interval N): drop {flag.split()[0]} or use launch/pretrain_gpt.py")

"""Mixture-of-experts flags on Megatron-LM's own loop: what hetu checkpoints and the CPU rehearsal do with each.

Megatron-LM implements MoE itself (``--num-experts`` and the ``--moe-*`` flags); hetu_ext adds two things on its
loop, and each needs a rule per flag:

* **hetu checkpoints** (``--hetu-ckpt-format hetu``): an expert tensor is saved as pieces of its global tensor,
  indexed ``(layer, expert)`` (:mod:`hetu_ext.model.inventory`: a piece is an expert range and a box of each
  expert's tensor), so EP, expert TP, TP, PP and DP are layouts of the same checkpoint, the distributed optimizer's
  expert shards (its expert-data-parallel ranges) included. :data:`CKPT_RULES` lists the MoE flags with a rule: the
  ones whose state the inventory describes, and the ones that only route or dispatch tokens (no state of their own).
  Any other MoE flag is refused by name before anything runs or is written (:func:`ckpt_problem`): a flag that adds
  state hetu_ext does not know (a latent projection, upcycling) must not be saved partially.
* **the CPU rehearsal**: :data:`CPU_DROPPED` (merged into :mod:`.rehearsal`'s): grouped GEMM's kernels exist only on
  CUDA (``grouped_gemm``, Transformer Engine); on CPU the experts run one GEMM each (Megatron-core's SequentialMLP),
  whose weights are the same global expert tensors.

The token dispatcher runs as the recipe asks: Megatron-LM's ``alltoall`` dispatcher works on gloo (its uneven
``all_to_all_single`` splits; the CUDA stream of its device-to-host copies is a null one on CPU,
:mod:`hetu_ext.patches.megatron_cpu`).
"""

from __future__ import annotations

EXPERT_PARALLEL = ("--expert-model-parallel-size", "--expert-tensor-parallel-size")

CKPT_RULES: dict[str, str] = {
    "--num-experts": "expert tensors saved with a global expert axis (layer, expert)",
    "--moe-ffn-hidden-size": "each expert's width: the expert tensors' shape",
    "--moe-layer-freq": "MoE and dense layers: each layer's tensors under its number, as Megatron-core keys them",
    "--moe-shared-expert-intermediate-size": "the shared experts: a dense MLP of the layer",
    "--moe-shared-expert-gate": "the shared experts' gate weight",
    "--moe-router-enable-expert-bias": "the router's expert bias buffer, saved with the model",
    "--expert-model-parallel-size": "a layout: EP ranks hold expert ranges of the global tensors",
    "--expert-tensor-parallel-size": "a layout: expert TP cuts each expert's tensor as TP cuts a dense one",
    "--moe-router-topk": "routing only (no state)",
    "--moe-router-load-balancing-type": "the auxiliary loss (no state)",
    "--moe-aux-loss-coeff": "the auxiliary loss (no state)",
    "--moe-z-loss-coeff": "the router's z-loss (no state)",
    "--moe-router-score-function": "routing only (no state)",
    "--moe-router-pre-softmax": "routing only (no state)",
    "--moe-router-dtype": "the router's arithmetic (no state)",
    "--moe-token-dispatcher-type": "dispatch only (no state)",
    "--moe-expert-capacity-factor": "dispatch only (no state)",
    "--moe-pad-expert-input-to-capacity": "dispatch only (no state)",
    "--moe-token-drop-policy": "dispatch only (no state)",
    "--moe-grouped-gemm": "one weight per expert set: on CPU rewritten to per-expert weights (the same global "
                          "tensors); refused on CUDA, where the grouped weights' layout has no rule yet",
}
"""MoE flag -> what hetu checkpoints do with it. Every other ``--moe-*`` flag is refused with them."""

CPU_DROPPED: dict[str, tuple[int, str]] = {
    "--moe-grouped-gemm": (0, "per-expert GEMMs (Megatron-core's SequentialMLP; the grouped kernels need CUDA): the "
                              "same global expert tensors"),
    "--moe-permute-fusion": (0, "the unfused token permutation (same tokens, same order)"),
}
"""MoE flags whose kernels exist only on CUDA: (values it takes, what runs instead), as :mod:`.rehearsal` lists."""


def weighting_problem(argv: list[str]) -> str | None:
    """``--hetu-straggler-interval`` gives each data-parallel rank its own microbatch count. Under expert
    parallelism > 1 the EP group is made of data-parallel ranks, and every MoE layer exchanges tokens with an
    all-to-all over it, once per microbatch: ranks with different counts would wait for a collective the others never
    start. And within a layer every rank of the group waits for the slowest, so the per-layer timer sees no straggler
    (measured before this rule: rank 1 emulated 6x slow under EP 4 was seen at 1.12x and nothing moved). Refused in
    one line; under EP 1 (experts replicated over DP, no collective inside the layers) weighting runs as for a
    dense model."""
    ep = _last_value(argv, "--expert-model-parallel-size")
    if ep is not None and ep != "1" and _last_value(argv, "--num-experts") is not None:
        return (f"--hetu-straggler-interval cannot weight an MoE run under --expert-model-parallel-size {ep}: its "
                "experts' all-to-all is a collective of the EP group's data-parallel ranks in every MoE layer and "
                "microbatch, so they must run the same microbatches (and each waits for the slowest inside the "
                "layer, hiding the straggler); use --expert-model-parallel-size 1 or drop --hetu-straggler-interval")
    return None


def _last_value(argv: list[str], flag: str) -> str | None:
    """The value Megatron-LM's parser gives ``flag`` (its last occurrence wins), None when absent."""
    value = None
    for i, token in enumerate(argv):
        name, eq, inline = token.partition("=")
        if name == flag:
            value = inline if eq else (argv[i + 1] if i + 1 < len(argv) else "")
    return value


def is_moe_flag(flag: str) -> bool:
    return flag == "--num-experts" or flag.startswith("--moe-") or flag in EXPERT_PARALLEL


def ckpt_problem(present: list[str], *, cpu: bool) -> str | None:
    """The one-line refusal of the first MoE flag of ``present`` that hetu checkpoints have no rule for on this
    machine (``cpu``: the rehearsal's rewrite has run), or None."""
    for flag in present:
        if not is_moe_flag(flag):
            continue
        if flag not in CKPT_RULES:
            return (f"--hetu-ckpt-format hetu has no rule for the MoE option {flag} (its state, or its effect on "
                    "the experts' tensors, is not in hetu_ext's inventory); use Megatron-LM's own checkpoints "
                    f"(--hetu-ckpt-format auto) or drop {flag}")
        if flag == "--moe-grouped-gemm" and not cpu:
            return ("--hetu-ckpt-format hetu has no rule for grouped-GEMM expert weights on CUDA (--moe-grouped-gemm: "
                    "Transformer Engine's or the legacy grouped layout); drop --moe-grouped-gemm (per-expert "
                    "weights, the same global tensors) or use --hetu-ckpt-format auto")
    return None

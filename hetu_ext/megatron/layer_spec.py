"""Which Megatron-core layer spec a stage is built from, and what each hetu_ext mechanism that names modules does
under it.

``--transformer-impl local`` (the default) is Megatron-core's local spec: torch modules, the norms standalone
(``input_layernorm``, ``pre_mlp_layernorm``), the core attention replaced through the ModuleSpec seam
(:mod:`hetu_ext.megatron.attention`). ``--transformer-impl transformer_engine`` is Megatron-core's Transformer
Engine spec (``get_gpt_layer_with_transformer_engine_spec``): each norm fused into the GEMM after it
(``TELayerNormColumnParallelLinear``, whose parameter is ``linear_qkv.layer_norm_weight``), TENorm for the
query/key norms and the final norm, and TE's fused attention (``TEDotProductAttention``: cuDNN / flash kernels,
THD packs through ``cu_seqlens``).

What each mechanism does under each spec (:func:`choose_layer_spec` decides; :func:`layer_spec_of` and
:func:`mark_te_norms` apply it in :func:`hetu_ext.megatron.model.build_gpt_stage`):

===================== ======================================== ==================================================
mechanism             local spec                               Transformer Engine spec
===================== ======================================== ==================================================
core attention        ``--hetu-attention``: ScoreFreeAttention TE's ``TEDotProductAttention`` (never materialises
                      (sdpa) or PackedDotProductAttention      the scores either); ``--hetu-attention megatron``
                                                               is refused with it
norms (SP, 1p)        :class:`~.model.LocalNorm` replaces      TE's norms take ``sequence_parallel`` and
                      torch's for ``--sequence-parallel`` and  ``zero_centered_gamma`` themselves; hetu_ext marks
                      ``--apply-layernorm-1p``                 their parameters (:func:`mark_te_norms`) so its
                                                               initialisation stores gamma - 1 and Megatron's
                                                               grad finalisation sums SP norms over TP
checkpoint keys       ``sharded_state_dict_keys_map`` maps     TE's own names: the same keys, so a checkpoint
                      the standalone norms to TE's names       of either spec loads into the other
                      (``input_layernorm.`` ->
                      ``linear_qkv.layer_norm_``)
LoRA adapters         the four linears replaced                refused (TE's fused norm+linear modules have no
                                                               LoRA layer here)
===================== ======================================== ==================================================

Transformer Engine cannot be installed on the project's CPU machines (it builds against CUDA), so the TE branch
of :func:`layer_spec_of` and :func:`mark_te_norms` on a TE model have not run; :func:`choose_layer_spec`,
:func:`te_norm_parameter` and the refusals are tested pure (tests/test_layer_spec.py). Imports nothing at module
level but the standard library.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass

TRANSFORMER_IMPLS = ("local", "transformer_engine")


@dataclass(frozen=True)
class LayerSpecChoice:
    """What build_gpt_stage builds: ``impl`` (:data:`TRANSFORMER_IMPLS`); ``core_attention``: ``sdpa`` /
    ``megatron`` (hetu_ext's classes on the local spec) or ``transformer_engine`` (the spec's own, kept);
    ``local_norms``: replace the local spec's torch norms by LocalNorm (sequence parallelism or zero-centred
    gamma); ``mark_te_norms``: mark TE's norm parameters after the build (:func:`mark_te_norms`)."""

    impl: str
    core_attention: str
    local_norms: bool
    mark_te_norms: bool


def choose_layer_spec(impl: str, attention: str, *, sequence_parallel: bool, zero_centered_gamma: bool,
                      lora: bool = False) -> LayerSpecChoice:
    """The layer spec of ``--transformer-impl impl`` with ``--hetu-attention attention``; ValueError (one line:
    rule, values, fix) for a combination hetu_ext does not build."""
    if impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"--transformer-impl {impl}: hetu_ext's trainer builds {' or '.join(TRANSFORMER_IMPLS)}; "
                         "give one of them")
    if impl == "local":
        return LayerSpecChoice(impl=impl, core_attention=attention,
                               local_norms=sequence_parallel or zero_centered_gamma, mark_te_norms=False)
    if attention != "sdpa":
        raise ValueError(f"--hetu-attention {attention} picks the local spec's core attention; with "
                         "--transformer-impl transformer_engine the core attention is Transformer Engine's fused "
                         "one: drop --hetu-attention or give --transformer-impl local")
    if lora:
        raise ValueError("--hetu-lora-tenants adapts the local spec's linear layers; with --transformer-impl "
                         "transformer_engine the norms are fused into TE's linears, which hetu_ext's LoRA does not "
                         "wrap: give --transformer-impl local")
    return LayerSpecChoice(impl=impl, core_attention="transformer_engine", local_norms=False,
                           mark_te_norms=sequence_parallel or zero_centered_gamma)


def transformer_engine_missing() -> str | None:
    """Why ``--transformer-impl transformer_engine`` cannot run in this process (None: it can): the package
    absent, no CUDA device, or its import failing. Looks the package up before importing torch or it."""
    if importlib.util.find_spec("transformer_engine") is None:
        return "transformer_engine is not installed (it builds against CUDA)"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device (Transformer Engine's kernels are CUDA only)"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # any failure of a host's import is the reason to report, in one line
        return f"import transformer_engine.pytorch failed ({type(exc).__name__}: {str(exc).splitlines()[0]})"
    return None


def check_transformer_impl(impl: str, attention: str, *, lora: bool,
                           missing: Callable[[], str | None] = transformer_engine_missing) -> None:
    """The launcher's check, before any rank starts: the combination is built (:func:`choose_layer_spec`) and,
    for Transformer Engine, it can run here (``missing``: why not, :func:`transformer_engine_missing`)."""
    choose_layer_spec(impl, attention, sequence_parallel=False, zero_centered_gamma=False, lora=lora)
    if impl != "transformer_engine":
        return
    reason = missing()
    if reason is not None:
        raise ValueError(f"--transformer-impl transformer_engine needs Transformer Engine on a CUDA machine: {reason}; "
                         "install transformer_engine[pytorch] there, or give --transformer-impl local "
                         "(Megatron-core's local spec, the default)")


_TE_NORM = re.compile(r"(^|\.)(layer_norm_(weight|bias)|(q_|k_|final_)?layernorm\.(weight|bias))$")


def te_norm_parameter(name: str) -> bool:
    """Whether the parameter ``name`` of a stage model built from the TE spec is a norm's: the norms fused into
    ``linear_qkv`` / ``linear_fc1`` (``layer_norm_weight``, ``layer_norm_bias``: the names the local spec's
    ``sharded_state_dict_keys_map`` gives its ``input_layernorm`` / ``pre_mlp_layernorm``), the query/key norms
    and the final norm."""
    return _TE_NORM.search(name) is not None


def mark_te_norms(model, *, sequence_parallel: bool, zero_centered_gamma: bool) -> int:
    """Mark the TE spec's norm parameters as hetu_ext's local norms are marked: ``sequence_parallel`` (each TP rank
    normalises 1/TP of the sequence, so Megatron's grad finalisation sums the gradients over TP) and, for
    weights, ``zero_centered_gamma`` (hetu_ext's initialisation stores gamma - 1, i.e. 0). Returns how many."""
    count = 0
    for name, param in model.named_parameters():
        if not te_norm_parameter(name):
            continue
        if sequence_parallel:
            param.sequence_parallel = True
        if zero_centered_gamma and name.endswith("weight"):
            param.zero_centered_gamma = True
        count += 1
    return count


def layer_spec_of(choice: LayerSpecChoice, *, qk_layernorm: bool, normalization: str):
    """Megatron-core's transformer-layer spec of ``choice``, its core attention replaced on the local spec."""
    if choice.impl == "transformer_engine":  # not run on the project's machines (no Transformer Engine there)
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from .attention import core_attention

    layer_spec = get_gpt_layer_local_spec(normalization=normalization, qk_layernorm=qk_layernorm)
    # the core attention (--hetu-attention: SDPA by default; both take THD packs): Megatron's ModuleSpec seam
    layer_spec.submodules.self_attention.submodules.core_attention = core_attention(choice.core_attention)
    return layer_spec

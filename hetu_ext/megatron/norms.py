"""Torch norms for Megatron-core's local layer spec that take what its ``WrappedTorchNorm`` refuses.

Megatron-core 0.16.1's local spec builds ``torch.nn.LayerNorm`` / ``RMSNorm`` through ``WrappedTorchNorm``, which
asserts against two settings every Megatron-LM recipe may use:

* ``--apply-layernorm-1p`` (``layernorm_zero_centered_gamma``): the weight is stored as gamma - 1, initialised to
  0, and the norm scales by ``1 + weight`` (Transformer Engine's ``zero_centered_gamma``). :class:`ZeroCenteredLayerNorm`
  and :class:`ZeroCenteredRMSNorm` hold the same parameter names (``weight``, ``bias``) with Megatron's stored
  (zero-centred) values, so checkpoints of either spec hold the same numbers.
* ``--sequence-parallel``: each TP rank normalises 1/TP of the sequence, so the norm's gradients are partial sums;
  the parameters are marked ``sequence_parallel`` and Megatron's ``finalize_model_grads`` all-reduces them over the
  TP group (what Transformer Engine's norms carry on GPU).

``persist_layer_norm`` and ``memory_efficient_layer_norm`` pick Apex/TE kernels only; the torch norm computes the
same function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hetu_ext.patches.base import Patch, PatchSet


class ZeroCenteredLayerNorm(torch.nn.LayerNorm):
    """LayerNorm whose ``weight`` is gamma - 1 (initialised to 0)."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.elementwise_affine:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class ZeroCenteredRMSNorm(torch.nn.RMSNorm):
    """RMSNorm whose ``weight`` is gamma - 1 (initialised to 0)."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.elementwise_affine:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


def local_norm(config, hidden_size: int, eps: float = 1e-5) -> torch.nn.Module:
    """The norm of Megatron's local spec for ``config`` (a TransformerConfig), zero-centred and sequence-parallel
    when it says so."""
    zero = bool(getattr(config, "layernorm_zero_centered_gamma", False))
    kinds = {"LayerNorm": (torch.nn.LayerNorm, ZeroCenteredLayerNorm),
             "RMSNorm": (torch.nn.RMSNorm, ZeroCenteredRMSNorm)}
    if config.normalization not in kinds:
        raise ValueError(f"--normalization {config.normalization}: the local layer spec's torch norms are "
                         f"LayerNorm and RMSNorm; use one of them or Transformer Engine")
    norm = kinds[config.normalization][zero](hidden_size, eps=eps)
    if getattr(config, "sequence_parallel", False):
        for param in norm.parameters():
            param.sequence_parallel = True
    return norm


def _local_norm_new(original: object) -> staticmethod:
    def __new__(cls: type, config, hidden_size: int, eps: float = 1e-5, **_kernel_choices) -> torch.nn.Module:
        return local_norm(config, hidden_size, eps)

    return staticmethod(__new__)


def local_norm_patches() -> PatchSet:
    """Megatron-core's local spec norms taking ``--apply-layernorm-1p`` and ``--sequence-parallel`` (the norms of
    this module, for Megatron-LM's own loop); its ``WrappedTorchNorm`` asserts against both."""
    return PatchSet("megatron-local-norms", [
        Patch(name="local_norm:WrappedTorchNorm",
              target="megatron.core.transformer.torch_norm:WrappedTorchNorm.__new__", make=_local_norm_new, reason="asserts against zero-centred gamma (--apply-layernorm-1p) and "
                                           "sequence parallelism"),
    ])

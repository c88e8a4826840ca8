"""Megatron-core CPU patches: named, probed, removable, never applied twice, nothing patched when not needed."""

from __future__ import annotations

import importlib

import pytest
import torch
from hetu_ext.patches.base import Patch, PatchError, PatchSet
from hetu_ext.patches.megatron_cpu import megatron_cpu_patches, needs_cpu_patches


@pytest.fixture(autouse=True, scope="module")
def _process_patches_lifted():
    """These tests apply and remove the patches themselves: an earlier test of this process that left hetu_ext's
    own CPU support on (``enable_cpu_support``, e.g. through Megatron-LM's entry point run in-process) is lifted
    for them and put back after."""
    from hetu_ext.megatron import host

    was_on = host._CPU_PATCHES is not None and host._CPU_PATCHES.applied
    host.disable_cpu_support()
    yield
    if was_on:
        host.enable_cpu_support(True)


def _current(target: str):
    module, _, path = target.partition(":")
    owner = importlib.import_module(module)
    *parents, attr = path.split(".")
    for p in parents:
        owner = getattr(owner, p)
    return owner.__dict__.get(attr, getattr(owner, attr))


def test_apply_then_remove_restores_every_original():
    patches = megatron_cpu_patches()
    before = {p.target: _current(p.target) for p in patches.patches}
    patches.apply()
    try:
        for p in patches.patches:
            assert _current(p.target) is not before[p.target], p.name
        from megatron.core import utils as mcore_utils
        from megatron.core.tensor_parallel import random as mcore_random

        t = mcore_utils.torch.zeros(3, device="cuda")  # what megatron's own code does
        assert t.device.type == "cpu"
        assert mcore_utils.torch.cuda.current_device() == torch.device("cpu")
        state = mcore_random._get_cuda_rng_state()
        assert torch.equal(state, torch.get_rng_state())
    finally:
        patches.remove()
    for p in patches.patches:
        assert _current(p.target) is before[p.target], p.name
    assert not patches.applied


def test_fp16_loss_scaler_and_local_norms_build_on_cpu():
    """--fp16: Megatron-core's DynamicGradScaler makes its scale with device='cuda' (the gpt3 example's path); the
    local spec's WrappedTorchNorm asserts against zero-centred gamma and sequence parallelism until patched."""
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    from hetu_ext.megatron.norms import ZeroCenteredRMSNorm
    from hetu_ext.megatron.norms import local_norm_patches

    patches, norms = megatron_cpu_patches(), local_norm_patches()
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
                               layernorm_zero_centered_gamma=True, tensor_model_parallel_size=1)
    with pytest.raises(AssertionError, match="zero_centered_gamma"):
        WrappedTorchNorm(config, 8)
    patches.apply()
    norms.apply()
    try:
        scaler = DynamicGradScaler(initial_scale=2.0**16, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
                                   growth_interval=10, hysteresis=2)
        assert scaler.scale.device.type == "cpu" and scaler.scale.item() == 2.0**16
        norm = WrappedTorchNorm(config, 8, eps=1e-6)
        assert isinstance(norm, ZeroCenteredRMSNorm) and torch.equal(norm.weight, torch.zeros(8))
    finally:
        norms.remove()
        patches.remove()


def test_double_patching_is_an_error():
    first, second = megatron_cpu_patches(), megatron_cpu_patches()
    first.apply()
    try:
        with pytest.raises(PatchError, match="already patched by 'cpu_torch:tensor_parallel.random'"):
            second.apply()
        assert not second.applied  # all or nothing
        with pytest.raises(PatchError, match="already applied"):
            first.patches[0].apply()
    finally:
        first.remove()


def test_probe_fails_loudly_when_the_host_changed():
    missing = Patch(name="gone", target="megatron.core.utils:no_such_function", make=lambda f: f, reason="test")
    with pytest.raises(PatchError, match=r"megatron.core.utils:no_such_function not found; the host changed"):
        missing.probe()
    with pytest.raises(PatchError, match="cannot import 'megatron.core.no_such_module'"):
        Patch(name="x", target="megatron.core.no_such_module:f", make=lambda f: f, reason="test").probe()


def test_one_set_cannot_patch_a_target_twice():
    p = Patch(name="a", target="megatron.core.utils:get_model_config", make=lambda f: f, reason="test")
    q = Patch(name="b", target="megatron.core.utils:get_model_config", make=lambda f: f, reason="test")
    with pytest.raises(PatchError, match="more than once"):
        PatchSet("dup", [p, q])


def test_patches_apply_only_without_cuda_or_when_asked():
    assert needs_cpu_patches(True) is True
    assert needs_cpu_patches(False) is False
    assert needs_cpu_patches(None) is (not torch.cuda.is_available())


def test_every_patch_names_its_reason():
    for name, target, reason in megatron_cpu_patches().describe():
        assert name and ":" in target and len(reason) > 10

"""The first step's activation report (hetu_ext/megatron/activations.py): the meter counts each saved storage once
and releases it when autograd drops it; the prediction follows the inventory with 1F1B's microbatches in flight."""

from __future__ import annotations

import torch

from hetu_ext.megatron.activations import SavedTensorMeter, predicted_bytes
from hetu_ext.model import ModelSpec, inventory
from hetu_ext.plan import uniform_plan


def test_meter_counts_a_storage_once_and_releases_it_after_backward():
    """``x * x`` saves x twice, ``exp`` its output, ``* weight`` that output again and the parameter: two
    storages of 4 KiB (x, exp's output), the parameter not counted; after backward the graph's references are
    gone and a storage stays live only while something else holds it; the peak stays."""
    weight = torch.nn.Parameter(torch.randn(1024))
    module = torch.nn.Module()
    module.weight = weight
    meter = SavedTensorMeter(module)
    x = torch.randn(1024, requires_grad=True)
    with meter.measuring():
        y = (x * x).exp() * weight
    assert meter.current == meter.peak == 2 * 4096
    y.sum().backward()
    del y
    assert meter.current == 4096  # x: the test still holds it
    del x
    assert meter.current == 0 and meter.peak == 2 * 4096


def test_prediction_counts_the_microbatches_in_flight():
    """A 4-stage pipeline of 8 microbatches: stage 0 holds 4 in flight, the last 1; sequence parallelism halves a
    TP-2 stage; full recomputation keeps 2h per token plus one layer recomputed."""
    spec = ModelSpec(num_layers=8, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=128)
    plan = uniform_plan(world_size=4, tp=1, pp=4, num_layers=8, num_microbatches=8)
    first, n_first = predicted_bytes(spec, plan, 0, micro_batch_size=2, half=True, recompute="none",
                                     sequence_parallel=False)
    last, n_last = predicted_bytes(spec, plan, 3, micro_batch_size=2, half=True, recompute="none",
                                   sequence_parallel=False)
    per_layer = 2 * 128 * inventory.activation_bytes_per_token(spec, seq_length=128)
    assert (n_first, n_last) == (4, 1) and first == 4 * 2 * per_layer and last == 2 * per_layer
    full, _ = predicted_bytes(spec, plan, 3, micro_batch_size=2, half=False, recompute="full",
                              sequence_parallel=False)
    assert full == 2 * (2 * 128 * 2 * 64 * 2 + per_layer)  # fp32: twice the bytes
    tp2 = uniform_plan(world_size=2, tp=2, pp=1, num_layers=8, num_microbatches=1)
    plain, _ = predicted_bytes(spec, tp2, 0, micro_batch_size=2, half=True, recompute="full", sequence_parallel=False)
    sp, _ = predicted_bytes(spec, tp2, 0, micro_batch_size=2, half=True, recompute="full", sequence_parallel=True)
    assert sp < plain

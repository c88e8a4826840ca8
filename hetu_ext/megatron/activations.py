"""Activation memory of a rank's first step, measured beside the inventory's prediction (one log line per rank,
as Megatron-LM's ``[Rank r] (after 1 iterations) memory (MB)`` report).

Measured: the peak of what autograd keeps for backward on this rank during the step, read through
``torch.autograd.graph.saved_tensors_hooks``: each saved tensor's storage counted once while a saved reference to
it lives (a tensor saved by several ops, or RoPE's table kept by every recomputed layer, is one allocation),
parameters not at all. It covers everything the step keeps (the embedding's output, the logits the loss keeps,
a recomputed layer's activations during its backward), on any device, with no allocator statistics.

Predicted: the stage's layers from the model inventory (:func:`hetu_ext.model.inventory.activation_bytes_per_token`,
Korthikanti et al.'s count for fused kernels, with the run's recomputation and sequence parallelism) for the
microbatches 1F1B holds in flight, ``min(pp - stage, m)``; under full recomputation plus one layer recomputed
during its backward. The ``5 a s`` term of the attention scores counts only where the core attention keeps them
(:func:`keeps_scores`): Megatron's DotProductAttention (``--hetu-attention megatron``), and torch's SDPA with
dropout > 0 on CPU (its math kernel); hetu_ext's default attention keeps no ``s`` term per token. Megatron's local
layers on CPU keep more than fused kernels (torch's RMSNorm keeps fp32 copies; Megatron's softmax is fp32):
tests/test_llama_training.py measures where the two agree (recomputation, sequence parallelism) and where they
differ.
"""

from __future__ import annotations

import contextlib
import logging
import weakref

import torch

from hetu_ext.model import inventory
from hetu_ext.model.spec import ModelSpec
from hetu_ext.plan import Plan

logger = logging.getLogger(__name__)
MB = 1 << 20


class SavedTensorMeter:
    """Live and peak bytes of the storages autograd keeps for backward while :meth:`measuring` is entered."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._live: dict[int, list[int]] = {}  # storage address -> [bytes, saved references alive]
        self.current = 0
        self.peak = 0

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        if address == 0 or address in self._params:
            return tensor
        entry = self._live.setdefault(address, [storage.nbytes(), 0])
        if entry[1] == 0:
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        weakref.finalize(tensor, self._release, address)
        return tensor

    def _release(self, address: int) -> None:
        entry = self._live.get(address)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self._live[address]

    @contextlib.contextmanager
    def measuring(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor):
            yield self


def keeps_scores(numerics, device: torch.device) -> bool:
    """Whether the stages' core attention keeps ``[b, heads, s, s]`` tensors for backward (``numerics``: the run's
    TrainingNumerics): Megatron's DotProductAttention always; SDPA only where torch runs its math kernel, with
    dropout > 0 on CPU (the CPU flash kernel has no dropout; CUDA's flash kernel has)."""
    if numerics.attention == "megatron":
        return True
    return device.type == "cpu" and numerics.attention_dropout > 0


def predicted_bytes(spec: ModelSpec, plan: Plan, rank: int, *, micro_batch_size: int, half: bool,
                    recompute: str, sequence_parallel: bool, attention_scores: bool = True) -> tuple[float, int]:
    """The inventory's activation bytes of ``rank``'s stage at its 1F1B peak, and the microbatches in flight;
    ``attention_scores``: the core attention keeps the scores (:func:`keeps_scores`)."""
    pipeline_index, stage_index = plan.stage_of(rank)
    pipeline = plan.pipelines[pipeline_index]
    stage = pipeline.stages[stage_index]
    in_flight = min(pipeline.pp - stage_index, pipeline.num_microbatches)
    tokens = micro_batch_size * spec.seq_length
    scale = (2 if half else 4) / 2  # the inventory counts 2-byte activations (bf16 or fp16)

    def per_layer(kind: str) -> float:
        return tokens * scale * inventory.activation_bytes_per_token(
            spec, tp=stage.tp, seq_length=spec.seq_length, recompute=kind, attention_scores=attention_scores,
            sequence_parallel=sequence_parallel and stage.tp > 1)

    kept = per_layer(recompute) * stage.num_layers * in_flight
    if recompute == "full":  # the layer whose backward recomputes it holds its whole activations meanwhile
        kept += per_layer("none")
    return kept, in_flight


@contextlib.contextmanager
def report_first_step(trainer):
    """Measure the step run inside; then log this rank's measured and predicted activation memory."""
    meter = SavedTensorMeter(trainer.model)
    with meter.measuring():
        yield
    numerics = trainer.numerics
    scores = keeps_scores(numerics, trainer.host.device)
    predicted, in_flight = predicted_bytes(
        trainer.spec, trainer.plan, trainer.host.rank, micro_batch_size=trainer.config.training.micro_batch_size,
        half=numerics.half, recompute=numerics.recompute_granularity or "none",
        sequence_parallel=numerics.sequence_parallel, attention_scores=scores)
    logger.info("[Rank %d] (after %d iterations) activation memory (MB) | measured peak: %.2f | predicted: %.2f "
                "(inventory: the stage's layers, %d microbatches in flight, recompute %s, sequence parallel %s, "
                "attention scores %s)",
                trainer.host.rank, trainer.iteration, meter.peak / MB, predicted / MB, in_flight,
                numerics.recompute_granularity or "none", "on" if numerics.sequence_parallel and _stage_tp(
                    trainer.plan, trainer.host.rank) > 1 else "off", "kept" if scores else "not kept")


def _stage_tp(plan: Plan, rank: int) -> int:
    """The TP degree of ``rank``'s stage (sequence parallelism acts only where it is > 1)."""
    pipeline_index, stage_index = plan.stage_of(rank)
    return plan.pipelines[pipeline_index].stages[stage_index].tp

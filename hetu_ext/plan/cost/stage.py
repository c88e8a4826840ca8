"""Per-layer time and memory of a GPT stage (pure), the numbers the planner and the simulator share.

Time: the forward FLOPs of one transformer layer for ``b`` samples of ``s`` tokens are the model inventory's
(:mod:`hetu_ext.model.inventory`; for GPT ``2 b s (4 h^2 + 2 h f) + 4 b s^2 h``: QKV/projection and MLP matmuls,
then scores and values over the whole square); backward costs twice the forward. A TP group of degree t divides the
work by t at ``tp_efficiency[t]`` and adds its all-reduces (4 per layer per microbatch, forward and backward, of ``b
s h`` values, ring cost 2 (t-1)/t) over the node's link. The efficiencies are assumed constants unless measured ones
are given (:func:`load_tp_efficiency`: the file ``python -m hetu_ext.data.calibrate`` derives from a device's
calibration, all-reduces included, so for those degrees the all-reduce term is not added again). The slowest member
sets a TP group's pace. Embedding and output layer add ``2 b s h V`` FLOPs to the first and last stages.

Memory per rank (bytes): weights (dtype), fp32 gradient buffer, optimizer state (Adam: two fp32 moments, plus fp32
master weights under bf16), all divided by TP, the optimizer state further divided by the number of holders of each
element when it is sharded (``optimizer_sharded``: --use-distributed-optimizer); weights TP splits are divided by
TP, norms and row-parallel biases are not (the inventory's split); activations of one layer for one microbatch
``b s`` x the inventory's bytes per token (Korthikanti et al.'s count; GPT: ``h (10 + 24 / t) + 5 a s / t``, the
attention scores materialised) x dtype / 2, times the microbatches a stage holds in flight under 1F1B:
``min(pp - stage, m)``, more on early stages.

Recomputation and sequence parallelism (stage_cost's ``recompute``, ``sequence_parallel``): the recomputed FLOPs
and activations are the inventory's (:func:`hetu_ext.model.inventory.layer_recompute_flops`,
``activation_bytes_per_token``); the full step-time model with device profiles is :mod:`hetu_ext.plan.cost.step_model`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from hetu_ext.keys import check_keys

from hetu_ext.model import inventory
from hetu_ext.model.spec import ModelSpec


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Device constants (defaults: an A100-class GPU in a node of NVLink, InfiniBand between nodes)."""

    flops_per_s: float = 150e12
    """Sustained matmul throughput of a healthy GPU."""
    intra_node_bytes_per_s: float = 150e9
    inter_node_bytes_per_s: float = 12.5e9
    dtype_bytes: int = 2
    optimizer_state_bytes: int = 12
    """Per parameter element: Adam's two fp32 moments and the fp32 master weight (bf16 training)."""
    grad_bytes: int = 4
    optimizer_sharded: bool = False
    """--use-distributed-optimizer: each element's optimizer state is kept by one of its holders, so a stage holds
    ``optimizer_state_bytes / holders`` per element (stage_cost's ``optimizer_holders``)."""
    tp_efficiency: dict[int, float] = field(default_factory=lambda: {1: 1.0, 2: 0.95, 4: 0.9, 8: 0.85})
    """Per TP degree t, the fraction of the t-fold speed-up a TP group reaches (assumed; see ``tp_measured``)."""
    tp_measured: tuple[int, ...] = ()
    """Degrees whose efficiency was measured with the all-reduces running (:func:`with_measured_tp`): their
    all-reduce term is in the efficiency already."""


TP_EFFICIENCY_KEYS = ("device", "tp_efficiency", "note")


def load_tp_efficiency(path: str | Path) -> dict[int, float]:
    """Measured TP efficiencies ``{t: T_1 / (t T_t)}`` from a file written by ``python -m hetu_ext.data.calibrate``
    (keys: ``device``, ``tp_efficiency``, ``note``); ValueError naming the file and the rule otherwise."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"TP efficiency file {str(path)!r} cannot be read ({exc}); write it with python -m "
                         "hetu_ext.data.calibrate") from None
    data = check_keys(data, TP_EFFICIENCY_KEYS, f"TP efficiency file {str(path)!r}", required=("tp_efficiency",))
    table = data["tp_efficiency"]
    if not isinstance(table, dict) or not table:
        raise ValueError(f"TP efficiency file {str(path)!r}: tp_efficiency must map TP degrees to efficiencies")
    out = {}
    for tp, value in table.items():
        if not isinstance(tp, int) or tp < 1 or not isinstance(value, (int, float)) or not 0 < value <= 1.5:
            raise ValueError(f"TP efficiency file {str(path)!r}: entry {tp!r}: {value!r} must be a TP degree >= 1 "
                             "and an efficiency in (0, 1.5]")
        out[tp] = float(value)
    return out


def with_measured_tp(cost: CostModel, measured: dict[int, float]) -> CostModel:
    """``cost`` with the measured efficiencies in place of the assumed ones (other degrees keep theirs)."""
    return dataclasses.replace(cost, tp_efficiency={**cost.tp_efficiency, **measured},
                               tp_measured=tuple(sorted(set(cost.tp_measured) | set(measured))))


@dataclass(frozen=True)
class StageCost:
    """Forward and backward seconds of one microbatch through a stage; its peak memory."""

    forward_s: float
    backward_s: float
    memory_bytes: float


@functools.lru_cache(maxsize=256)
def _params(spec: ModelSpec, tp: int) -> tuple[float, int]:
    """(a layer's parameters per TP rank, the embedding's) of a (frozen, hashable) spec: the inventory walks every
    parameter for each, and the planners price thousands of stages of a few shapes (Malleus at 4096 GPUs)."""
    return inventory.layer_params(spec, tp=tp), inventory.embedding_params(spec)


def layer_forward_flops(spec: ModelSpec, micro_batch: int) -> float:
    """Forward FLOPs of one layer for ``micro_batch`` sequences of ``spec.seq_length`` tokens (the inventory's)."""
    s = spec.seq_length
    return inventory.layer_forward_flops(spec, tokens=micro_batch * s, sum_sq=micro_batch * s * s)


def stage_cost(spec: ModelSpec, cost: CostModel, *, num_layers: int, tp: int, slowdown: float, micro_batch: int,
               first: bool, last: bool, in_flight: int, optimizer_holders: int = 1, recompute: str = "none",
               sequence_parallel: bool = False, attention_scores: bool = True, cp: int = 1,
               cp_spans_nodes: bool = False) -> StageCost:
    """Time and memory of one stage of ``num_layers`` layers at TP ``tp`` whose slowest rank is ``slowdown``.
    ``optimizer_holders``: the ranks holding each of its elements (one per pipeline of a Malleus template), over
    which the optimizer state is divided when ``cost.optimizer_sharded``.

    ``recompute`` (``none``, ``selective``, ``full``; Megatron-LM's ``--recompute-granularity``): ``full`` runs each
    layer's forward again in its backward (its FLOPs and its TP all-reduces) and keeps only the layer input
    (plus, once per stage, one layer's whole activations while that layer's backward runs); ``selective``
    recomputes the attention core (its FLOPs) and does not keep the ``5 a s`` scores.
    ``sequence_parallel`` (``--sequence-parallel``): each all-reduce becomes a reduce-scatter and an all-gather of
    the same total bytes (time unchanged); the activations TP did not split are divided by ``tp``.
    ``attention_scores``: the attention keeps its ``5 a s`` scores for the backward (Megatron's local attention);
    False for attention that never materialises them (FlashAttention, SDPA: ``--use-flash-attn``).
    ``cp`` (``--context-parallel-size``): each rank of the stage's TP x CP ranks holds ``b s / cp`` tokens (two
    load-balanced chunks per sequence) and does ``1 / cp`` of every FLOP, attention included; each layer gathers
    the sequence's K/V heads over the CP group in the forward and reduce-scatters their gradients in the
    backward (``(cp-1)/cp x 2 b s g d / tp`` bf16 values each way, exposed), across nodes when
    ``cp_spans_nodes``."""
    inventory.check_recompute(recompute)
    h, s, v = spec.hidden_size, spec.seq_length, spec.padded_vocab_size
    layer_flops = num_layers * layer_forward_flops(spec, micro_batch)
    flops = layer_flops
    extra_params = 0
    if first:
        extra_params += _params(spec, tp)[1]
    if last:
        flops += micro_batch * s * inventory.output_flops_per_token(spec)
        extra_params += v * h if spec.untie_embeddings_and_output_weights or not first else 0
    efficiency = cost.tp_efficiency.get(tp, 0.8)
    compute = flops / (cost.flops_per_s * tp * efficiency * cp) * slowdown
    comm = 0.0
    if tp > 1 and tp not in cost.tp_measured:
        comm = num_layers * 2 * micro_batch * s / cp * h * cost.dtype_bytes * 2 * (tp - 1) / tp / \
            cost.intra_node_bytes_per_s
    if cp > 1:
        kv = 2 * micro_batch * s * spec.num_query_groups * spec.kv_channels / tp * cost.dtype_bytes
        link = cost.inter_node_bytes_per_s if cp_spans_nodes else cost.intra_node_bytes_per_s
        comm += num_layers * (cp - 1) / cp * kv / link
    redo_flops = num_layers * inventory.layer_recompute_flops(spec, tokens=micro_batch * s,
                                                              sum_sq=micro_batch * s * s, recompute=recompute)
    redo = redo_flops / (cost.flops_per_s * tp * efficiency * cp) * slowdown
    if recompute == "full":
        redo += comm  # the recomputed forward's all-reduces (and K/V gathers)
    params = num_layers * _params(spec, tp)[0] + extra_params / tp
    shards = optimizer_holders if cost.optimizer_sharded else 1
    static = params * (cost.dtype_bytes + cost.grad_bytes + cost.optimizer_state_bytes / shards)
    per_token = inventory.activation_bytes_per_token(spec, tp=tp, seq_length=s, sequence_parallel=sequence_parallel,
                                                     recompute=recompute, attention_scores=attention_scores)
    activations = micro_batch * s / cp * per_token * cost.dtype_bytes / 2 * num_layers * in_flight
    if recompute == "full" and num_layers:  # one layer's whole activations while its backward runs
        activations += micro_batch * s / cp * cost.dtype_bytes / 2 * inventory.activation_bytes_per_token(
            spec, tp=tp, seq_length=s, sequence_parallel=sequence_parallel, attention_scores=attention_scores)
    return StageCost(forward_s=compute + comm, backward_s=2 * compute + comm + redo, memory_bytes=static + activations)

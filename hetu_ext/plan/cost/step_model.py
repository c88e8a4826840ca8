"""One training step's time and memory per GPU (pure), from the model inventory and a device profile.

The run: Megatron-LM's uniform TP x PP x DP, ``m = global_batch / (micro_batch dp)`` microbatches per pipeline
under 1F1B (interleaved with ``v`` model chunks per stage when asked), bf16 weights with fp32 gradients and Adam.
Per microbatch and TP rank, one layer's forward is (``T = b s`` tokens, ``t`` the TP degree; units: seconds):

* **GEMMs**: each linear layer of :func:`hetu_ext.model.inventory.layer_gemms` (``m = T``, ``n``, ``k``, one of
  them divided by ``t``) at ``2 m n k / (peak x gemm_efficiency((m n k)^(1/3)))``; backward 2x the forward.
* **attention core**: ``b a / t`` heads of ``(s x d) @ (d x s)`` and back: the inventory's square FLOPs (the
  whole square; FlashAttention's causal kernel: half), at the GEMM efficiency of ``(s, s, d)``.
* **memory-bound kernels** (norms, dropouts, softmax, GeLU, residuals): :data:`ELEMENTWISE_TRAFFIC` x the bytes
  the layer keeps for backward (the inventory's Korthikanti count, scores included unless flash) over HBM
  bandwidth; backward 2x.
* **TP collectives**: 2 all-reduces of ``T h`` bf16 values in the forward, 2 in the backward (ring
  ``2 (t-1)/t`` bytes at NVLink bus bandwidth); with sequence parallelism each is a reduce-scatter + an
  all-gather of the same bytes (same time, one more latency), and activations are split by ``t``. Not overlapped.
* **TP overlap** (``tp_comm_overlap``): each of SP's all-gathers / reduce-scatters runs beside its GEMM; exposed
  only where longer (backward: against twice the GEMM).
* **context parallelism** (CP ``c``): the rank holds ``T / c`` tokens (two chunks per sequence, balanced for causal
  attention) and does ``1 / c`` of every FLOP; the K/V exchange over the CP group is :func:`cp_exchange_s`.
* **recompute**: ``full`` repeats the whole forward (GEMMs, attention, kernels, collectives) in the backward;
  ``selective`` the attention core and its softmax/dropout kernels (:func:`inventory.layer_recompute_flops`).

Stages hold ``num_layers / pp`` layers each, or Megatron-LM's uneven first and last stages (:func:`stage_layers`).
The first stage adds the embedding (its elementwise bytes), the last the output layer (a GEMM of ``V / t``
columns) and the cross entropy over the logits (:data:`LOGITS_BYTES` per logit, forward and backward). Pipeline
(1F1B): ``m x max_j c_j + (sum_j c_j - max_j c_j) / v`` with ``c_j`` stage j's forward + backward + its two
point-to-point sends per microbatch (``T h / t`` bf16 values each: Megatron's scatter-gather, across nodes when
a replica spans nodes). Then the data-parallel gradient reduction (fp32; all-reduce, or with the distributed
optimizer reduce-scatter + the bf16 parameter all-gather; over DP x CP ranks), overlapped with the last microbatch's backward (and the
gather with the first forward) when ``overlap_grad_reduce``; then Adam (:data:`OPTIMIZER_BYTES_PER_PARAM` of
memory traffic per element the rank updates).

Memory per GPU (the largest stage): :func:`hetu_ext.plan.cost.stage.stage_cost`'s weights + fp32 gradients + Adam
(divided by dp under the distributed optimizer) + activations for the microbatches the stage holds in flight
(1F1B: ``min(pp - j, m)``; interleaved: Megatron's warm-up count), plus the last stage's fp32 logits and their
gradient, plus :data:`RESERVED_BYTES`.

The constants below and each device profile's efficiency curve are the whole parameter set; they were set once
against Narayanan et al. (SC'21) Table 1 (benchmarks/published/narayanan2021.csv), not per row; the same set
predicts Llama 3's Table 4 (benchmarks/published/llama3_2024.csv: H100, CP, uneven stages) within 6%.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hetu_ext.model import inventory
from hetu_ext.model.spec import ModelSpec

from hetu_ext.plan.cost.stage import CostModel, stage_cost
from hetu_ext.plan.cost.devices import Device

ELEMENTWISE_TRAFFIC = 2.0
"""Bytes the memory-bound kernels of a layer's forward read and write, per byte the layer keeps for backward."""
LOGITS_BYTES = 12.0
"""HBM bytes per logit element of the cross entropy, forward (fp32 upcast, softmax, loss), and again backward."""
OPTIMIZER_BYTES_PER_PARAM = 32.0
"""Adam step: read fp32 grad, master, two moments; write master, moments and the bf16 weight (bytes/element)."""
RESERVED_BYTES = 3 * 2**30
"""CUDA context, NCCL and cuBLAS workspaces, allocator fragmentation (bytes per GPU)."""
GRAD_REDUCE_BYTES = 4
"""Gradients are reduced in fp32 (Megatron's main_grad buffers)."""


@dataclass(frozen=True, kw_only=True)
class Parallel:
    """How the run is laid out and trained (Megatron-LM's flag in each docstring)."""

    tp: int = 1
    """--tensor-model-parallel-size"""
    pp: int = 1
    """--pipeline-model-parallel-size"""
    dp: int = 1
    """data-parallel replicas: GPUs / (tp pp)"""
    micro_batch_size: int = 1
    """--micro-batch-size (sequences)"""
    global_batch_size: int = 1
    """--global-batch-size (sequences)"""
    recompute: str = "none"
    """--recompute-granularity: none, selective or full"""
    sequence_parallel: bool = False
    """--sequence-parallel"""
    distributed_optimizer: bool = False
    """--use-distributed-optimizer"""
    virtual_stages: int = 1
    """model chunks per pipeline stage: num_layers / (pp --num-layers-per-virtual-pipeline-stage)"""
    overlap_grad_reduce: bool = False
    """--overlap-grad-reduce (and --overlap-param-gather under the distributed optimizer)"""
    flash_attention: bool = False
    """--use-flash-attn: causal attention without materialised scores"""
    cp: int = 1
    """--context-parallel-size: ranks that split each sequence (2 chunks each, load-balanced for causal attention)"""
    cp_comm_type: str = "p2p"
    """--cp-comm-type: p2p (ring exchange of K/V chunks, overlapped with attention; Megatron's default) or
    all_gather (K/V gathered before attention, as Llama 3)"""
    first_stage_layers: int | None = None
    """--decoder-first-pipeline-num-layers (None: the even split)"""
    last_stage_layers: int | None = None
    """--decoder-last-pipeline-num-layers (None: the even split)"""
    tp_comm_overlap: bool = False
    """--tp-comm-overlap: TP all-gathers / reduce-scatters overlapped with the GEMMs beside them"""
    ep: int = 1
    """--expert-model-parallel-size (an MoE model: :mod:`hetu_ext.plan.cost.moe_step`)"""
    etp: int | None = None
    """--expert-tensor-parallel-size (None: the TP degree)"""

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)


def check(spec: ModelSpec, par: Parallel) -> None:
    """ValueError (one line: the rule, the values, the fix) for a layout Megatron-LM would refuse."""
    for name in ("tp", "pp", "dp", "cp", "micro_batch_size", "global_batch_size", "virtual_stages"):
        value = getattr(par, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    inventory.check_recompute(par.recompute)
    inventory.check_tp(spec, par.tp)
    if par.global_batch_size % (par.micro_batch_size * par.dp):
        raise ValueError(f"--global-batch-size {par.global_batch_size} must be a multiple of --micro-batch-size x "
                         f"data-parallel size = {par.micro_batch_size} x {par.dp}; change one of them")
    stage_layers(spec, par)
    if par.virtual_stages > 1 and par.microbatches % par.pp:
        raise ValueError(f"the interleaved schedule needs microbatches ({par.microbatches}) divisible by "
                         f"--pipeline-model-parallel-size {par.pp}; change --global-batch-size")
    if par.sequence_parallel and par.tp == 1:
        raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1; drop it or raise TP")
    if par.tp_comm_overlap and not par.sequence_parallel:
        raise ValueError("--tp-comm-overlap needs --sequence-parallel (Megatron-LM's rule: the overlapped "
                         "collectives are SP's all-gathers and reduce-scatters); add --sequence-parallel or drop it")
    if par.cp_comm_type not in CP_COMM_TYPES:
        raise ValueError(f"--cp-comm-type must be one of {', '.join(CP_COMM_TYPES)}, got {par.cp_comm_type!r}")
    if par.cp > 1 and spec.seq_length % (2 * par.cp):
        raise ValueError(f"--seq-length {spec.seq_length} must be divisible by 2 x --context-parallel-size = "
                         f"{2 * par.cp} (two load-balanced chunks per CP rank); change one of them")


CP_COMM_TYPES = ("p2p", "all_gather")
"""The --cp-comm-type values the model prices."""


def stage_layers(spec: ModelSpec, par: Parallel) -> list[int]:
    """Layers of each pipeline stage: the even split, or Megatron-LM's uneven one (``first_stage_layers``,
    ``last_stage_layers``; the middle stages share the rest evenly). With virtual stages each stage holds
    ``virtual_stages`` chunks: the middle stages' layers must divide into them, and an uneven first or last stage
    needs at least one layer per chunk (its chunks then differ by a layer, which Megatron-LM's
    ``--pipeline-model-parallel-layout`` expresses; ``--decoder-first-pipeline-num-layers`` itself asks the first
    and last stages' layers to be divisible by the chunks too). ValueError naming the rule otherwise."""
    p, v, n = par.pp, par.virtual_stages, spec.num_layers
    ends = {"first": par.first_stage_layers, "last": par.last_stage_layers}
    if all(x is None for x in ends.values()):
        if n % (p * v):
            raise ValueError(f"--num-layers {n} must be divisible by pipeline stages x virtual stages = {p} x {v}; "
                             "change --num-layers or --pipeline-model-parallel-size, or give "
                             "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers")
        return [n // p] * p
    given = {k: x for k, x in ends.items() if x is not None}
    for k, x in given.items():
        if isinstance(x, bool) or not isinstance(x, int) or x < v:
            raise ValueError(f"--decoder-{k}-pipeline-num-layers must be an integer >= the virtual stages ({v}), "
                             f"got {x!r}")
    middle = p - len(given) if p > 1 else 0
    rest = n - sum(given.values())
    if p < 2 or rest < 0 or (not middle and rest) or (middle and (not rest or rest % middle
                                                                  or rest // middle % v)):
        raise ValueError(f"uneven pipeline stages: {n} layers with first {ends['first']} and last {ends['last']} "
                         f"leave {rest} for {middle} middle stage(s) of {v} chunk(s) each, which must split evenly "
                         f"(and PP >= 2, got {p}); change the first/last stage layers or "
                         "--pipeline-model-parallel-size")
    each = rest // middle if middle else 0
    first = given.get("first", each)
    last = given.get("last", each)
    return [first] + [each] * (p - 2) + [last]


@dataclass(frozen=True)
class Prediction:
    """One step of the whole run. Seconds, FLOP/s, bytes."""

    step_s: float
    tflops_per_gpu: float
    """Megatron's count: FLOPs of the step, recomputation included, per second per GPU, / 1e12."""
    mfu: float
    """Model FLOPs (no recomputation, causal half of the attention square: the inventory's MFU convention) per
    second per GPU over the device's peak."""
    memory_bytes: float
    """Peak of the largest stage, per GPU."""
    parts: dict[str, float] = field(default_factory=dict)
    """Where the time goes: compute, tp_comm, p2p, bubble, dp_comm (exposed), optimizer (seconds)."""


@dataclass(frozen=True)
class _Pass:
    """Forward and backward seconds of a piece of work for one microbatch, by kind (comm: TP collectives and
    pipeline-free extras; cp: the exposed K/V exchange of context parallelism)."""

    compute_f: float = 0.0
    compute_b: float = 0.0
    comm_f: float = 0.0
    comm_b: float = 0.0
    cp_f: float = 0.0
    cp_b: float = 0.0

    def __add__(self, o: _Pass) -> _Pass:
        return _Pass(*(x + y for x, y in zip(self._values(), o._values())))

    def times(self, k: float) -> _Pass:
        return _Pass(*(x * k for x in self._values()))

    def _values(self) -> tuple[float, ...]:
        return (self.compute_f, self.compute_b, self.comm_f, self.comm_b, self.cp_f, self.cp_b)

    @property
    def forward(self) -> float:
        return self.compute_f + self.comm_f + self.cp_f

    @property
    def backward(self) -> float:
        return self.compute_b + self.comm_b + self.cp_b

    @property
    def total(self) -> float:
        return self.forward + self.backward


def _gemm_s(device: Device, flops: float, m: float, n: float, k: float) -> float:
    return flops / device.gemm_flops_per_s(m, n, k) if flops else 0.0


def tp_collective_s(device: Device, par: Parallel, nbytes: float) -> float:
    """One all-reduce of ``nbytes`` over the TP group (with SP: a reduce-scatter + an all-gather, same bytes)."""
    if par.tp == 1:
        return 0.0
    bw, latency = device.link(par.tp, spans_nodes=False)
    return 2 * (par.tp - 1) / par.tp * nbytes / bw + latency * (2 if par.sequence_parallel else 1)


def cp_spans_nodes(device: Device, par: Parallel) -> bool:
    """Megatron's rank order puts TP innermost, then CP: a CP group leaves the node when ``tp cp`` exceeds it."""
    return par.tp * par.cp > device.gpus_per_node


def cp_exchange_s(spec: ModelSpec, device: Device, par: Parallel, *, attention_s: float) -> tuple[float, float]:
    """Exposed seconds (forward, backward) of one layer's K/V exchange over the CP group, one microbatch, one rank.
    The rank's K and V heads (``2 g d / t`` values per token) of the whole sequence cross the group once:
    ``(c-1)/c x 2 b s g d / t`` bf16 values in, and the same of gradients out in the backward. ``all_gather``:
    gathered before the attention and reduce-scattered after its backward, exposed (Llama 3); ``p2p``: a ring of
    ``c - 1`` steps, each overlapped with the attention of the chunk before it, exposed where it is longer (the
    backward sends K/V and their gradients against twice the attention work)."""
    c = par.cp
    if c == 1:
        return 0.0, 0.0
    bw, latency = device.link(c, spans_nodes=cp_spans_nodes(device, par))
    kv_bytes = 2 * par.micro_batch_size * spec.seq_length * 2 * spec.num_query_groups * spec.kv_channels / par.tp
    moved = (c - 1) / c * kv_bytes / bw
    if par.cp_comm_type == "all_gather":
        return moved + latency, moved + latency
    forward = max(0.0, moved + (c - 1) * latency - attention_s * (c - 1) / c)
    return forward, max(0.0, 2 * moved + (c - 1) * latency - 2 * attention_s * (c - 1) / c)


def layer_pass(spec: ModelSpec, device: Device, par: Parallel) -> _Pass:
    """One transformer layer, one microbatch, one TP x CP rank: forward and backward seconds (recompute included).
    Under CP the rank holds ``b s / c`` tokens and computes ``1 / c`` of the attention square (two chunks per
    sequence: the causal work balanced), its queries against the whole sequence's keys."""
    t, b, s, c = par.tp, par.micro_batch_size, spec.seq_length, par.cp
    tokens = b * s / c
    gemms = [_gemm_s(device, 2.0 * tokens * n * k / t, tokens, n / t if split == 1 else n, k / t if split == 2
                     else k) for _, n, k, split in inventory.layer_gemms(spec)]
    gemm = sum(gemms)
    attn_flops = inventory.layer_forward_flops(spec, tokens=0, sum_sq=b * s * s, causal=par.flash_attention) / (t * c)
    attn = _gemm_s(device, attn_flops, s / c, s, spec.kv_channels)
    kept = tokens * inventory.activation_bytes_per_token(spec, tp=t, seq_length=s, attention_scores=not
                                                         par.flash_attention, sequence_parallel=par.sequence_parallel)
    elementwise = ELEMENTWISE_TRAFFIC * kept / device.hbm_bytes_per_s
    comm = 2 * tp_collective_s(device, par, tokens * spec.hidden_size * 2)
    comm_f = comm_b = comm
    if par.tp_comm_overlap:  # each SP all-gather / reduce-scatter beside its GEMM (backward: twice the GEMM)
        half = comm / 4
        comm_f = sum(max(0.0, half - g) for g in gemms)
        comm_b = sum(max(0.0, half - 2 * g) for g in gemms)
    cp_f, cp_b = cp_exchange_s(spec, device, par, attention_s=attn)
    forward = gemm + attn + elementwise
    redo = redo_comm = redo_cp = 0.0
    if par.recompute == "full":
        redo, redo_comm, redo_cp = forward, comm_f, cp_f
    elif par.recompute == "selective":
        scores = 0.0 if par.flash_attention else 5.0 * spec.num_attention_heads * s / t * tokens
        redo, redo_cp = attn + ELEMENTWISE_TRAFFIC * scores / device.hbm_bytes_per_s, cp_f
    return _Pass(forward, 2 * forward + redo, comm_f, comm_b + redo_comm, cp_f, cp_b + redo_cp)


def measured_layer_pass(spec: ModelSpec, device: Device, par: Parallel) -> _Pass | None:
    """One layer from the device's measured table (``calibrate`` of its profile), when the table measured this
    layer's shape at this TP degree: ``b (a s^2 + b s) + c`` seconds forward + backward (TP collectives
    included), one third forward; recomputation adds the forward (full) or the attention term's third
    (selective). None otherwise (the FLOP model prices it), and under CP or TP overlap (not measured)."""
    cal = device.calibrate
    if cal is None or par.cp > 1 or par.tp_comm_overlap or (cal.hidden_size, cal.num_attention_heads, cal.ffn_hidden_size) != (
            spec.hidden_size, spec.num_attention_heads, spec.ffn_hidden_size):
        return None
    from hetu_ext.data.cost import load_cost_table

    table = load_cost_table(cal.table)
    if par.tp not in table.per_tp:
        return None
    cost, b, s = table.per_tp[par.tp], par.micro_batch_size / cal.micro_batch_size, spec.seq_length
    total = b * (cost.a * s * s + cost.b * s) + cost.c
    redo = {"none": 0.0, "full": total / 3, "selective": b * cost.a * s * s / 3}[par.recompute]
    return _Pass(total / 3, 2 * total / 3 + redo)


def ends_pass(spec: ModelSpec, device: Device, par: Parallel, *, first: bool, last: bool) -> _Pass:
    """The embedding (first stage) and the output layer with its cross entropy (last stage), one microbatch."""
    t, tokens, h = par.tp, par.micro_batch_size * spec.seq_length / par.cp, spec.hidden_size
    out = _Pass()
    if first:  # lookup (and its gradient's scatter-add): h bf16 values per token written and read
        lookup = 2 * tokens * h * 2 / device.hbm_bytes_per_s
        out = out + _Pass(lookup, lookup, tp_collective_s(device, par, tokens * h * 2), 0.0)
    if last:
        v = spec.padded_vocab_size
        gemm = _gemm_s(device, tokens * inventory.output_flops_per_token(spec) / t, tokens, v / t, h)
        loss = LOGITS_BYTES * tokens * v / t / device.hbm_bytes_per_s
        out = out + _Pass(gemm + loss, 2 * gemm + loss)
    return out


def _in_flight(par: Parallel, stage: int) -> int:
    """Microbatches (in whole-stage units, rounded up) whose activations stage ``stage`` holds at its peak."""
    m, p, v = par.microbatches, par.pp, par.virtual_stages
    if v == 1:
        return min(p - stage, m)
    chunks = min((p - stage - 1) * 2 + (v - 1) * p + 1, m * v)  # Megatron's interleaved warm-up, + the one running
    return math.ceil(chunks / v)


def step_flops(spec: ModelSpec, par: Parallel, *, recompute: bool = True, causal: bool = False) -> float:
    """FLOPs of one step. Defaults: as Megatron's papers count (the whole attention square; forward x 3, plus the
    recomputed forward when ``recompute``): for GPT with full recomputation ``96 B s l h^2 (1 + s/6h + V/16lh)``.
    ``recompute=False, causal=True``: the model's necessary work, the MFU convention of the inventory."""
    s = spec.seq_length
    tokens = par.global_batch_size * s
    layer = inventory.layer_forward_flops(spec, tokens=tokens, sum_sq=tokens * s, causal=causal)
    total = spec.num_layers * 3 * layer + 3 * tokens * inventory.output_flops_per_token(spec)
    if recompute:
        total += spec.num_layers * inventory.layer_recompute_flops(spec, tokens=tokens, sum_sq=tokens * s,
                                                                   recompute=par.recompute, causal=causal)
    return total


def _stage_memories(spec: ModelSpec, par: Parallel, layers: list[int]) -> list[float]:
    """Peak bytes per GPU of each stage: weights, gradients, optimizer (sharded over DP x CP), activations of the
    microbatches in flight for the rank's ``b s / c`` tokens, the last stage's fp32 logits, the reserve."""
    p, b, s = par.pp, par.micro_batch_size, spec.seq_length
    cost = CostModel(optimizer_sharded=par.distributed_optimizer)
    out = []
    for j in range(p):
        sc = stage_cost(spec, cost, num_layers=layers[j], tp=par.tp, slowdown=1.0, micro_batch=b, first=j == 0,
                        last=j == p - 1, in_flight=_in_flight(par, j), optimizer_holders=par.dp * par.cp,
                        recompute=par.recompute, sequence_parallel=par.sequence_parallel,
                        attention_scores=not par.flash_attention, cp=par.cp)
        logits = 2 * 4.0 * b * s / par.cp * spec.padded_vocab_size / par.tp if j == p - 1 else 0.0
        out.append(sc.memory_bytes + logits + RESERVED_BYTES)
    return out


def _dp_comm_s(spec: ModelSpec, device: Device, par: Parallel, layers: list[int], busy: _Pass) -> float:
    """Exposed seconds of the gradient reduction (and parameter gather) over the DP x CP ranks that hold each
    weight, for the stage with the most parameters; hidden behind the busiest stage's last backward (first
    forward) when overlapped."""
    group = par.dp * par.cp
    if group == 1:
        return 0.0
    grads = stage_params(spec, par, layers)
    bw, latency = device.link(group, spans_nodes=par.gpus > device.gpus_per_node)
    share = (group - 1) / group
    if par.distributed_optimizer:
        reduce = share * grads * GRAD_REDUCE_BYTES / bw + latency
        gather = share * grads * 2 / bw + latency
    else:
        reduce, gather = 2 * share * grads * GRAD_REDUCE_BYTES / bw + latency, 0.0
    if par.overlap_grad_reduce:
        reduce = max(0.0, reduce - busy.backward)
        gather = max(0.0, gather - busy.forward)
    return reduce + gather


def stage_params(spec: ModelSpec, par: Parallel, layers: list[int]) -> float:
    """Parameters of the largest stage per TP rank (what its rank reduces and updates)."""
    p = par.pp
    return max(layers[j] * inventory.layer_params(spec, tp=par.tp) + (
        (inventory.embedding_params(spec) if j == 0 else 0) + (
            spec.padded_vocab_size * spec.hidden_size if j == p - 1 and (
                spec.untie_embeddings_and_output_weights or p > 1) else 0)) / par.tp for j in range(p))


def predict(spec: ModelSpec, par: Parallel, device: Device) -> Prediction:
    """Step time, throughput and peak memory per GPU of ``spec`` trained under ``par`` on ``device`` (an MoE model:
    :func:`hetu_ext.plan.cost.moe_step.predict`)."""
    if spec.is_moe:
        from hetu_ext.plan.cost import moe_step

        return moe_step.predict(spec, par, device)
    if par.ep != 1 or par.etp is not None:
        raise ValueError("--expert-model-parallel-size / --expert-tensor-parallel-size need an MoE model; add "
                         "--num-experts N or drop them")
    check(spec, par)
    p, m, v = par.pp, par.microbatches, par.virtual_stages
    layers = stage_layers(spec, par)
    layer = measured_layer_pass(spec, device, par) or layer_pass(spec, device, par)
    spans_nodes = par.tp * par.cp * p > device.gpus_per_node
    send_bw, send_latency = device.link(2, spans_nodes=spans_nodes)
    tokens = spec.seq_length * par.micro_batch_size / par.cp
    send = tokens * spec.hidden_size * 2 / par.tp / send_bw + send_latency
    p2p = 0.0 if p == 1 else 2 * v * send
    stages = [layer.times(layers[j]) + ends_pass(spec, device, par, first=j == 0, last=j == p - 1)
              for j in range(p)]
    cycles = [st.total + p2p for st in stages]
    slowest = max(range(p), key=lambda j: cycles[j])
    pipeline = m * cycles[slowest] + (sum(cycles) - cycles[slowest]) / v
    busy = stages[slowest]
    dp_comm = _dp_comm_s(spec, device, par, layers, busy)
    updated = stage_params(spec, par, layers) / (par.dp * par.cp if par.distributed_optimizer else 1)
    optimizer = updated * OPTIMIZER_BYTES_PER_PARAM / device.hbm_bytes_per_s
    step = pipeline + dp_comm + optimizer
    parts = {"compute": m * (busy.compute_f + busy.compute_b), "tp_comm": m * (busy.comm_f + busy.comm_b),
             "cp_comm": m * (busy.cp_f + busy.cp_b), "p2p": m * p2p, "bubble": pipeline - m * cycles[slowest],
             "dp_comm": dp_comm, "optimizer": optimizer}
    gpus = par.gpus
    return Prediction(step_s=step, tflops_per_gpu=step_flops(spec, par) / (step * gpus) / 1e12,
                      mfu=step_flops(spec, par, recompute=False, causal=True) / (step * gpus * device.peak_flops),
                      memory_bytes=max(_stage_memories(spec, par, layers)), parts=parts)


def planner_cost_model(spec: ModelSpec, device: Device, *, micro_batch: int = 1,
                       tp_degrees: tuple[int, ...] = (1, 2, 4, 8), **overrides) -> CostModel:
    """A :class:`~hetu_ext.plan.cost.stage.CostModel` for the planners' ``stage_cost`` that reproduces this model's
    layer compute on ``device`` for ``spec`` (``micro_batch`` sequences of ``spec.seq_length``): ``flops_per_s``
    is the layer's FLOPs over its TP-1 forward seconds (GEMMs, attention, memory-bound kernels), ``tp_efficiency``
    the step model's TP-t forward against t-fold speed-up, the TP all-reduces at the profile's NVLink bus
    bandwidth, ``overrides`` the rest (e.g. ``optimizer_sharded=True``). TP degrees that do not split the model
    are left out."""
    flops = inventory.layer_forward_flops(spec, tokens=micro_batch * spec.seq_length,
                                          sum_sq=micro_batch * spec.seq_length ** 2)
    forward = {}
    for tp in tp_degrees:
        if not inventory.tp_problems(spec, tp):
            forward[tp] = layer_pass(spec, device, Parallel(tp=tp, micro_batch_size=micro_batch)).compute_f
    one = forward[1]
    return CostModel(**{"flops_per_s": flops / one, "intra_node_bytes_per_s": device.nvlink_bytes_per_s,
                        "inter_node_bytes_per_s": device.inter_node_bytes_per_s,
                        "tp_efficiency": {tp: one / (tp * f) for tp, f in forward.items()}, **overrides})

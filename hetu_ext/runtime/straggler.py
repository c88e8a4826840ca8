"""Per-layer compute timing, speed emulation, and the exchange of timings between ranks (torch; no host framework).

Each transformer layer gets two identity autograd marks, at its input and at its output. The forward time of a
layer is the time between its forward pre-hook and its forward hook; its backward time is the time between the
output mark's backward (the gradient arrives) and the input mark's backward (it leaves). Only compute is
measured: pipeline and gradient communication happen outside the layers.

Emulation (``--hetu-emulate-slowdown "step=20:rank=3:x=4"``) pads each layer's forward and backward to x times
its measured duration: a sleep on CPU, ``torch.cuda._sleep`` on GPU (timed with CUDA events there). The padding is
counted as compute, so the measurement sees an emulated straggler exactly as it would a slow GPU. On a CPU shared
by many ranks, a sleeping straggler frees cores for the others and its own measured duration shrinks;
``--hetu-emulate-layer-ms T`` fixes that by giving every layer an emulated device time (T forward, 2T backward,
times x), so all ranks keep the pace of the emulated cluster. ``--hetu-emulate-cost FILE`` makes that time the
cost model's for the microbatch the layer just ran (``a sum(s^2) + b sum(s) + c`` at the stage's TP degree,
forward 1/3, backward 2/3; the lengths read from the layer's own input), so a CPU run behaves like the modelled
cluster for length- and TP-dependent work; the monitor then divides measured time by that emulated work (not
FLOPs), so varying packs make no false stragglers. A layer whose real time exceeds its emulated time is an
*overrun* (the emulation no longer holds there): counted.

A collective inside a layer (ZeRO-3 gathers a layer's parameters in its submodules' hooks, ZeRO-2/3 reduce
gradients in the parameters' hooks) waits for the slowest rank, so a healthy rank's span would hold the straggler's
compute. :meth:`LayerTimer.excluded` (and :meth:`LayerTimer.exclude`, a wrapper) leaves such a block out of the
spans open around it, on the host clock; the host framework's adapter wraps its hooks' work that is not the
layer's compute (hetu_ext/deepspeed/weighting.py). On CUDA a collective's wait is a stream wait the host does not
see: the CUDA clock excludes nothing (not done: no GPU to check it on).

:func:`exchange_timings` is the one collective: every rank's (compute seconds, FLOPs) samples since the last
exchange, gathered on every rank; the timer and the emulation need no process group.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

Timings = list[tuple[int, list[tuple[float, float]]]]
"""Per rank (ascending), its (compute seconds, FLOPs) samples, one per step, since the last exchange."""


@dataclass(frozen=True)
class SlowdownEvent:
    step: int
    rank: int
    factor: float


def parse_schedule(text: str) -> list[SlowdownEvent]:
    """``"step=20:rank=3:x=4,step=60:rank=3:x=1"`` -> events (x=1 ends a slowdown). ValueError on bad input."""
    events = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        fields = dict(kv.split("=", 1) for kv in item.split(":") if "=" in kv)
        try:
            event = SlowdownEvent(step=int(fields["step"]), rank=int(fields["rank"]), factor=float(fields["x"]))
        except (KeyError, ValueError):
            raise ValueError(f"--hetu-emulate-slowdown {item!r}: expected step=N:rank=R:x=F (e.g. step=20:rank=3:"
                             f"x=4), several separated by commas") from None
        if event.step < 0 or event.rank < 0 or event.factor < 1.0:
            raise ValueError(f"--hetu-emulate-slowdown {item!r}: need step >= 0, rank >= 0 and x >= 1")
        events.append(event)
    return sorted(events, key=lambda e: e.step)


def factor_at(events: list[SlowdownEvent], rank: int, step: int) -> float:
    """The emulated slowdown of ``rank`` at ``step`` (the factor of its latest event at or before it; 1.0)."""
    factor = 1.0
    for event in events:
        if event.rank == rank and event.step <= step:
            factor = event.factor
    return factor


def onset_latency(events: list[SlowdownEvent], ranks: Iterable[int], step: int) -> int | None:
    """Steps from the latest emulated change of one of ``ranks`` at or before ``step`` to ``step``, both counted
    (a detection at the step of the onset: 1); None when none of them had one (a real, not emulated, change)."""
    ranks = set(ranks)
    onsets = [e.step for e in events if e.rank in ranks and e.step <= step]
    return step - max(onsets) + 1 if onsets else None


def exchange_timings(rank: int, samples: list[tuple[float, float]], group=None) -> Timings:
    """Every rank's samples, ``rank``'s being ``samples`` (collective: every rank of ``group`` calls it, with
    its own; one small all_gather_object). Ranks with no samples (nothing timed since the last exchange) are
    listed with an empty list."""
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (rank, samples), group=group)
    return sorted(everyone)


class _CpuClock:
    """Host wall-clock spans: on CPU the host runs the compute, so the time between two hooks is compute time, less
    the excluded blocks (:meth:`hold`) within it."""

    def __init__(self) -> None:
        self.held = 0.0
        """Seconds of excluded blocks so far (a span subtracts what accrued between its start and stop)."""

    def start(self) -> tuple[float, float]:
        return time.perf_counter(), self.held

    def stop(self, start: tuple[float, float], *, wait: bool) -> float | None:
        return time.perf_counter() - start[0] - (self.held - start[1])

    def hold(self, start: tuple[float, float]) -> None:
        """The block begun at ``start`` (a :meth:`start`) is not compute: spans open across it leave it out."""
        self.held += time.perf_counter() - start[0]

    def pause(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)

    def drain(self) -> float:
        return 0.0


class _CudaClock:
    """CUDA-event spans: the host only enqueues kernels, so a span is the device time between two events.

    Spans are resolved lazily (``drain`` at :meth:`LayerTimer.take`, once per step) so timing never synchronises
    the stream, except when emulation needs a span's length to pad it (``wait=True``). Padding is
    ``torch.cuda._sleep`` (a spin kernel on the stream), calibrated once in cycles per second.
    """

    def __init__(self) -> None:
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._cycles_per_s: float | None = None

    def start(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def hold(self, start: torch.cuda.Event) -> None:
        """Excludes nothing: a collective's wait is a stream wait on the device, not seen by the host."""

    def stop(self, start: torch.cuda.Event, *, wait: bool) -> float | None:
        end = self.start()
        if not wait:
            self._pending.append((start, end))
            return None
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def pause(self, seconds: float) -> None:
        if seconds > 0:
            torch.cuda._sleep(int(seconds * self._calibrate()))

    def drain(self) -> float:
        if not self._pending:
            return 0.0
        self._pending[-1][1].synchronize()
        seconds = sum(start.elapsed_time(end) for start, end in self._pending) / 1e3
        self._pending.clear()
        return seconds

    def _calibrate(self) -> float:
        if self._cycles_per_s is None:
            cycles = 50_000_000
            torch.cuda._sleep(cycles)  # warm-up
            start = self.start()
            torch.cuda._sleep(cycles)
            self._cycles_per_s = cycles / self.stop(start, wait=True)
        return self._cycles_per_s


class _Mark(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, timer, edge, emulated):
        ctx.timer, ctx.edge, ctx.emulated = timer, edge, emulated
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.timer._backward_edge(ctx.edge, ctx.emulated)
        return grad, None, None, None


CostFn = Callable[[int, int], float]
"""(tokens, sum of squared document lengths) of a microbatch -> seconds of one layer's forward + backward."""


def microbatch_shape(args, kwargs) -> tuple[int, int]:
    """(tokens, sum of squared sequence lengths) of the microbatch entering a transformer layer: from the THD
    pack's ``cu_seqlens`` when packed, else the ``(s, b, h)`` hidden states' ``b`` sequences of ``s``."""
    packed = kwargs.get("packed_seq_params")
    if packed is not None and getattr(packed, "cu_seqlens_q", None) is not None:
        lengths = torch.diff(packed.cu_seqlens_q.detach().cpu().long())
        return int(lengths.sum()), int((lengths * lengths).sum())
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    s, b = int(hidden.shape[0]), int(hidden.shape[1])
    return s * b, b * s * s


@dataclass
class LayerTimer:
    """Compute seconds of a stage's layers (forward + backward), with optional emulated slowdown."""

    factor: float = 1.0
    """Emulated slowdown applied to every layer (1.0: none)."""
    nominal_s: float | None = None
    """Emulated device time of one layer's forward for one microbatch (backward: twice that). When set, every
    layer takes ``factor x nominal`` (or its real time, if longer) on every rank, healthy or not, so the ranks'
    pace is the emulated cluster's and not that of processes sharing CPU cores."""
    seconds: float = 0.0
    """Compute seconds accumulated since the last :meth:`take` (CUDA spans are added at :meth:`take`)."""
    work: float = 0.0
    """Emulated seconds (before ``factor``) of the passes since the last :meth:`take_work` (cost emulation)."""
    overruns: int = 0
    """Layer passes whose real time exceeded their emulated time since the last :meth:`take_overruns`."""
    _holding: bool = False
    """Inside an :meth:`excluded` block (a nested one counts once)."""
    _starts: list = field(default_factory=list)
    _bwd_start: object = None
    _costs: dict = field(default_factory=dict)
    """id(layer) -> its :data:`CostFn` (layers attached with a cost are emulated from the cost model)."""
    _clock: _CpuClock | _CudaClock = field(default_factory=_CpuClock)

    @property
    def cost_emulated(self) -> bool:
        return bool(self._costs)

    def attach(self, layers: list[torch.nn.Module], cost: CostFn | None = None) -> list:
        """Time these layers; returns the hook handles (remove them to detach). With ``cost`` (one layer's
        forward + backward seconds for a microbatch's shape), each pass is padded to the cost model's time.

        Layers whose parameters live on a CUDA device are timed with CUDA events, others with the host clock.
        """
        params = [p for layer in layers for p in layer.parameters()]
        if params and params[0].is_cuda and not isinstance(self._clock, _CudaClock):
            self._clock = _CudaClock()
        handles = []
        for layer in layers:
            if cost is not None:
                self._costs[id(layer)] = cost
            handles.append(layer.register_forward_pre_hook(self._pre, with_kwargs=True))
            handles.append(layer.register_forward_hook(self._post, with_kwargs=True))
        return handles

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """A block left out of the layer spans open around it: a collective's wait inside a layer (host clock)."""
        if self._holding:
            yield
            return
        self._holding, start = True, self._clock.start()
        try:
            yield
        finally:
            self._clock.hold(start)
            self._holding = False

    def exclude(self, fn: Callable) -> Callable:
        """``fn`` run inside :meth:`excluded` (to wrap a host framework's collective)."""
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with self.excluded():
                return fn(*args, **kwargs)
        return wrapped

    def take(self) -> float:
        seconds, self.seconds = self.seconds + self._clock.drain(), 0.0
        return seconds

    def take_work(self) -> float:
        work, self.work = self.work, 0.0
        return work

    def take_overruns(self) -> int:
        overruns, self.overruns = self.overruns, 0
        return overruns

    def _stop(self, start, backward: bool = False, emulated: float | None = None) -> None:
        """``emulated``: the cost model's seconds of this pass (None: the nominal time, or no emulation)."""
        if emulated is None and self.nominal_s is not None:
            emulated = self.nominal_s * (2.0 if backward else 1.0)
        emulating = self.factor != 1.0 or emulated is not None
        elapsed = self._clock.stop(start, wait=emulating)
        if not emulating:
            if elapsed is not None:
                self.seconds += elapsed
            return
        if emulated is None:
            target = self.factor * elapsed
        else:
            self.work += emulated
            target = self.factor * emulated
            if elapsed > target:
                self.overruns += 1
                target = elapsed
        self._clock.pause(target - elapsed)
        self.seconds += target

    def _pre(self, module, args, kwargs):
        cost = self._costs.get(id(module))
        emulated = cost(*microbatch_shape(args, kwargs)) if cost is not None else None
        self._starts.append((self._clock.start(), emulated))
        if "hidden_states" in kwargs and torch.is_grad_enabled():
            kwargs["hidden_states"] = _Mark.apply(kwargs["hidden_states"], self, "in", emulated)
        elif args and torch.is_grad_enabled():
            args = (_Mark.apply(args[0], self, "in", emulated), *args[1:])
        return args, kwargs

    def _post(self, module, args, kwargs, output):
        start, emulated = self._starts.pop()
        self._stop(start, emulated=None if emulated is None else emulated / 3)
        hidden = output[0] if isinstance(output, tuple) else output
        if torch.is_grad_enabled() and hidden.requires_grad:
            # a hook, not a _Mark: the layer's output stays the layer's own tensor (a view of it, as a custom
            # Function returns, is what Megatron's pipeline schedule refuses to free when it is a stage's output).
            # Its gradient arrives after the next layer's input mark has run, so the backward edges keep their order
            hidden.register_hook(functools.partial(self._output_gradient, emulated))
        return output

    def _output_gradient(self, emulated: float | None, grad: torch.Tensor) -> None:
        self._backward_edge("out", emulated)

    def _backward_edge(self, edge: str, emulated: float | None) -> None:
        if edge == "out":
            self._bwd_start = self._clock.start()
        else:
            self._stop(self._bwd_start, backward=True, emulated=None if emulated is None else emulated * 2 / 3)

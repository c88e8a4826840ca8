"""Per-layer compute timing, speed emulation, and the exchange of timings between ranks (torch; no host framework).

Each transformer layer gets two identity autograd marks, at its input and at its output. The forward time of a
layer is the time between its forward pre-hook and its forward hook; its backward time is the time between the
output mark's backward (the gradient arrives) and the input mark's backward (it leaves). Only compute is
measured: pipeline and gradient communication happen outside the layers.

Emulation (``--hetu-emulate-slowdown "step=20:rank=3:x=4"``) pads each layer's forward and backward to x times
its measured duration: a sleep on CPU, ``torch.cuda._sleep`` on GPU (timed with CUDA events there). The padding is counted as compute, so the
measurement sees an emulated straggler exactly as it would a slow GPU. On a CPU shared by many ranks, a sleeping
straggler frees cores for the others and its own measured duration shrinks; ``--hetu-emulate-layer-ms T`` fixes
that by giving every layer an emulated device time (T forward, 2T backward, times x), so all ranks keep the pace
of the emulated cluster.

:func:`exchange_timings` is the one collective: every rank's (compute seconds, FLOPs) samples since the last
exchange, gathered on every rank; the timer and the emulation need no process group.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
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
    """Host wall-clock spans: on CPU the host runs the compute, so the time between two hooks is compute time."""

    def start(self) -> float:
        return time.perf_counter()

    def stop(self, start: float, *, wait: bool) -> float | None:
        return time.perf_counter() - start

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
    def forward(ctx, x, timer, edge):
        ctx.timer, ctx.edge = timer, edge
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.timer._backward_edge(ctx.edge)
        return grad, None, None


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
    _starts: list = field(default_factory=list)
    _bwd_start: object = None
    _clock: _CpuClock | _CudaClock = field(default_factory=_CpuClock)

    def attach(self, layers: list[torch.nn.Module]) -> list:
        """Time these layers; returns the hook handles (remove them to detach).

        Layers whose parameters live on a CUDA device are timed with CUDA events, others with the host clock.
        """
        params = [p for layer in layers for p in layer.parameters()]
        if params and params[0].is_cuda and not isinstance(self._clock, _CudaClock):
            self._clock = _CudaClock()
        handles = []
        for layer in layers:
            handles.append(layer.register_forward_pre_hook(self._pre, with_kwargs=True))
            handles.append(layer.register_forward_hook(self._post, with_kwargs=True))
        return handles

    def take(self) -> float:
        seconds, self.seconds = self.seconds + self._clock.drain(), 0.0
        return seconds

    def _stop(self, start, backward: bool = False) -> None:
        emulating = self.factor != 1.0 or self.nominal_s is not None
        elapsed = self._clock.stop(start, wait=emulating)
        if not emulating:
            if elapsed is not None:
                self.seconds += elapsed
            return
        if self.nominal_s is None:
            target = self.factor * elapsed
        else:
            target = max(elapsed, self.factor * self.nominal_s * (2.0 if backward else 1.0))
        self._clock.pause(target - elapsed)
        self.seconds += target

    def _pre(self, module, args, kwargs):
        self._starts.append(self._clock.start())
        if "hidden_states" in kwargs and torch.is_grad_enabled():
            kwargs["hidden_states"] = _Mark.apply(kwargs["hidden_states"], self, "in")
        elif args and torch.is_grad_enabled():
            args = (_Mark.apply(args[0], self, "in"), *args[1:])
        return args, kwargs

    def _post(self, module, args, kwargs, output):
        self._stop(self._starts.pop())
        if torch.is_grad_enabled():
            if isinstance(output, tuple):
                return (_Mark.apply(output[0], self, "out"), *output[1:])
            return _Mark.apply(output, self, "out")
        return output

    def _backward_edge(self, edge: str) -> None:
        if edge == "out":
            self._bwd_start = self._clock.start()
        else:
            self._stop(self._bwd_start, backward=True)

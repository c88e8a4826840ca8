"""Straggler measurement: emulation schedules, layer timing with emulated slowdown, slowdown estimation with
hysteresis, the pure detector and re-planner the monitor composes (no process group), the exchange of timings,
and the monitor detecting an emulated straggler in a real 2-rank Megatron-core run."""

from __future__ import annotations

import time

import pytest
import torch
from helpers import gpt_argv

from hetu_ext.plan import ModelSpec, uniform_plan
from hetu_ext.plan.malleus.straggler_policy import (
    SlowdownEstimator,
    StragglerDetector,
    StragglerPolicy,
    replan,
    should_replan,
)
from hetu_ext.runtime.straggler import LayerTimer, factor_at, onset_latency, parse_schedule
from hetu_ext.testing.multiproc import run_ranks


def test_schedule_parsing_and_lookup():
    events = parse_schedule("step=20:rank=3:x=4, step=60:rank=3:x=1,step=30:rank=1:x=2.5")
    assert [(e.step, e.rank, e.factor) for e in events] == [(20, 3, 4.0), (30, 1, 2.5), (60, 3, 1.0)]
    assert [factor_at(events, 3, s) for s in (19, 20, 59, 60)] == [1.0, 4.0, 4.0, 1.0]
    for bad in ("step=20:rank=3", "step=x:rank=1:x=2", "step=1:rank=1:x=0.5"):
        with pytest.raises(ValueError, match="--hetu-emulate-slowdown"):
            parse_schedule(bad)


def test_estimator_normalises_by_work_and_uses_the_median_pace():
    est = SlowdownEstimator(policy=StragglerPolicy(window=3))
    for step in range(3):
        for rank in range(4):
            flops = 1e12 * (2 if rank == 1 else 1)  # rank 1 does twice the work in twice the time: not slow
            seconds = flops * 1e-12 * (3.0 if rank == 2 else 1.0) * (1.05 if step == 1 else 1.0)
            est.add(rank, seconds, flops)
    assert est.slowdowns()[1] == pytest.approx(1.0) and est.stragglers() == {2: pytest.approx(3.0)}


def test_hysteresis():
    policy = StragglerPolicy(threshold=1.3, min_change=0.2)
    assert not should_replan({}, {0: 1.2}, policy)  # below the threshold
    assert should_replan({}, {3: 4.0}, policy)  # a new straggler
    assert not should_replan({3: 4.0}, {3: 4.5}, policy)  # moved 12%: keep the plan
    assert should_replan({3: 4.0}, {3: 2.0}, policy)  # moved 50%
    assert should_replan({3: 4.0}, {}, policy)  # recovered


def _timings(paces: dict[int, float], steps: int = 1) -> list[tuple[int, list[tuple[float, float]]]]:
    """One exchange: each rank's ``steps`` samples at ``pace`` seconds per 1e12 FLOPs."""
    return [(rank, [(pace, 1e12)] * steps) for rank, pace in sorted(paces.items())]


def test_detector_reports_changes_past_the_hysteresis_only():
    """The detection the monitor acts on, with no process group: nothing until a full window; a new straggler
    is a change (and becomes ``assumed``); a 12% move is not; a new plan restarts the window but keeps
    ``assumed``, and a rank not measured since (an idle rank without a full window of probes) keeps its assumed
    slowdown rather than counting as recovered (which would bring a slow rank back and flap)."""
    detector = StragglerDetector(policy=StragglerPolicy(threshold=1.3, min_change=0.2, window=2))
    detector.add(_timings({0: 1.0, 1: 1.0, 2: 3.0}))
    assert detector.detect() is None
    detector.add(_timings({0: 1.0, 1: 1.0, 2: 3.0}))
    found = detector.detect()
    assert found.changed and found.stragglers == {2: pytest.approx(3.0)} and detector.assumed == found.stragglers
    assert found.estimates == {0: 1.0, 1: 1.0, 2: pytest.approx(3.0)}
    detector.add(_timings({0: 1.0, 1: 1.0, 2: 3.3}, steps=2))
    found = detector.detect()
    assert not found.changed and detector.assumed == {2: pytest.approx(3.0)}
    detector.restart()
    assert detector.detect() is None and detector.assumed == {2: pytest.approx(3.0)}
    detector.add(_timings({0: 1.0, 1: 1.0}, steps=2) + [(2, [])])
    found = detector.detect()
    assert not found.changed and found.stragglers == {2: pytest.approx(3.0)} and 2 not in found.estimates
    detector.add(_timings({0: 1.0, 1: 1.0, 2: 1.0}, steps=2))
    found = detector.detect()
    assert found.changed and found.stragglers == {} and detector.assumed == {}


def test_replan_moves_work_off_a_straggler_and_keeps_a_plan_that_is_as_good():
    """The re-planner is pure and deterministic (every rank makes the same plan with no communication): for
    a healthy cluster it keeps the current plan; for a 4x straggler it makes another plan that gives that rank
    less work, twice the same."""
    spec = ModelSpec(num_layers=8, hidden_size=256, num_attention_heads=8, seq_length=256)
    current = uniform_plan(world_size=4, num_layers=8, num_microbatches=8)
    kwargs = {"micro_batch": 1, "gpus_per_node": 4, "gpu_memory_bytes": 80 * 2**30}
    assert replan(current, spec, {}, **kwargs).plan == current
    slow = replan(current, spec, {3: 4.0}, **kwargs)
    assert slow.plan != current and slow == replan(current, spec, {3: 4.0}, **kwargs)

    def work(plan, rank):
        where = plan.stage_of(rank)
        if where is None:
            return 0
        pipeline = plan.pipelines[where[0]]
        return pipeline.stages[where[1]].num_layers * pipeline.num_microbatches / pipeline.stages[where[1]].tp

    assert work(slow.plan, 3) < work(current, 3) and work(slow.plan, 3) < min(work(slow.plan, r) for r in range(3))


def test_onset_latency_counts_from_the_latest_emulated_change():
    events = parse_schedule("step=3:rank=1:x=5,step=9:rank=1:x=1,step=5:rank=2:x=3")
    assert onset_latency(events, {1}, 3) == 1 and onset_latency(events, [1], 6) == 4
    assert onset_latency(events, {1, 2}, 8) == 4 and onset_latency(events, {1}, 10) == 2
    assert onset_latency(events, {0}, 10) is None and onset_latency(events, {1}, 2) is None


def _exchange_body(rank: int, world: int) -> list:
    from hetu_ext.runtime.straggler import exchange_timings

    return exchange_timings(rank, [(0.1 * (rank + 1), 1e9)] * (rank + 1) if rank != 1 else [])


def test_exchange_timings_gives_every_rank_every_rank_s_samples():
    """The one collective of the monitor: every rank gets the same per-rank samples in rank order, a rank with
    none (idle, before its first probe) listed with an empty list."""
    results = run_ranks(_exchange_body, 3, timeout=120)
    assert results[0] == results[1] == results[2] == [(0, [(0.1 * 1, 1e9)]), (1, []), (2, [(0.1 * 3, 1e9)] * 3)]


def test_emulated_slowdown_is_real_time_and_measured_in_forward_and_backward():
    """The padding is wall time the layer really takes (sleep), and the timer counts it in both passes."""
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()) for _ in range(4)]
    timer = LayerTimer()
    timer.attach(layers)
    x = torch.randn(512, 256)

    def step(factor):
        timer.factor = factor
        start = time.perf_counter()
        y = x
        for layer in layers:
            y = layer(y)
        forward = timer.seconds
        y.sum().backward()
        return time.perf_counter() - start, forward, timer.take()

    step(1.0)  # warm-up
    wall1, fwd1, total1 = step(1.0)
    wall3, fwd3, total3 = step(3.0)
    assert total1 > fwd1 > 0 and total3 > fwd3 > 0  # backward time is counted too
    # what the timer counts is time the step really took (never more than the wall time), and with x=3 two thirds
    # of it is padding that was slept: the wall time holds at least that (counted but not slept, the wall time
    # would be ~1/3 of the count). Only bounds a busy machine cannot break: its delays add to the wall time only
    assert total1 <= 1.05 * wall1 and total3 <= 1.05 * wall3 and wall3 >= 0.6 * total3


def test_a_timed_layers_output_is_its_own_tensor_which_megatrons_pipeline_may_free():
    """The timer marks a layer's output with a gradient hook, not a view: a pipeline stage's output must not be a
    view (Megatron's schedule frees it, deallocate_output_tensor, and refuses views), and the backward pass is still
    timed, edge after edge, on every layer."""
    from megatron.core.pipeline_parallel.schedules import custom_backward, deallocate_output_tensor

    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 64) for _ in range(3)]
    timer = LayerTimer(nominal_s=0.002)
    timer.attach(layers)
    y = torch.randn(8, 64, requires_grad=True)
    for layer in layers:
        y = layer(y)
    assert y._base is None
    forward = timer.seconds
    loss_grad = torch.ones_like(y)
    deallocate_output_tensor(y, deallocate_pipeline_outputs=True)  # raised "counter-productive to free a view"
    custom_backward(y, loss_grad)
    # forward 3 x 2 ms, then each layer's backward (twice the nominal time) counted once, between its two edges
    assert forward >= 3 * 0.002 and timer.take() >= 3 * 0.002 * 3
    assert timer.take_work() == pytest.approx(3 * 0.002 * 3)


def _monitored(rank, world, argv):
    from hetu_ext.cli.args import parse_run_config
    from hetu_ext.train.trainer import build_trainer

    trainer = build_trainer(parse_run_config(argv))
    lines = []
    trainer.train(log=lines.append)
    return {"detections": trainer.monitor.detections, "lines": lines}


def test_monitor_detects_an_emulated_straggler(sample_prefix):
    """Rank 1 turns 5x slow at step 3; both ranks hold the same detection of rank 1 only. Layers get an emulated
    device time (15 ms, many times this tiny layer's real time) so busy neighbours on the shared cores cannot make
    rank 0 read as the straggler or the straggler as less slow (at 5 ms and load average ~40 it read as x2.2)."""
    argv = gpt_argv(1, 1, sample_prefix, ("--train-iters", "8", "--hetu-emulate-slowdown", "step=3:rank=1:x=5",
                                       "--hetu-straggler-interval", "2", "--hetu-straggler-window", "2",
                                       "--hetu-straggler-threshold", "2.0", "--hetu-emulate-layer-ms", "15"))
    results = run_ranks(_monitored, 2, argv, timeout=180)
    detections = results[0]["detections"]
    assert detections and detections == results[1]["detections"]  # every rank holds the same estimate
    step, stragglers = detections[0]
    assert set(stragglers) == {1} and stragglers[1] > 3.0 and step >= 4
    assert any("straggler monitor: step" in line and "rank 1 x" in line for line in results[0]["lines"])


def test_timing_and_emulation_leave_training_bit_identical(sample_prefix):
    """The layer marks are identities: a monitored, emulated run trains exactly like a plain one."""
    from hetu_ext.cli.runs import train

    plain = run_ranks(train, 2, gpt_argv(1, 1, sample_prefix), timeout=180)[0]
    watched = run_ranks(train, 2, gpt_argv(1, 1, sample_prefix, ("--hetu-emulate-slowdown", "step=1:rank=1:x=2",
                                                              "--hetu-straggler-interval", "1")), timeout=180)[0]
    assert watched["losses"] == plain["losses"]
    assert all(torch.equal(watched["weights"][k], w) for k, w in plain["weights"].items())


def test_emulated_layer_time_sets_every_rank_pace():
    """--hetu-emulate-layer-ms: each layer takes factor x nominal (2x for backward), whatever its real time,
    so ranks sharing CPU cores keep the emulated cluster's pace; the timer counts exactly that time."""
    layers = [torch.nn.Linear(8, 8) for _ in range(3)]
    timer = LayerTimer(factor=2.0, nominal_s=0.01)
    timer.attach(layers)
    start = time.perf_counter()
    y = torch.randn(4, 8, requires_grad=True)  # as a stage's input always is (embedding output or received)
    for layer in layers:
        y = layer(y)
    forward_wall = time.perf_counter() - start
    assert timer.seconds == pytest.approx(3 * 2 * 0.01, rel=0.05) and forward_wall >= 0.06
    y.sum().backward()
    assert timer.take() == pytest.approx(3 * 2 * 0.01 * 3, rel=0.05)  # forward + 2x backward


class _Gathering(torch.nn.Module):
    """A layer that waits ``wait_s`` in a collective-like block before its compute, as ZeRO-3's parameter gather
    does in a submodule's pre-hook, and again in its weight's gradient hook, as ZeRO-2/3's reduction does."""

    def __init__(self, timer: LayerTimer, wait_s: float, exclude: bool = True) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        wait = lambda *_: time.sleep(wait_s)  # noqa: E731
        wait = timer.exclude(wait) if exclude else wait
        self.linear.register_forward_pre_hook(lambda *_: wait())
        self.linear.weight.register_hook(lambda grad: (wait(), grad)[1])

    def forward(self, x):
        return self.linear(x)


def test_excluded_blocks_are_not_compute():
    """Waits inside a layer's span wrapped by LayerTimer.exclude (ZeRO's gathers and reductions on the DeepSpeed
    path) are left out of its forward and backward time, with and without emulation (no overrun: the layer's
    compute stays under its emulated 10 ms); a nested excluded block counts once; outside a span nothing is
    subtracted. Control: the same waits unwrapped are counted."""
    timer = LayerTimer(nominal_s=0.01)
    layers = [_Gathering(timer, 0.03) for _ in range(2)]
    timer.attach(layers)
    y = torch.randn(4, 8, requires_grad=True)
    for layer in layers:
        y = layer(y)
    assert timer.seconds == pytest.approx(2 * 0.01, rel=0.05)
    y.sum().backward()
    assert timer.take() == pytest.approx(2 * 0.01 * 3, rel=0.05) and timer.take_overruns() == 0
    plain = LayerTimer()
    layer = _Gathering(plain, 0.03)
    plain.attach([layer])
    with plain.excluded(), plain.excluded():  # nested, and no span open: nothing to subtract from
        time.sleep(0.01)
    layer(torch.randn(4, 8))
    assert 0 < plain.take() < 0.02
    control = LayerTimer()
    layer = _Gathering(control, 0.03, exclude=False)
    control.attach([layer])
    layer(torch.randn(4, 8))
    assert control.take() >= 0.03


class _Spin(torch.nn.Module):
    """A layer whose forward is a known amount of device time (a spin kernel) and nothing on the host."""

    def __init__(self, cycles: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones((), device="cuda"))
        self.cycles = cycles

    def forward(self, x):
        torch.cuda._sleep(self.cycles)
        return x * self.weight


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_timer_counts_device_time_not_host_time():
    """On GPU the host returns from a kernel launch at once: a host clock would see ~0 s. The CUDA-event timer
    must see the spin kernels' device time, and an emulated 3x slowdown must pad it to 3x (within 15%: the
    _sleep calibration and launch gaps)."""
    layers = [_Spin(20_000_000) for _ in range(4)]

    def forward_seconds(timer: LayerTimer) -> float:
        handles = timer.attach(layers)
        x = torch.ones(4, device="cuda", requires_grad=True)
        for layer in layers:
            x = layer(x)
        for handle in handles:
            handle.remove()
        return timer.take()

    forward_seconds(LayerTimer(factor=2.0))  # warm-up: kernels, CUDA context, the _sleep calibration
    base, padded = forward_seconds(LayerTimer()), forward_seconds(LayerTimer(factor=3.0))
    assert base > 0.005, base
    assert padded == pytest.approx(3 * base, rel=0.15)

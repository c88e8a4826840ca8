"""The README's main job, `make demo` (launch/demo.sh): on 4 CPU ranks rank 3 turns 4x slow at step 12; the
uniform run keeps the straggler's pace, the hetu_ext run detects it, re-plans and migrates online, and recovers.

Read from the runs' metrics files, not their logs. The test runs the demo with a CPU-bound process beside it (the
main job must show its point on a busy machine): the emulated layer time (``--hetu-emulate-layer-ms``) is set
well above a layer's real time, and the step records' ``emulation_overruns`` (layer passes whose real time
exceeded the emulated one) show that it held (issue 17: at 4 ms a busy machine read the 4x straggler as x1.7).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path

from hetu_ext.metrics import read_records

ROOT = Path(__file__).resolve().parents[1]
ITERS = 22
"""Steps per run (make demo runs 36): the straggler appears at step 12, is detected after 2-4 steps, and the tail
after the migration still has steps to compare; small, as the README test runs every command."""
UNIFORM_ITERS = 16
"""Steps of the uniform run: from step 12 on it runs at the straggler's pace, every step alike (4 are enough to
compare with; each costs 4 x a healthy step)."""
LAYER_PASSES = 4 * 2 * 4 * 2
"""Layer passes per step over the used ranks before the migration: 4 ranks x 2 microbatches (8 sequences, one
per microbatch) x 4 layers x (forward, backward)."""


def test_demo_detects_migrates_and_recovers_beside_a_cpu_bound_process(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    out = tmp_path / "demo"
    load = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # a busy neighbour on one of the cores
    try:
        proc = subprocess.run(["bash", "launch/demo.sh", "4", str(out), str(ITERS), str(UNIFORM_ITERS)], cwd=ROOT,
                              capture_output=True, text=True, timeout=900, env=env)
    finally:
        load.kill()
        load.wait()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "throughput.png").stat().st_size > 0
    hetu = out / "hetu.jsonl"
    steps = read_records(hetu, kind="step")
    overruns = sum(r["emulation_overruns"] for r in steps)
    # a layer pass whose real time exceeds the emulated one (a busy neighbour held the core) counts; a few are
    # expected on a loaded machine (measured: 0-6% of passes at load average ~20), more would mean the emulated
    # cluster no longer sets the pace
    assert overruns <= 0.15 * LAYER_PASSES * len(steps), f"the emulation did not hold: {overruns} overruns"
    detections = [r for r in read_records(hetu, event="detection") if r["stragglers"]]
    assert detections and "3" in detections[0]["stragglers"], read_records(hetu, kind="event")
    assert 12 <= detections[0]["iteration"] <= 18 and detections[0]["stragglers"]["3"] >= 2.0
    assert set(detections[0]["stragglers"]) == {"3"}, detections[0]  # no healthy rank taken for the straggler
    migrations = read_records(hetu, event="migration")
    assert migrations and migrations[0]["iteration"] == detections[0]["iteration"]
    uniform = {r["iteration"]: r["tokens_per_s"] for r in read_records(out / "uniform.jsonl", kind="step")}
    assert sorted(uniform) == list(range(1, UNIFORM_ITERS + 1))
    after = {r["iteration"]: r["tokens_per_s"] for r in steps}
    tail = range(migrations[0]["iteration"] + 3, ITERS + 1)
    # hetu_ext after the migration runs at 3 of 4 ranks' pace; the uniform run at the 4x straggler's (every step
    # of it after the straggler appears)
    assert statistics.median(after[i] for i in tail) > 1.5 * statistics.median(
        uniform[i] for i in range(13, UNIFORM_ITERS + 1))

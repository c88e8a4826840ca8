"""The launch tools a new user meets after training: the demo's plot, the elastic launcher (issue 12)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from hetu_ext.metrics import format_log_line

ROOT = Path(__file__).resolve().parents[1]


def _launch_module(name: str):
    spec = importlib.util.spec_from_file_location(f"launch_{name}", ROOT / "launch" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _step_line(i: int, tokens_per_s: int) -> str:
    """A Megatron-LM log line of step ``i`` (what elastic.py sees on a rank's stdout)."""
    return format_log_line({"iteration": i, "train_iters": 20, "consumed_samples": 24 * i, "step_ms": 100.0,
                            "lr": 1e-3, "samples": 24, "loss": 5.0, "grad_norm": None, "tokens_per_s": tokens_per_s})


def _step(i: int, tokens_per_s: int) -> dict:
    return {"kind": "step", "iteration": i, "train_iters": 20, "loss": 5.0, "lr": 1e-3, "grad_norm": 1.0,
            "samples": 24, "tokens": 24 * 128, "consumed_samples": 24 * i, "step_ms": 100.0,
            "tokens_per_s": tokens_per_s}


SYNTHETIC_RECORDS = [
    *(_step(i, 3000) for i in range(1, 12)),
    {"kind": "event", "event": "detection", "iteration": 4, "stragglers": {}},  # none named: not a detection
    *(_step(i, 1000) for i in range(12, 15)),
    {"kind": "event", "event": "detection", "iteration": 14, "stragglers": {"3": 4.02}, "latency_steps": 3},
    {"kind": "event", "event": "replan", "iteration": 14, "changed": True},
    {"kind": "event", "event": "migration", "iteration": 14, "seconds": 0.4, "bytes_sent": 2**20},
    *(_step(i, 2600) for i in range(15, 21)),
    {"kind": "event", "event": "detection", "iteration": 18, "stragglers": {}},  # recovered: not a detection
]


def test_plot_marks_only_real_detections_and_each_migration(tmp_path):
    """The demo's plot drew a detection at every "stragglers none" line and no migration marker. Detections
    must come only from detection events that name a straggler; each migration gets its own line and marker (after the
    step it follows, so it does not hide under the detection of the same step)."""
    plot = _launch_module("plot_throughput")
    log = tmp_path / "hetu.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in SYNTHETIC_RECORDS))
    steps, speeds, events = plot.read(str(log))
    assert steps == list(range(1, 21)) and speeds[13] == 1000
    assert events == [("detected", 14), ("migrated", 14)]
    fig = plot.plot([("hetu_ext", str(log))], "test")
    ax = fig.axes[0]
    vertical = sorted(float(line.get_xdata()[0]) for line in ax.lines if len(set(line.get_xdata())) == 1
                      and line.get_linestyle() in (":", "-") and line.get_label().startswith("_"))
    assert vertical == [14.0, 14.5]
    assert "hetu_ext: migration" in [t.get_text() for t in ax.get_legend().get_texts()]
    out = tmp_path / "plot.png"
    assert plot.main(["--out", str(out), f"hetu_ext={log}"]) == 0 and out.stat().st_size > 0


TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3"]


def test_elastic_stops_on_a_configuration_error(tmp_path):
    """A bad flag made launch/elastic.py take each rank's exit 2 for a lost GPU: it shrank the job to 1 rank,
    writing a plan per restart. Exit code 2 is a configuration error: exit 2 at once, the job's one error line
    shown once, no plan written, no second attempt."""
    save = tmp_path / "ckpt"
    missing = tmp_path / "nowhere" / "docs_text_document"
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "elastic.py"), "--nproc-per-node", "2",
                           "--max-restarts", "1", "--", *TINY, "--data-path", str(missing), "--save", str(save),
                           "--save-interval", "1"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "attempt 1" not in proc.stderr and not list(tmp_path.rglob("elastic_plan_*.yaml")), proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and str(missing) in errors[0] and "Traceback" not in proc.stderr, proc.stderr


def test_elastic_failure_cause():
    """What is and is not a lost device, on the output an attempt printed (pure)."""
    elastic = _launch_module("elastic")
    trace = ["Traceback (most recent call last):", '  File "x.py", line 1, in <module>',
             "TypeError: build() got an unexpected keyword argument 'x'"]
    same = elastic.Attempt(1, [], [f"[rank{r}]: {line}" for r in range(3) for line in trace])
    assert "same error (TypeError: build()" in elastic.failure_cause(same, 3)
    summary = "pretrain_gpt.py: error: rank 0 exited with code 1; its output is above"
    unprefixed = elastic.Attempt(1, [], [*trace * 3, summary])
    assert elastic.failure_cause(unprefixed, 3) is not None
    assert elastic.failure_cause(elastic.Attempt(2, [], ["pretrain_gpt.py: error: --lr must be > 0"]), 3)
    # a lost rank: no traceback of its own, the survivors fail in a collective
    lost = elastic.Attempt(1, [], [f"[rank{r}]: RuntimeError: Connection closed by peer" for r in (0, 2)])
    assert elastic.failure_cause(lost, 3) is None
    # the same error on every rank after steps ran: not "before the first step"
    stepped = elastic.Attempt(1, [_step_line(1, 3000)], same.stderr)
    assert elastic.failure_cause(stepped, 3) is None


def monitor_body(rank: int, world: int, log_interval: int) -> list[str] | None:
    """Two ranks' monitor on a fixed pace: rank 1 takes 3x rank 0's seconds for the same FLOPs from step 5."""
    from hetu_ext.megatron.monitor import StragglerMonitor
    from hetu_ext.plan import ModelSpec, uniform_plan
    from hetu_ext.plan.malleus.straggler_policy import StragglerPolicy

    monitor = StragglerMonitor(rank=rank, plan=uniform_plan(world_size=2, num_layers=2),
                               spec=ModelSpec(num_layers=2, hidden_size=8, num_attention_heads=2, seq_length=8),
                               micro_batch=1, interval=2, policy=StragglerPolicy(threshold=2.0, window=2),
                               events=[], gpus_per_node=2, log_interval=log_interval)
    lines: list[str] = []
    for step in range(1, 17):
        seconds = 0.1 * (3.0 if rank == 1 and step >= 5 else 1.0)
        monitor.timer.take = lambda seconds=seconds: seconds  # this step's layer time
        monitor.after_step(step, lines.append)
    return lines if rank == 0 else None


def test_monitor_prints_its_estimate_at_the_log_interval():
    """The straggler monitor printed only when the stragglers changed: a long healthy run said nothing of them.
    Now the reporting rank prints the estimate every --log-interval steps (at the first exchange at or after each
    multiple), besides the detection line when they change; other ranks print nothing."""
    from hetu_ext.testing.multiproc import run_ranks

    lines = run_ranks(monitor_body, 2, 4, timeout=120)[0]
    estimates = [line for line in lines if line.startswith("straggler monitor: step") and " | " in line]
    detections = [line for line in lines if ": stragglers rank 1 x3.00" in line]
    assert estimates[0] == "straggler monitor: step 4 | slowest: rank 0 x1.00 | median: x1.00 | stragglers: none |"
    assert len(detections) == 1 and detections[0].startswith("straggler monitor: step 6: stragglers rank 1 x3.00")
    assert [int(line.split()[3]) for line in estimates] == [4, 8, 12, 16]
    assert estimates[-1] == ("straggler monitor: step 16 | slowest: rank 1 x3.00 | median: x2.00 | stragglers: "
                             "rank 1 x3.00 |")
    quiet = run_ranks(monitor_body, 2, 0, timeout=120)[0]  # log_interval 0: only the changes
    assert not [line for line in quiet if " | " in line] and any(": stragglers rank 1" in line for line in quiet)

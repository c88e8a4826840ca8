"""The launch tools a new user meets after training: the demo's plot, the elastic launcher (issue 12)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _launch_module(name: str):
    spec = importlib.util.spec_from_file_location(f"launch_{name}", ROOT / "launch" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _step(i: int, tokens_per_s: int) -> str:
    return (f" [2025-01-01 00:00:00] iteration {i:8d}/{20:8d} | consumed samples: {24 * i:12d} | elapsed time per "
            f"iteration (ms): 100.0 | learning rate: 1.000000E-03 | global batch size:    24 | lm loss: "
            f"5.000000E+00 | tokens/s: {tokens_per_s} |")


SYNTHETIC_LOG = "\n".join([
    *(_step(i, 3000) for i in range(1, 12)),
    "straggler monitor: step 4: stragglers none",  # the monitor's report of no straggler: not a detection
    "straggler monitor: step 10 | slowest: rank 3 x1.02 | median: x1.00 | stragglers: none |",  # an estimate
    *(_step(i, 1000) for i in range(12, 15)),
    "straggler monitor: step 14: stragglers rank 3 x4.02, 3 steps after onset",
    "migrated to a new plan after step 14 in 0.40 s: 1.00 MiB sent between ranks, 2.00 MiB kept in place",
    *(_step(i, 2600) for i in range(15, 21)),
    "straggler monitor: step 18: stragglers none",  # rank 3 recovered: not a detection either
])


def test_plot_marks_only_real_detections_and_each_migration(tmp_path):
    """The demo's plot drew a detection at every "stragglers none" line and no migration marker. Detections
    must come only from lines that name a straggler; each migration gets its own line and marker (after the
    step it follows, so it does not hide under the detection of the same step)."""
    plot = _launch_module("plot_throughput")
    log = tmp_path / "hetu.log"
    log.write_text(SYNTHETIC_LOG + "\n")
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

"""Plot tokens/s per step from pretrain_gpt.py logs (Megatron-LM format) as a PNG, runs side by side.

    python launch/plot_throughput.py --out runs/demo/throughput.png uniform=runs/demo/uniform.log \
        hetu_ext=runs/demo/hetu.log

Markers: a dotted vertical line where the straggler monitor reports a straggler (a report of "stragglers none",
a recovery, is not a detection; nor are its periodic estimate lines), and a solid line with a triangle on the
curve where the run migrated to a new plan (between step N and N+1 for "migrated ... after step N").
"""

from __future__ import annotations

import argparse
import re
import sys

STEP = re.compile(r"iteration +(\d+)/ *\d+ \|.*tokens/s: (\d+) \|")
DETECTION = re.compile(r"straggler monitor: step (\d+): stragglers (.+)")
MIGRATION = re.compile(r"migrated to a new plan after step (\d+)")


def read(path: str) -> tuple[list[int], list[float], list[tuple[str, int]]]:
    """(steps, tokens/s, events) of a log; events are ("detected" | "migrated", step) in log order."""
    steps, speeds, events = [], [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    for line in lines:
        if m := STEP.search(line):
            steps.append(int(m.group(1)))
            speeds.append(float(m.group(2)))
        elif (m := DETECTION.search(line)) and not m.group(2).startswith("none"):
            events.append(("detected", int(m.group(1))))
        elif m := MIGRATION.search(line):
            events.append(("migrated", int(m.group(1))))
    return steps, speeds, events


def plot(runs: list[tuple[str, str]], title: str):
    """A figure of tokens/s per step, one curve per (label, log path), with its detections and migrations.
    Raises ValueError naming a log without Megatron-LM log lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for label, path in runs:
        steps, speeds, events = read(path)
        if not steps:
            plt.close(fig)
            raise ValueError(f"{path} has no Megatron-LM log lines (iteration ... tokens/s); give a "
                             "pretrain_gpt.py log")
        line, = ax.plot(steps, speeds, marker=".", label=label)
        color, top = line.get_color(), max(speeds)
        for kind, step in events:
            if kind == "detected":
                ax.axvline(step, color=color, linestyle=":", alpha=0.8)
                ax.annotate("straggler detected", (step, top), rotation=90, fontsize=8, color=color, va="top",
                            ha="right")
            else:
                x = step + 0.5  # the migration runs after step N, before step N+1
                ax.axvline(x, color=color, linestyle="-", linewidth=1.5, alpha=0.8)
                ax.plot([x], [top * 0.5], marker="v", markersize=9, color=color, linestyle="none",
                        label=f"{label}: migration")
                ax.annotate("migrated", (x, top * 0.5), rotation=90, fontsize=8, color=color, va="top",
                            ha="left")
    ax.set_xlabel("iteration")
    ax.set_ylabel("tokens/s")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))  # one legend entry per run's migrations
    ax.legend(unique.values(), unique.keys())
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--title", default="tokens/s per step")
    parser.add_argument("runs", nargs="+", metavar="LABEL=LOG")
    args = parser.parse_args(argv)
    runs = []
    for run in args.runs:
        label, sep, path = run.partition("=")
        if not sep:
            parser.error(f"{run!r}: give each run as LABEL=LOG, e.g. uniform=runs/demo/uniform.log")
        runs.append((label, path))
    try:
        fig = plot(runs, args.title)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

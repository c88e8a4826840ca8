"""Plot tokens/s per step from pretrain_gpt.py metrics files (JSONL records) as a PNG, runs side by side.

    python launch/plot_throughput.py --out runs/demo/throughput.png uniform=runs/demo/uniform.jsonl \
        hetu_ext=runs/demo/hetu.jsonl

Markers: a dotted vertical line at each ``detection`` event of the straggler monitor (a straggler named; its
periodic estimates and recoveries are no detections), and a solid line with a triangle on the curve where the run
migrated to a new plan (between step N and N+1 for a ``migration`` event after step N).
"""

from __future__ import annotations

import argparse
import sys

from hetu_ext.metrics import read_records


def read(path: str) -> tuple[list[int], list[float], list[tuple[str, int]]]:
    """(steps, tokens/s, events) of a metrics file; events are ("detected" | "migrated", step) in file order."""
    records = read_records(path)
    steps = [r["iteration"] for r in records if r.get("kind") == "step"]
    speeds = [float(r["tokens_per_s"]) for r in records if r.get("kind") == "step"]
    events = [("detected" if r["event"] == "detection" else "migrated", r["iteration"]) for r in records
              if r.get("kind") == "event" and (r.get("event") == "migration" or
                                               (r.get("event") == "detection" and r.get("stragglers")))]
    return steps, speeds, events


def plot(runs: list[tuple[str, str]], title: str):
    """A figure of tokens/s per step, one curve per (label, metrics file), with its detections and migrations.
    Raises ValueError naming a file without step records."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for label, path in runs:
        steps, speeds, events = read(path)
        if not steps:
            plt.close(fig)
            raise ValueError(f"{path} has no step records; give the --hetu-metrics-file of a pretrain_gpt.py run")
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
    parser.add_argument("runs", nargs="+", metavar="LABEL=METRICS")
    args = parser.parse_args(argv)
    runs = []
    for run in args.runs:
        label, sep, path = run.partition("=")
        if not sep:
            parser.error(f"{run!r}: give each run as LABEL=METRICS, e.g. uniform=runs/demo/uniform.jsonl")
        runs.append((label, path))
    try:
        fig = plot(runs, args.title)
    except (ValueError, OSError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

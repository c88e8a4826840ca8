"""Plot tokens/s per step from pretrain_gpt.py logs (Megatron-LM format) as a PNG, runs side by side.

    python launch/plot_throughput.py --out runs/demo/throughput.png uniform=runs/demo/uniform.log \
        hetu_ext=runs/demo/hetu.log

Vertical markers show where a log reports a straggler detection and a migration.
"""

from __future__ import annotations

import argparse
import re
import sys

STEP = re.compile(r"iteration +(\d+)/ *\d+ \|.*tokens/s: (\d+) \|")
EVENT = re.compile(r"(straggler monitor: step (\d+): stragglers|migrated to a new plan after step (\d+))")


def read(path: str) -> tuple[list[int], list[float], list[tuple[str, int]]]:
    steps, speeds, events = [], [], []
    for line in open(path, encoding="utf-8", errors="replace"):
        if m := STEP.search(line):
            steps.append(int(m.group(1)))
            speeds.append(float(m.group(2)))
        elif m := EVENT.search(line):
            events.append(("detected" if m.group(2) else "migrated", int(m.group(2) or m.group(3))))
    return steps, speeds, events


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--title", default="tokens/s per step")
    parser.add_argument("runs", nargs="+", metavar="LABEL=LOG")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for run in args.runs:
        label, _, path = run.partition("=")
        steps, speeds, events = read(path)
        if not steps:
            print(f"error: {path} has no Megatron-LM log lines", file=sys.stderr)
            return 2
        line, = ax.plot(steps, speeds, marker=".", label=label)
        for kind, step in events:
            ax.axvline(step, color=line.get_color(), linestyle=":" if kind == "detected" else "--", alpha=0.7)
            height = max(speeds) * (1.0 if kind == "detected" else 0.8)
            ax.annotate(kind, (step, height), rotation=90, fontsize=8, color=line.get_color(), va="top",
                        ha="right")
    ax.set_xlabel("iteration")
    ax.set_ylabel("tokens/s")
    ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Held-out length file: one line per Python source file under a directory (here the venv's site-packages), the
count of GPT-2 pre-tokenizer pieces (its regex; BPE splits some pieces further, so a slight under-count of GPT-2
tokens).

    python benchmarks/results/code_lengths_site_packages_2026-12-06.py .venv/lib/python3.11/site-packages OUT.txt.gz
"""
import gzip
import pathlib
import re
import statistics
import sys

PIECES = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+""")

out = []
for f in sorted(pathlib.Path(sys.argv[1]).rglob("*.py")):
    try:
        text = f.read_text(errors="replace")
    except OSError:
        continue
    n = len(PIECES.findall(text))
    if n:
        out.append(n)
with gzip.open(sys.argv[2], "wt") as fh:
    fh.write("\n".join(map(str, out)) + "\n")
s = sorted(out)
print(len(s), "files; mean", round(statistics.mean(s)), "median", s[len(s) // 2], "p90", s[int(.9 * len(s))],
      "p99", s[int(.99 * len(s))], "max", s[-1],
      "share of tokens > 2K", round(sum(x for x in s if x > 2048) / sum(s), 3))

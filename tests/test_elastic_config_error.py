"""A configuration error on one node of a multi-node elastic job stops every node with that error (exit code 2),
and nothing re-plans (launch/elastic.py --nnodes; hetu_ext/elastic/agent.py).

Two node launchers (one CPU rank each) on the loopback, the rendezvous store in its own process. Node B's flags
name a data file that does not exist (a file present on one node only is the common case). Without the rule,
node A would wait for B in the rendezvous until its join timeout, or re-plan without B and train alone: a job
that quietly lost a node to a typo. Checked: both launchers exit 2 within a minute, node A's output carries B's
one-line error, and no launcher agreed on a plan (no ``plan`` event).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import elastic as bench

ROOT = Path(__file__).resolve().parents[1]


def test_config_error_on_one_node_stops_every_node_with_it(tmp_path):
    job = bench.Job(workdir=tmp_path, nodes=2, nproc=1, max_nodes=2, train_iters=4)
    cluster = bench.Cluster(job=job, port=bench.free_port(), rdzv_id="config-error")
    good = job.train_flags()
    bad = [t for t in good if t != "--mock-data"] + ["--data-path", str(tmp_path / "missing" / "corpus")]
    try:
        cluster.start_store()
        start = time.time()
        cluster.start_node("nodeA", good, nproc=1)
        cluster.start_node("nodeB", bad, nproc=1)
        codes = cluster.wait(120)
        elapsed = time.time() - start
    finally:
        cluster.close()
    logs = {n: (tmp_path / f"{n}.log").read_text() for n in ("nodeA", "nodeB")}
    assert codes == {"nodeA": 2, "nodeB": 2}, (codes, logs)
    error = next(line for line in logs["nodeB"].splitlines() if line.startswith("pretrain_gpt.py: error:"))
    assert "missing" in error, error
    assert error in logs["nodeA"], logs["nodeA"]  # A stops with B's own line
    events = [json.loads(line) for n in ("nodeA", "nodeB") if cluster.events_path(n).exists()
              for line in cluster.events_path(n).read_text().splitlines()]
    assert not [e for e in events if e["event"] in ("plan", "workers_started")], events
    assert elapsed < 60, elapsed


def test_config_error_in_the_ranks_stops_every_node_without_a_new_round(tmp_path):
    """The error found only once the ranks run: the --save directory (loaded by every round) holds a checkpoint of
    another model, which the ranks refuse to load with one line and exit code 2. Without the rule, the launchers
    would take the failed ranks for lost devices and re-plan on fewer. Checked: both launchers exit 2, the rank's
    line is printed, each node agreed on exactly one plan (no second round), and the error went through the store
    (a ``config_error`` event)."""
    job = bench.Job(workdir=tmp_path, nodes=2, nproc=1, max_nodes=2, train_iters=4)
    other = [*job.train_flags(), "--hidden-size", "16", "--train-iters", "1", "--lr-decay-iters", "1"]
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "pretrain_gpt.py"), *other], capture_output=True,
                          text=True, timeout=300, env=bench._env(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    cluster = bench.Cluster(job=job, port=bench.free_port(), rdzv_id="rank-config-error")
    try:
        cluster.start_store()
        for name in ("nodeA", "nodeB"):
            cluster.start_node(name, nproc=1)
        codes = cluster.wait(180)
    finally:
        cluster.close()
    logs = "".join((tmp_path / f"{n}.log").read_text() for n in ("nodeA", "nodeB"))
    assert codes == {"nodeA": 2, "nodeB": 2}, (codes, logs[-5000:])
    assert "the model configuration differs from the saved one" in logs, logs[-5000:]
    events = cluster.events()
    for name in ("nodeA", "nodeB"):
        assert [e["event"] for e in events if e["launcher"] == name].count("plan") == 1, events
    assert any(e["event"] == "config_error" for e in events), events


@pytest.mark.parametrize("flags, rule", [
    (["--nnodes", "3:1"], "--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got '3:1'"),
    (["--rdzv-endpoint", "nohost"], "--rdzv-endpoint must be HOST:PORT with a port in 1..65535, got 'nohost'"),
    (["--nproc-per-node", "0"], "--nproc-per-node must be >= 1 (this node's devices), got 0"),
    (["--rdzv-conf", "last_call_timeout"], "--rdzv-conf takes key=value pairs separated by commas"),
])
def test_bad_launcher_flags_are_one_line_and_exit_2(flags, rule):
    """Checked before any store is contacted (the endpoint below has nothing listening)."""
    base = {"--nnodes": "1:2", "--nproc-per-node": "1", "--rdzv-endpoint": "127.0.0.1:9"}
    base.update(dict(zip(flags[::2], flags[1::2])))
    argv = [token for pair in base.items() for token in pair]
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "elastic.py"), *argv, "--", "--mock-data"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr  # one line
    assert proc.stderr.startswith("launch/elastic.py: error: ") and rule in proc.stderr, proc.stderr

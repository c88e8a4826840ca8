"""--hetu-hang-timeout's step-progress watchdog (hetu_ext/runtime/watchdog.py), without a process group.

A rank stuck in a collective never returns to Python; only a thread that watches the time since the last step can
end it. Caught here: a watchdog that never fires (the rank would wait for the 10-minute collective timeout), one
that fires while the clock is paused (an unused rank of the plan waits at a barrier for the whole run and would
be killed as hung), and a negative timeout accepted instead of refused in one line.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from hetu_ext.runtime.watchdog import HANG_EXIT_CODE


def _run(body: str) -> subprocess.CompletedProcess:
    script = "import time\nfrom hetu_ext.runtime.watchdog import StepWatchdog\n" + body
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)


def test_no_step_for_the_timeout_exits_with_the_hang_code():
    proc = _run("w = StepWatchdog(0.5, rank=3)\nw.beat(7)\ntime.sleep(5)\nprint('not stopped')")
    assert proc.returncode == HANG_EXIT_CODE, (proc.returncode, proc.stderr)
    assert "not stopped" not in proc.stdout
    assert "rank 3 completed no step for 0.5 s after iteration 7 (--hetu-hang-timeout)" in proc.stderr


def test_the_clock_runs_only_between_steps():
    """Not started before the first step, paused while idle, stopped after the last step: no exit."""
    proc = _run("w = StepWatchdog(0.5, rank=0)\ntime.sleep(1.5)\nw.beat(1)\ntime.sleep(0.1)\nw.pause()\n"
                "time.sleep(1.5)\nw.beat(2)\nw.stop()\ntime.sleep(1.0)\nprint('done')")
    assert proc.returncode == 0 and proc.stdout.strip() == "done", (proc.returncode, proc.stderr)


def test_negative_timeout_is_refused_in_one_line():
    from hetu_ext.config import build_parser, parse_namespace
    from hetu_ext.cli.args import validate_args

    argv = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "8",
            "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-3",
            "--mock-data", "--hetu-hang-timeout", "-1"]
    with pytest.raises(ValueError, match=r"--hetu-hang-timeout must be >= 0 seconds .*got -1.0"):
        validate_args(parse_namespace(argv, build_parser()))

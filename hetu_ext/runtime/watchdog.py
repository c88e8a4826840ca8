"""A rank's step-progress watchdog (``--hetu-hang-timeout SECONDS``): a rank that completes no step for that long
exits, so its launcher sees a failed rank and the job is restarted (stdlib only, one daemon thread).

A rank stuck in a collective (a peer stopped, or a deadlock) never returns to Python to notice it, and the
collective timeout (``--distributed-timeout-minutes``, 10 minutes by default) is far longer than a step; a thread
that checks the time since the last completed step is not stuck with it. The clock starts at the first completed
step of the process (start-up, imports and a checkpoint load are not steps) and is paused while the rank is idle
in its plan (unused ranks wait at a barrier) and after the last step (final save and barrier). A stopped process
(SIGSTOP) runs no thread at all: its launcher finds it stopped (``agent.py``).
"""

from __future__ import annotations

import os
import sys
import threading
import time

HANG_EXIT_CODE = 3
"""The exit code of a rank whose watchdog fired (not 2: a hang is no configuration error, the job restarts)."""


class StepWatchdog:
    """Exits the process (``os._exit(HANG_EXIT_CODE)``, one line on stderr) when ``timeout_s`` pass with the clock
    running and no :meth:`beat`."""

    def __init__(self, timeout_s: float, *, rank: int, poll_s: float | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"--hetu-hang-timeout must be > 0 seconds (0 turns the watchdog off), got {timeout_s}")
        self.timeout_s, self.rank = timeout_s, rank
        self._last: float | None = None  # None: the clock is not running
        self._iteration = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._poll_s = poll_s if poll_s is not None else min(1.0, timeout_s / 10)
        self._thread = threading.Thread(target=self._watch, name="hetu-hang-watchdog", daemon=True)
        self._thread.start()

    def beat(self, iteration: int) -> None:
        """A step completed: restart the clock."""
        with self._lock:
            self._last, self._iteration = time.monotonic(), iteration

    def pause(self) -> None:
        """Stop the clock until the next :meth:`beat` (idle in the plan, final save)."""
        with self._lock:
            self._last = None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            with self._lock:
                late = self._last is not None and time.monotonic() - self._last > self.timeout_s
                iteration = self._iteration
            if late:
                print(f"hetu: rank {self.rank} completed no step for {self.timeout_s:g} s after iteration "
                      f"{iteration} (--hetu-hang-timeout): exiting with code {HANG_EXIT_CODE} so that the job "
                      f"restarts", file=sys.stderr, flush=True)
                os._exit(HANG_EXIT_CODE)

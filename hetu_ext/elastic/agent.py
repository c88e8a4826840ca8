"""torch's elastic agent, with one plan agreed over whatever survives (launch/elastic.py runs one per node).

Membership, rounds and restarts are torch's: ``LocalElasticAgent`` on a c10d ``DynamicRendezvousHandler``. A
failed rank anywhere makes its agent restart its workers and join the next rendezvous round; the other agents
join it when their own ranks fail in a collective, or when they see a node waiting (a spare, or a node that came
back). Three hooks add what torch's agent lacks:

* **rendezvous** (``_rendezvous``, ``_assign_worker_ranks``): before joining, the node counts its healthy
  devices; after joining, it publishes them in the round's store; group rank 0 computes the plan once
  (``NodeSettings.agree``: a Malleus plan, or data parallel for ``--launcher deepspeed``; entries.py) and
  publishes it; every node reads it, checks its own flags against it (a configuration error stops every node,
  below) and starts one rank per device the plan uses (``local_world_size`` changes from round to round; torch
  numbers the ranks node after node, as the plan does).
* **monitor** (``_monitor_workers``): a rank found stopped (SIGSTOP, process state T) for ``hang_timeout_s`` is
  killed and its device dropped; a rank that exits with a signal other than the agent's SIGTERM/SIGKILL lost its
  device (CPU emulation; with CUDA a probe decides, or ``--healthy-devices-cmd``); a rank that exits 2 is a
  configuration error.
* **configuration errors**: the node that meets one writes it to the store and closes the rendezvous; every
  other agent finds it in its next monitor tick (or gets ``RendezvousClosedError`` while joining), stops its
  ranks and exits 2 with that message. Nothing re-plans.

Events (JSON lines, ``events_path``): ``rendezvous_start``, ``rendezvous`` (round, group rank, nodes), ``plan``
(world, plan), ``workers_started``, ``failure`` (lost devices, exit codes), ``config_error``; each with ``time``
(wall clock) and the node name. ``benchmarks/elastic.py`` splits recovery time with them.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from torch.distributed import TCPStore
from torch.distributed.elastic.agent.server.api import (
    RunResult,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.rendezvous import RendezvousClosedError

from hetu_ext.plan import dump_plan
from hetu_ext.runtime.watchdog import HANG_EXIT_CODE

from .agreement import Agreement, NodeReport

logger = logging.getLogger(__name__)

CONFIG_ERROR = 2
"""pretrain_gpt.py's exit code for bad input: the same input fails on any number of ranks, so no restart."""
AGENT_SIGNALS = (signal.SIGTERM,)
"""The signal torch's agent stops the other ranks of a failed group with: a rank that died of it lost no device
(this agent's own SIGKILLs come after the failure is read, or are counted as hung ranks)."""


class ConfigurationError(Exception):
    """A configuration error on some node: the job stops everywhere with ``message`` and exit code 2."""


class NoHealthyDevice(Exception):
    """This node has no healthy device left: it leaves the job (the others go on without it)."""


@dataclass(kw_only=True)
class NodeSettings:
    """What one node's agent needs beyond torch's ``WorkerSpec``."""

    node: str
    """This node's name in messages and events (host and launcher pid)."""
    nproc_per_node: int
    """Devices (ranks) of this node when healthy."""
    round_argv: Callable[[str], list[str]]
    """``(plan_path) -> the program's flags`` for a round (launch/elastic.py's rewrite)."""
    agree: Callable[[list[NodeReport]], Agreement]
    """``(the round's node reports) -> the agreement`` (group rank 0 computes it; ValueError when none fits):
    a Malleus plan for hetu_ext's trainer, data parallel for DeepSpeed (entries.py)."""
    check_round: Callable[[list[str], int], None]
    """``(argv, world_size) -> None``: the program's launch check of a round's flags; ValueError/OSError."""
    plan_dir: Path
    """Where this node writes each round's agreed plan (YAML)."""
    store_endpoint: tuple[str, int]
    """The rendezvous store (host, port): configuration errors are published there, outside any round."""
    run_id: str
    prog: str = "pretrain_gpt.py"
    """The program the ranks run, in error lines."""
    healthy_devices_cmd: str | None = None
    hang_timeout_s: float = 0.0
    events_path: Path | None = None
    lost: set[int] = field(default_factory=set)
    """Devices this node lost so far (CPU emulation)."""


class HetuElasticAgent(LocalElasticAgent):
    """``LocalElasticAgent`` plus plan agreement, hang and configuration-error rules (module docstring)."""

    def __init__(self, spec: WorkerSpec, settings: NodeSettings, **kwargs) -> None:
        super().__init__(spec, **kwargs)
        self.settings = settings
        self.devices: tuple[int, ...] = tuple(range(settings.nproc_per_node))
        self.agreement: Agreement | None = None
        self._stopped_since: dict[int, float] = {}  # pid -> when first seen stopped
        self._round = 0
        host, port = settings.store_endpoint
        self._errors = TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=_timedelta(60))
        self._error_key = f"hetu_elastic/{settings.run_id}/config_error"

    # --- events -------------------------------------------------------------------------------------------------
    def event(self, name: str, **fields) -> None:
        record = {"time": round(time.time(), 3), "event": name, "node": self.settings.node, **fields}
        logger.info("elastic: %s", json.dumps(record))
        if self.settings.events_path is not None:
            with open(self.settings.events_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    # --- configuration errors -----------------------------------------------------------------------------------
    def published_error(self) -> str | None:
        if self._errors.check([self._error_key]):
            return self._errors.get(self._error_key).decode()
        return None

    def publish_error(self, message: str) -> ConfigurationError:
        """Tell every node (the store, then closing the rendezvous); the caller raises what this returns."""
        if not self._errors.check([self._error_key]):
            self._errors.set(self._error_key, f"{message} (on node {self.settings.node})")
        self.event("config_error", message=message)
        self._worker_group.spec.rdzv_handler.shutdown()
        return ConfigurationError(self.published_error())

    # --- rendezvous and plan agreement --------------------------------------------------------------------------
    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        try:
            self.devices = self._healthy_devices()
        except (ValueError, subprocess.CalledProcessError) as exc:  # a broken --healthy-devices-cmd
            raise self.publish_error(f"launch/elastic.py: error: {exc}") from None
        if not self.devices:
            raise NoHealthyDevice(f"node {self.settings.node} has no healthy device left; it leaves the job")
        if (message := self.published_error()) is not None:
            raise ConfigurationError(message)
        self.event("rendezvous_start", devices=list(self.devices))
        try:
            super()._rendezvous(worker_group)
        except RendezvousClosedError:
            if (message := self.published_error()) is not None:
                raise ConfigurationError(message) from None
            raise

    def _assign_worker_ranks(self, store, group_rank: int, group_world_size: int, spec: WorkerSpec):
        self.event("rendezvous", group_rank=group_rank, nodes=group_world_size)
        report = NodeReport(node=self.settings.node, devices=self.devices)
        store.set(f"hetu/node/{group_rank}", json.dumps({"node": report.node, "devices": list(report.devices)}))
        if group_rank == 0:  # computed once, read by all
            nodes = [NodeReport(**json.loads(raw)) for raw in
                     store.multi_get([f"hetu/node/{i}" for i in range(group_world_size)])]
            try:
                agreed = self.settings.agree(nodes).to_json()
            except ValueError as exc:
                agreed = json.dumps({"error": str(exc)})
            store.set("hetu/agreement", agreed)
        data = json.loads(store.get("hetu/agreement"))
        if "error" in data:
            raise self.publish_error(f"plan agreement: {data['error']}")
        agreement = Agreement.from_json(json.dumps(data))
        self.devices = agreement.nodes[group_rank].devices  # data parallel may leave some unused this round
        mine = agreement.node_ranks(group_rank)
        assert [agreement.ranks[r].device for r in mine] == list(self.devices), (mine, self.devices)
        self._round += 1
        plan_path = self.settings.plan_dir / f"elastic_plan_round{self._round}_node{group_rank}.yaml"
        plan_path.parent.mkdir(parents=True, exist_ok=True)
        plan_path.write_text(dump_plan(agreement.plan))
        argv = self.settings.round_argv(str(plan_path))
        try:
            self.settings.check_round(argv, agreement.plan.world_size)
        except (ValueError, OSError) as exc:
            raise self.publish_error(f"{self.settings.prog}: error: {exc}") from None
        self.agreement = agreement
        spec.local_world_size = len(self.devices)
        spec.args = (json.dumps(argv), ",".join(map(str, self.devices)), str(self.settings.plan_dir))
        self.event("plan", world=agreement.plan.world_size, ranks=mine, devices=list(self.devices),
                   plan=data["plan"])
        return super()._assign_worker_ranks(store, group_rank, group_world_size, spec)

    def _start_workers(self, worker_group: WorkerGroup):
        self._stopped_since.clear()
        ids = super()._start_workers(worker_group)
        self.event("workers_started", pids=list(ids.values()))
        return ids

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        """Kill every local rank at once (a stopped one never handles SIGTERM; torch would wait 30 s for it):
        the job resumes from a checkpoint, which a kill during a save never corrupts."""
        if self._pcontext is not None:
            for pid in self._pcontext.pids().values():
                _kill(pid)
        super()._stop_workers(worker_group)

    # --- monitoring ---------------------------------------------------------------------------------------------
    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        if (message := self.published_error()) is not None:
            raise ConfigurationError(message)
        hung = self._hung_ranks()
        for local_rank, pid in hung.items():
            _kill(pid)
        if hung:
            time.sleep(0.2)  # let the kill land before torch polls the ranks
        result = super()._monitor_workers(worker_group)
        if result.state not in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            return result
        codes = self._exit_codes(result)
        if CONFIG_ERROR in codes.values():
            raise self.publish_error(_config_message(self.settings.plan_dir, codes))
        lost = {r for r, code in codes.items() if code < 0 and -code not in AGENT_SIGNALS} | set(hung)
        self.settings.lost |= {self.devices[r] for r in lost}
        self.event("failure", exit_codes={str(r): c for r, c in sorted(codes.items())},
                   hung_local_ranks=sorted(hung), lost_devices=sorted(self.devices[r] for r in lost),
                   watchdog=HANG_EXIT_CODE in codes.values())
        return result

    def _hung_ranks(self) -> dict[int, int]:
        """Local ranks stopped (process state T) for ``hang_timeout_s`` or longer, or stopped while a rank of the
        group has exited (torch would SIGTERM the stopped one and wait 30 s for it): local rank -> pid."""
        if not self.settings.hang_timeout_s or self._pcontext is None:
            return {}
        now, stopped, exited = time.monotonic(), {}, False
        for local_rank, pid in self._pcontext.pids().items():
            state = _process_state(pid)
            exited |= state in (None, "Z", "X")
            if state in ("T", "t"):
                stopped[local_rank] = pid
                self._stopped_since.setdefault(pid, now)
            else:
                self._stopped_since.pop(pid, None)
        return {r: pid for r, pid in stopped.items()
                if exited or now - self._stopped_since[pid] >= self.settings.hang_timeout_s}

    def _exit_codes(self, result: RunResult) -> dict[int, int]:
        """Local rank -> exit code of every rank that has exited (a negative code: killed by that signal)."""
        codes = {f.local_rank: f.exitcode for f in result.failures.values()}
        processes = getattr(getattr(self._pcontext, "_pc", None), "processes", None)  # torch mp's context
        for local_rank, process in enumerate(processes or ()):
            if process.exitcode is not None:
                codes.setdefault(local_rank, process.exitcode)
        return codes

    def _healthy_devices(self) -> tuple[int, ...]:
        settings = self.settings
        return healthy_devices(settings.healthy_devices_cmd, settings.nproc_per_node, settings.lost)


def healthy_devices(command: str | None, nproc_per_node: int, lost: set[int]) -> tuple[int, ...]:
    """A node's healthy devices now: ``command``'s output (JSON: a count, or a list of device indices), else a CUDA
    probe of each device in a fresh process, else (CPU emulation) every device less those ``lost`` so far."""
    if command:
        out = json.loads(subprocess.run(command, shell=True, check=True, capture_output=True, text=True).stdout)
        if isinstance(out, int) and not isinstance(out, bool) and out >= 0:
            return tuple(range(out))
        if isinstance(out, list) and all(isinstance(d, int) and d >= 0 for d in out):
            return tuple(out)
        raise ValueError(f"--healthy-devices-cmd {command!r} printed {out!r}; it must print a count or a JSON list of "
                         f"device indices, e.g. 8 or [0, 1, 3]")
    import torch

    if torch.cuda.is_available():
        probe = "import torch,sys; torch.zeros(1, device=f'cuda:{sys.argv[1]}'); torch.cuda.synchronize()"
        procs = {d: subprocess.Popen([sys.executable, "-c", probe, str(d)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL) for d in range(nproc_per_node)}
        return tuple(d for d, p in procs.items() if p.wait() == 0)
    return tuple(d for d in range(nproc_per_node) if d not in lost)


def _process_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _config_message(report_dir: Path, codes: dict[int, int]) -> str:
    ranks = sorted(r for r, c in codes.items() if c == CONFIG_ERROR)
    for r in ranks:
        path = report_dir / f"config_error_local{r}.txt"
        if path.exists():
            return path.read_text().strip()
    return f"local rank(s) {ranks} exited with code 2 (a configuration error); the message is above on rank 0"


def _timedelta(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)

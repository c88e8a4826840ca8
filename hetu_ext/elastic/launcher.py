"""``launch/elastic.py --nnodes MIN:MAX ...``: one node's launcher of a multi-node elastic job (docs/elastic.md).

Builds torch's c10d rendezvous handler and a :class:`~hetu_ext.elastic.agent.HetuElasticAgent`, whose ranks are
forked from a forkserver that imported torch and Megatron-core once, and DeepSpeed with ``--launcher deepspeed``
(a restart starts its ranks in well under a second of imports). ``--launcher`` picks what the ranks run
(entries.py). ``launch/elastic.py --launcher deepspeed`` with no ``--rdzv-endpoint`` comes here as one node with
its own store on a free loopback port. Exit codes: 0 done, 2 a configuration error on any node (one ``error:``
line), 1 otherwise (restarts exhausted, no healthy device on this node, no quorum).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import socket
import sys
import time
from pathlib import Path

RDZV_DEFAULTS = {"join_timeout": "600", "last_call_timeout": "2", "keep_alive_interval": "1",
                 "keep_alive_max_attempt": "3", "close_timeout": "10"}
"""torch's c10d rendezvous settings this launcher changes (seconds; ``--rdzv-conf`` overrides them): a dead node
leaves the rendezvous after keep_alive_interval x keep_alive_max_attempt = 3 s without heartbeats (torch: 15 s),
and a round closes 2 s after its minimum of nodes joined (torch: 30 s), the time a late node has to join it."""


class _OneLineParser(argparse.ArgumentParser):
    """Bad launcher flags are one ``error:`` line and exit code 2, as pretrain_gpt.py's."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="launch/elastic.py", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launcher", choices=("hetu", "deepspeed"), default="hetu",
                        help="what each rank runs: hetu (launch/pretrain_gpt.py under a Malleus plan agreed per "
                             "round) or deepspeed (launch/pretrain_gpt_deepspeed.py, data parallel over the healthy "
                             "devices, its checkpoint loaded at the new world size)")
    parser.add_argument("--nnodes", default="1", help="MIN:MAX nodes (or N), as torchrun's")
    parser.add_argument("--nproc-per-node", type=int, help="devices (ranks) of this node when healthy")
    parser.add_argument("--rdzv-endpoint", required=True, help="HOST:PORT of the rendezvous store")
    parser.add_argument("--rdzv-id", default="hetu", help="the job's name in the store (one per job)")
    parser.add_argument("--rdzv-conf", default="", help="torch's c10d rendezvous settings, k=v,k=v")
    parser.add_argument("--max-restarts", type=int, default=3, help="failures this node restarts after "
                        "(membership changes, e.g. a spare node joining, are not counted)")
    parser.add_argument("--monitor-interval", type=float, default=0.5, help="seconds between checks of the ranks")
    parser.add_argument("--healthy-devices-cmd", default=None,
                        help="prints this node's healthy devices as JSON: a count, or a list of device indices")
    parser.add_argument("--events", default=None, help="append this node's events (JSON lines) to this file")
    parser.add_argument("--serve-store", action="store_true",
                        help="only serve the rendezvous store at --rdzv-endpoint (on a node that trains nothing), "
                             "until killed")
    parser.add_argument("train_args", nargs=argparse.REMAINDER,
                        help="-- then the flags of pretrain_gpt.py (or pretrain_gpt_deepspeed.py)")
    return parser


def _endpoint(parser: argparse.ArgumentParser, text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        parser.error(f"--rdzv-endpoint must be HOST:PORT with a port in 1..65535, got {text!r}")
    return host, int(port)


def _nnodes(parser: argparse.ArgumentParser, text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        low, high = int(lo), int(hi or lo)
    except ValueError:
        low = high = 0
    if not 1 <= low <= high:
        parser.error(f"--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return low, high


def serve_store(host: str, port: int) -> int:
    """The rendezvous store alone (torch's TCPStore server), so that losing any training node keeps it."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    print(f"elastic: serving the rendezvous store at {host}:{port}", file=sys.stderr, flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        del store


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    host, port = _endpoint(parser, args.rdzv_endpoint)
    if args.serve_store:
        return serve_store(host, port)
    low, high = _nnodes(parser, args.nnodes)
    if not args.nproc_per_node or args.nproc_per_node < 1:
        parser.error(f"--nproc-per-node must be >= 1 (this node's devices), got {args.nproc_per_node}")
    conf = _rdzv_conf(parser, args.rdzv_conf)
    _configure_process()
    agent, handler, entry, message = _build_agent(args, (host, port), (low, high), conf)
    if message is not None:  # bad flags on this node: every node stops with this line
        agent.publish_error(message)
        print(message, file=sys.stderr, flush=True)
        return 2
    multiprocessing.set_forkserver_preload(list(entry.preload))
    from multiprocessing import forkserver

    forkserver.ensure_running()  # its imports overlap the rendezvous (a spare node joins seconds sooner)
    return _run(agent, handler, args)


def _rdzv_conf(parser: argparse.ArgumentParser, text: str) -> dict[str, str]:
    """The rendezvous settings: the defaults, then ``--rdzv-conf``'s ``key=value`` pairs."""
    conf = dict(RDZV_DEFAULTS)
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--rdzv-conf takes key=value pairs separated by commas, got {item!r}")
        conf[key] = value
    return conf


def _configure_process() -> None:
    """The launcher's logging and the environment its workers inherit (before torch's elastic modules load)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    for name in ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.WARNING)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # each round's ranks get a fresh store on the new rank 0's node, not the one the first rank-0 agent shared:
    # its keys from the previous round (a dead rank's address) made the next round's gloo mesh fail
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"


def _build_agent(args: argparse.Namespace, store: tuple[str, int], nodes: tuple[int, int], conf: dict[str, str]):
    """(agent, rendezvous handler, entry, message): this node's agent for ``--launcher``'s entry; ``message`` is the
    one-line error of this node's training flags (None when they check), for the agent to publish to every node."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from .agent import HetuElasticAgent, NodeSettings
    from .entries import ENTRIES

    entry = ENTRIES[args.launcher]
    if entry.name == "deepspeed":
        import torch

        if not torch.cuda.is_available():  # before the forkserver imports DeepSpeed (it picks its accelerator then)
            os.environ.setdefault("DS_ACCELERATOR", "cpu")

    train = [a for a in args.train_args if a != "--"]
    handler = get_rendezvous_handler(RendezvousParameters(
        backend="c10d", endpoint=args.rdzv_endpoint, run_id=args.rdzv_id, min_nodes=nodes[0], max_nodes=nodes[1],
        **conf))
    node = f"{socket.gethostname()}:{os.getpid()}"
    try:
        save, hang_timeout = entry.check_flags(train)
        message = None
    except (ValueError, OSError) as exc:  # published by the caller, once the agent can reach the store
        save, hang_timeout, message = ".", 0.0, f"{entry.prog}: error: {exc}"
    settings = NodeSettings(
        node=node, nproc_per_node=args.nproc_per_node,
        round_argv=lambda plan_path: entry.round_argv(train, plan_path),
        agree=lambda nodes: entry.agree(train, nodes), check_round=entry.check_round, prog=entry.prog,
        plan_dir=Path(save) / "elastic" / node.replace(":", "_"), store_endpoint=store, run_id=args.rdzv_id,
        healthy_devices_cmd=args.healthy_devices_cmd, hang_timeout_s=hang_timeout,
        events_path=Path(args.events) if args.events else None)
    spec = WorkerSpec(role="trainer", local_world_size=args.nproc_per_node, entrypoint=entry.worker,
                      args=("[]", "", ""), rdzv_handler=handler, max_restarts=args.max_restarts,
                      monitor_interval=args.monitor_interval)
    agent = HetuElasticAgent(spec, settings, logs_specs=DefaultLogsSpecs(), start_method="forkserver",
                             exit_barrier_timeout=300)
    return agent, handler, entry, message


def _run(agent, handler, args: argparse.Namespace) -> int:
    """Run this node's agent to the job's end: 0, or 1 / 2 with one line saying why it stopped."""
    from torch.distributed.elastic.rendezvous import RendezvousClosedError

    from .agent import ConfigurationError, NoHealthyDevice

    try:
        result = agent.run()
    except ConfigurationError as exc:
        print(f"elastic: stopped, {exc}", file=sys.stderr, flush=True)
        return 2
    except RendezvousClosedError:
        print(f"elastic: the rendezvous of job {args.rdzv_id!r} is closed: the job finished or stopped before this "
              f"node joined", file=sys.stderr, flush=True)
        return 1
    except NoHealthyDevice as exc:
        print(f"elastic: {exc}", file=sys.stderr, flush=True)
        return 1
    if result.is_failed():
        print(f"elastic: giving up on this node after {args.max_restarts} restarts", file=sys.stderr, flush=True)
        return 1
    handler.shutdown()
    return 0

"""Hand a Megatron-LM command line to hetu_ext's trainer: what Megatron-LM's uniform grid cannot hold.

A heterogeneous plan (``--hetu-plan``: pipelines of different shapes, uneven stages, idle ranks), online
re-planning (``--hetu-straggler-replan online``), scheduled migrations (``--hetu-migrate``) and packed THD
microbatches (``--hetu-packing``) run in hetu_ext's trainer (:mod:`hetu_ext.cli.train`, the one behind
``launch/pretrain_gpt.py``). Its flags are Megatron-LM's names, so the user's command line is handed over as it
is, checked here before any process group:

* Megatron-LM flags the trainer implements (its schema's, or what it always does) and flags that only pick a
  kernel, a fusion or a memory/performance knob are passed on: the trainer takes the latter off and lists them in
  ONE notice on rank 0 (:mod:`hetu_ext.config.megatron_flags` holds the classification, as data);
* a flag that changes the numbers and is not built (MoE, context parallelism > 1, ...) or that the trainer does
  not know is refused by name (one line, exit code 2), never silently ignored.
"""

from __future__ import annotations

import os

from hetu_ext.config import build_parser, report_error
from hetu_ext.config.megatron_flags import take_megatron_flags

from .flags import PROG, Invocation, handoff_reasons


def translate(inv: Invocation) -> list[str]:
    """The argv for hetu_ext's trainer; ValueError naming the first Megatron-LM flag it cannot honour."""
    parser = build_parser()
    known = {s for a in parser._actions for s in a.option_strings}
    why = handoff_reasons(inv.hetu, inv.megatron)[0]
    taken = take_megatron_flags(inv.megatron_argv, known)
    if taken.refused:
        given, reason = taken.refused[0]
        raise ValueError(f"{given} cannot go with {why}: {reason}")
    for token in taken.argv:
        flag = token.partition("=")[0]
        if flag.startswith("--") and flag not in known:
            raise ValueError(f"{flag} is not supported by hetu_ext's trainer, which runs {why} (Megatron-LM's grid "
                             f"cannot hold it); drop {flag}, or drop {why.split()[0]} to train on Megatron-LM's "
                             "grid")
    # the trainer takes the accepted and implied flags off itself and prints the one notice
    return inv.megatron_argv + inv.hetu_argv


def run_handoff(inv: Invocation) -> int:
    try:
        argv = translate(inv)
    except ValueError as exc:
        report_error(PROG, str(exc))
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        for note in inv.notes:  # the CPU rehearsal's --transformer-impl local
            print(f"{PROG}: {note}", flush=True)
    from hetu_ext.cli.train import main as hetu_main

    return hetu_main(argv)

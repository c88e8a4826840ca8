"""Hand a Megatron-LM command line to hetu_ext's trainer: what Megatron-LM's uniform grid cannot hold.

A heterogeneous plan (``--hetu-plan``: pipelines of different shapes, uneven stages, idle ranks), online
re-planning (``--hetu-straggler-replan online``), scheduled migrations (``--hetu-migrate``) and packed THD
microbatches (``--hetu-packing``) run in hetu_ext's trainer (:mod:`hetu_ext.cli.train`, the one behind
``launch/pretrain_gpt.py``). Its flags are Megatron-LM's names, so the user's command line is handed over as it
is, with two adjustments made here, before any process group:

* Megatron-LM flags that only select what hetu_ext's trainer does anyway (:data:`IMPLIED`: the local transformer
  implementation, no fused kernels, per-token loss, CPU initialisation, no evaluation) are dropped;
* any other Megatron-LM flag the trainer does not take is refused by name (one line, exit code 2), never silently
  ignored.
"""

from __future__ import annotations

from hetu_ext.config import build_parser, report_error

from .flags import PROG, Invocation, handoff_reasons

IMPLIED: dict[str, object] = {
    "--transformer-impl": "local",
    "--no-gradient-accumulation-fusion": None,
    "--no-persist-layer-norm": None,
    "--no-masked-softmax-fusion": None,
    "--no-bias-gelu-fusion": None,
    "--no-bias-dropout-fusion": None,
    "--calculate-per-token-loss": None,
    "--use-cpu-initialization": None,
    "--no-rope-fusion": None,
    "--no-bias-swiglu-fusion": None,
    "--eval-iters": "0",
    "--eval-interval": "*",
}
"""Megatron-LM flag -> the value hetu_ext's trainer implies (None: a switch; ``*``: any value). Dropped when given
with that value; with another value refused."""


def translate(inv: Invocation) -> list[str]:
    """The argv for hetu_ext's trainer; ValueError naming the first Megatron-LM flag it cannot honour."""
    known = {s for a in build_parser()._actions for s in a.option_strings}
    why = handoff_reasons(inv.hetu, inv.megatron)[0]
    out, argv, i = [], inv.megatron_argv, 0
    while i < len(argv):
        token = argv[i]
        flag, eq, inline = token.partition("=")
        if flag in IMPLIED:
            implied = IMPLIED[flag]
            if implied is not None:
                value = inline if eq else (argv[i + 1] if i + 1 < len(argv) else "")
                i += 0 if eq else 1
                if implied != "*" and value != implied:
                    raise ValueError(f"{flag} {value} is not supported by hetu_ext's trainer, which runs {why} "
                                     f"(it implies {flag} {implied}); drop the flag, or drop {why.split()[0]} to "
                                     "train on Megatron-LM's grid")
            i += 1
            continue
        if flag.startswith("--") and flag not in known:
            raise ValueError(f"{flag} is not supported by hetu_ext's trainer, which runs {why} (Megatron-LM's grid "
                             f"cannot hold it); drop {flag}, or drop {why.split()[0]} to train on Megatron-LM's "
                             "grid")
        out.append(token)
        i += 1
    return out + inv.hetu_argv


def run_handoff(inv: Invocation) -> int:
    try:
        argv = translate(inv)
    except ValueError as exc:
        report_error(PROG, str(exc))
        return 2
    from hetu_ext.cli.train import main as hetu_main

    return hetu_main(argv)

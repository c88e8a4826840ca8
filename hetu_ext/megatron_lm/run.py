"""Run a Megatron-LM script in this process, after the patches and hooks its ``--hetu-*`` flags ask for.

Order: check the flags (no import of Megatron yet; bad input is one line and exit code 2); hand a run that
Megatron-LM's grid cannot hold to hetu_ext's trainer (:mod:`.handoff`); else append the checkout to the END of
``sys.path`` (pip's megatron-core stays the ``megatron.core`` imported; the checkout adds ``megatron.training``
and the script's own modules), apply Megatron-core's and Megatron-LM's CPU patches when there is no CUDA device,
check every patch point the run uses (a checkout of another tag is refused naming the symbol and the tested tag),
apply the feature hooks, and run the script as ``__main__`` (``runpy``; the script's ``if __name__ ==
"__main__"`` block runs, and spawned helper processes, such as Megatron-LM's async save, re-import it as the main
module). No file of the checkout is modified; at exit every patch is removed again.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys

from hetu_ext.checkpoint.manifest import CheckpointError
from hetu_ext.config import report_error
from hetu_ext.config.megatron_flags import flag_value
from hetu_ext.errors import HetuExtError

from .flags import PROG, Invocation, parse_invocation

logger = logging.getLogger(__name__)

SCRIPT_ENV = "HETU_MEGATRON_LM_SCRIPT"
"""The script's path, for the processes it spawns (:mod:`.spawn_main`)."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        inv = parse_invocation(argv)
    except ValueError as exc:
        report_error(PROG, str(exc))
        return 2
    if inv.mode == "handoff":
        from .handoff import run_handoff

        return run_handoff(inv)
    single_rank_env()
    try:
        patch_sets = prepare(inv)
    except (HetuExtError, ValueError) as exc:
        report_error(PROG, str(exc))
        return 2
    try:
        return run_script(inv)
    finally:
        for patch_set in reversed(patch_sets):
            patch_set.remove()


def single_rank_env() -> None:
    """Without torchrun: one rank in this process, with the environment torchrun would give it."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})


def prepare(inv: Invocation) -> list:
    """Everything before the script runs; returns the applied patch sets (removed by the caller)."""
    from hetu_ext.hostlog import quiet_host_frameworks

    quiet_host_frameworks()
    checkout = str(inv.checkout)
    if checkout not in sys.path:
        sys.path.append(checkout)
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # megatron's unfused paths would torch.compile on CPU
    from hetu_ext.megatron.norms import local_norm_patches
    from hetu_ext.patches.base import PatchError, PatchSet
    from hetu_ext.patches.megatron_lm import (
        TESTED_TAG,
        check_patch_points,
        import_without_triton,
        megatron_lm_cpu_patches,
    )

    cpu = inv.cpu
    applied = []
    try:
        if cpu:
            os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # Megatron-LM asserts it for TP
            from hetu_ext.megatron.host import enable_cpu_support

            enable_cpu_support(True)
            import_without_triton()
        check_patch_points()
        sets = [megatron_lm_cpu_patches()] if cpu else []
        if cpu or flag_value(inv.megatron_argv, "--transformer-impl") == "local":
            sets.append(local_norm_patches())
        sets.append(spawn_patches(inv))
        hooks = feature_hooks(inv)
        if hooks:
            sets.append(PatchSet("megatron-lm-hooks", hooks))
        for patch_set in sets:
            patch_set.apply()
            applied.append(patch_set)
    except PatchError as exc:
        for patch_set in reversed(applied):
            patch_set.remove()
        if TESTED_TAG in str(exc):
            raise
        raise PatchError(f"{exc} (hetu_ext's Megatron-LM hooks are tested with tag {TESTED_TAG})") from exc
    if int(os.environ.get("RANK", "0")) == 0:
        for note in inv.notes:
            print(f"{PROG}: {note}", flush=True)
        names = [p.name for s in applied for p in s.patches]
        print(f"{PROG}: {len(names)} patches and hooks on Megatron-LM {TESTED_TAG} at {inv.checkout} "
              f"({'CPU' if cpu else 'CUDA'})", flush=True)
    return applied


def spawn_patches(inv: Invocation):
    """Processes the script spawns re-run it through :mod:`.spawn_main` (the script as a path would import
    Megatron-LM's training package without the parent's import-time stand-ins)."""
    from hetu_ext.patches.base import Patch, PatchSet

    def make(original):
        def get_preparation_data(name):
            data = original(name)
            if data.get("init_main_from_path") == str(inv.script):
                del data["init_main_from_path"]
                data["init_main_from_name"] = "hetu_ext.megatron_lm.spawn_main"
            return data

        return get_preparation_data

    os.environ[SCRIPT_ENV] = str(inv.script)
    return PatchSet("megatron-lm-spawn", [
        Patch(name="spawn_main:get_preparation_data", target="multiprocessing.spawn:get_preparation_data",
              make=make, reason="a spawned child re-runs the script, whose imports need the parent's stand-ins")])


def feature_hooks(inv: Invocation) -> list:
    """The hooks the flags ask for (only those)."""
    hooks = []
    if inv.hetu_checkpoints:
        from .checkpoint import HetuCheckpoints

        ns = inv.hetu
        hooks += HetuCheckpoints(keep=ns.hetu_ckpt_keep, fallback=ns.hetu_ckpt_fallback,
                                 read=ns.hetu_ckpt_read, packing=ns.hetu_packing).patches()
    if inv.weighting:
        from hetu_ext.plan.malleus.straggler_policy import StragglerPolicy

        from .weighting import StragglerWeighting

        ns = inv.hetu
        policy = StragglerPolicy(threshold=ns.hetu_straggler_threshold, min_change=ns.hetu_straggler_min_change,
                                 window=ns.hetu_straggler_window)
        hooks += StragglerWeighting(interval=ns.hetu_straggler_interval, policy=policy,
                                    emulate=ns.hetu_emulate_slowdown, layer_ms=ns.hetu_emulate_layer_ms).patches()
    if inv.hetu.hetu_packing != "off":
        from hetu_ext.config import PackingConfig

        from .packing import MegatronLMPacking

        ns = inv.hetu
        config = PackingConfig(method=ns.hetu_packing, global_batch_tokens=ns.hetu_global_batch_tokens,
                               cost_model=ns.hetu_cost_model, varlen_mock=ns.hetu_varlen_mock,
                               mock_documents=ns.hetu_mock_documents)
        hooks += MegatronLMPacking(config).patches()
    return hooks


def run_script(inv: Invocation) -> int:
    """The script as ``__main__`` with Megatron-LM's argv; its exit code (SystemExit) is ours."""
    import torch.distributed as dist

    saved = sys.argv
    sys.argv = [str(inv.script), *inv.megatron_argv]
    try:
        runpy.run_path(str(inv.script), run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except CheckpointError as exc:  # every rank agreed on it (checkpoint.load): one line, on rank 0
        report_error(PROG, str(exc))
        code = 2
    finally:
        sys.argv = saved
    if dist.is_initialized():
        dist.destroy_process_group()  # gloo may abort at interpreter exit otherwise
    return code

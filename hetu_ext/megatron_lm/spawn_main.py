"""The main module of a process that Megatron-LM's script spawns (``multiprocessing``'s spawn start method: the
torch_dist saver's Manager, data-loader workers), when the script runs under ``-m hetu_ext.megatron_lm``.

A spawned child re-runs the parent's main module as ``__mp_main__`` so that the script's functions unpickle. Run
bare, the script imports Megatron-LM's training package, which imports ``triton`` at module level: on a machine
without triton the child dies before it starts. The parent (:func:`.run.spawn_patches`) names this module instead;
it gives the script the same import-time stand-in as the parent (:func:`hetu_ext.patches.megatron_lm.
import_without_triton`) and then runs it, its ``__main__`` block skipped, exactly as spawn would.
"""

import os
import runpy

import hetu_ext.megatron  # noqa: F401 (megatron.core below is imported as the parent imported it)
import megatron.core  # noqa: F401 (before the stand-in, as in the parent)

from hetu_ext.megatron_lm.run import SCRIPT_ENV
from hetu_ext.patches.megatron_lm import import_without_triton

import_without_triton()
globals().update({k: v for k, v in runpy.run_path(os.environ[SCRIPT_ENV], run_name="__mp_main__").items()
                  if not k.startswith("__")})

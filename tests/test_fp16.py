"""``--fp16`` with loss scaling (Megatron-LM's examples/gpt3 recipe, issue 45).

On Megatron-LM's own loop (``-m hetu_ext.megatron_lm``, 2 CPU ranks, DP 2) ``--fp16`` runs natively (Megatron-core's
``Float16OptimizerWithFloat16Params`` and ``DynamicGradScaler``, patched onto the CPU); what hetu_ext adds there is
the hetu checkpoint: the loss scaler's state (scale, growth and hysteresis trackers) is saved and restored, so a
resume equals the uninterrupted run bit for bit. The test grows the scale every step (``--loss-scale-window 1``)
from a small ``--initial-loss-scale``, so a resume that restarted the scaler would print another loss scale (and,
once it overflows, skip other steps); the losses are compared as printed (Megatron-LM's 7 significant digits, same
grid and RNG states restored: equal, not close).

The DeepSpeed path refuses ``--fp16`` by name (checked here); hetu_ext's trainer (``launch/pretrain_gpt.py``, the
hand-off) trains it with the same scaler and the same checkpoint record: tests/test_trainer_fp16.py.
"""

from __future__ import annotations

import re

import pytest
from test_megatron_lm import COMMON, needs_checkout, step_losses, torchrun

SCALE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?loss scale: ([0-9.E+-]+) \|.*?number of skipped iterations:"
                   r"\s*(\d+)")
FP16 = ["--fp16", "--initial-loss-scale", "256", "--loss-scale-window", "1", "--hysteresis", "1",
        "--calculate-per-token-loss", "--hetu-ckpt-format", "hetu"]


def scales(log: str) -> dict[int, tuple[float, int]]:
    """Iteration -> (loss scale, skipped iterations) from Megatron-LM's log lines (log interval 1)."""
    return {int(i): (float(s), int(k)) for i, s, k in SCALE.findall(log)}


@needs_checkout
def test_fp16_megatron_lm_hetu_checkpoint_resumes_loss_scale(tmp_path):
    """The uninterrupted fp16 run saves at iteration 3; the run resumed from it prints iterations 4-6 as the first
    did: the same losses, loss scales and skipped counts. Catches a loss scaler left out of the hetu checkpoint
    (the resume prints --initial-loss-scale again)."""
    full = torchrun(tmp_path, *COMMON, *FP16, "--save", str(tmp_path / "ckpt"), "--save-interval", "3")
    log = full.stdout + full.stderr
    want, want_scales = step_losses(log), scales(log)
    assert sorted(want_scales) == [1, 2, 3, 4, 5, 6], log[-3000:]
    assert want_scales[4][0] != 256.0, want_scales  # the scale moved before the save: the test can fail
    resumed = torchrun(tmp_path, *COMMON, *FP16, "--load", str(tmp_path / "ckpt"), "--ckpt-step", "3")
    out = resumed.stdout + resumed.stderr
    assert "loaded hetu checkpoint" in out, out[-3000:]
    got, got_scales = step_losses(out), scales(out)
    assert sorted(got_scales) == [4, 5, 6], out[-3000:]
    assert {i: got_scales[i] for i in (4, 5, 6)} == {i: want_scales[i] for i in (4, 5, 6)}
    later = sorted(i for i in want if i >= 4)  # a skipped iteration prints no loss
    assert sorted(got) == later and later, (got, want)
    assert {i: got[i] for i in later} == {i: want[i] for i in later}


def test_fp16_refused_by_name_on_the_deepspeed_path(capsys):
    """launch/pretrain_gpt_deepspeed.py does not map Megatron-LM's loss scaling to DeepSpeed's fp16 config: --fp16
    is refused with its reason (one line, exit 2), not as an unrecognized argument."""
    from hetu_ext.cli.deepspeed import main

    with pytest.raises(SystemExit) as exc:
        main(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
              "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "1", "--lr", "1e-3",
              "--mock-data", "--fp16"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--fp16 is not supported on the DeepSpeed path" in err[-1], err


def test_fp16_scaler_state_round_trips_through_json():
    """The record the hetu checkpoint keeps (:func:`scaler_state`) restores Megatron-core's DynamicGradScaler
    exactly (scale, growth and hysteresis trackers), for each part of a ChainedOptimizer; a record of another
    number of scalers is refused, and a run without --fp16 has nothing to save. Catches a scale rounded on its way
    through JSON and trackers left at their initial values."""
    import json
    from types import SimpleNamespace

    import torch

    from hetu_ext.checkpoint import CheckpointError
    from hetu_ext.megatron import state as ckpt

    from hetu_ext.megatron.host import enable_cpu_support

    enable_cpu_support()  # on CPU: DynamicGradScaler.load_state_dict moves the scale with .cuda()
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    def scaler(initial: float) -> DynamicGradScaler:
        s = DynamicGradScaler.__new__(DynamicGradScaler)  # its __init__ makes the scale on CUDA
        s._scale, s.min_scale, s.growth_factor, s.backoff_factor = torch.tensor([initial]), 1.0, 2.0, 0.5
        s.growth_interval, s.hysteresis, s._growth_tracker, s._hysteresis_tracker = 3, 2, 0, 2
        return s

    saved = SimpleNamespace(chained_optimizers=[SimpleNamespace(grad_scaler=scaler(2.0**32 * 0.75)),
                                                SimpleNamespace(grad_scaler=scaler(3.0))])
    for found_inf in (False, True, False):
        saved.chained_optimizers[0].grad_scaler.update(found_inf)
    record = json.loads(json.dumps(ckpt.scaler_state(saved)))
    fresh = SimpleNamespace(chained_optimizers=[SimpleNamespace(grad_scaler=scaler(1.0)),
                                                SimpleNamespace(grad_scaler=scaler(1.0))])
    ckpt.restore_scaler_state(fresh, record, "test")
    for a, b in zip(saved.chained_optimizers, fresh.chained_optimizers):
        assert a.grad_scaler.scale.item() == b.grad_scaler.scale.item()
        assert a.grad_scaler.state_dict()["growth_tracker"] == b.grad_scaler.state_dict()["growth_tracker"]
        assert a.grad_scaler.state_dict()["hysteresis_tracker"] == b.grad_scaler.state_dict()["hysteresis_tracker"]
    assert record[0]["hysteresis_tracker"] == 1 and record[0]["growth_tracker"] == 1
    with pytest.raises(CheckpointError, match="1 loss scaler state"):
        ckpt.restore_scaler_state(fresh, record[:1], "test")
    assert ckpt.scaler_state(SimpleNamespace(grad_scaler=None)) is None

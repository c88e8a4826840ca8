"""A hetu checkpoint of hetu_ext's Megatron trainer continues on DeepSpeed's engine, and the DeepSpeed engine's
hetu checkpoint (``--hetu-ckpt-format hetu``) continues on the Megatron trainer: 6 steps split 2 (Megatron, a
heterogeneous 3-rank plan: a TP2 pipeline and a TP1 one) + 2 (DeepSpeed ZeRO-3 on 2 ranks) + 2 (Megatron, PP2).

* Each hand-over moves bytes only: the state the next engine holds right after its load (weights, Adam's moments
  and step, iteration, LR schedule) equals the state the previous one saved, bit for bit.
* The 6 losses and the final weights match the uninterrupted single-process Megatron run within
  test_uniform_equivalence's tolerances (1e-6 relative, 2e-6 absolute): the engines sum gradients in other orders
  (test_ckpt_deepspeed: DeepSpeed's path trains like Megatron's to 1e-7). A lost moment, step, schedule or data
  position moves the step after a hand-over by > 1e-3 (test_checkpointing.py).
"""

from __future__ import annotations

import pytest
import torch
from test_ckpt_resume import SCHEDULE, _plan_argv
from test_ckpt_resume import _run as megatron_run
from test_deepspeed_resume import full_state
from helpers import ADAM_EPS
from helpers import LOSS_RTOL, WEIGHT_ATOL, gpt_argv

from hetu_ext.testing.multiproc import run_ranks


def ds_hetu_body(rank: int, world: int, argv: list[str], stage: int, load: str, save: str) -> dict | None:
    """DeepSpeed: load a hetu checkpoint, train, save in hetu's format (blocking); rank 0 reports."""
    from hetu_ext.config import from_namespace
    from hetu_ext.deepspeed import engine_state
    from hetu_ext.deepspeed.engine import ZeroConfig, add_deepspeed_args, build
    from hetu_ext.deepspeed.engine_save import HetuSaver
    from hetu_ext.cli.args import build_parser, validate_args

    args = add_deepspeed_args(build_parser()).parse_args(argv)
    validate_args(args)
    run = build(from_namespace(args), ZeroConfig(stage=stage))
    loaded = run.load(load)
    out = {"loaded": loaded, "after_load": full_state(run), "step": engine_state.optimizer_step(run.engine),
           "iteration": run.iteration, "scheduler": run.scheduler.state_dict()}
    out["losses"] = run.train()
    saver = HetuSaver(run, save, loaded_run_id=loaded.run_id, resumed_here=False)
    saver.save(blocking=True)
    out["final"] = full_state(run)
    out["final_scheduler"] = run.scheduler.state_dict()
    return out if rank == 0 else None


def _as_hetu(state: dict, gated: bool) -> dict:
    """DeepSpeed's full view (kind, parameter name) as hetu names and shapes; an fp32 run's masters are its
    ``param/``; a gated linear_fc1 gets its gate axis (hetu_ext/checkpoint/gated.py)."""
    from hetu_ext.checkpoint.gated import GATED_SUFFIXES, from_megatron
    from hetu_ext.deepspeed.zero_checkpoint import hetu_name

    out = {}
    for (kind, name), v in state.items():
        if kind != "param":
            key = hetu_name("param" if kind == "master" else kind, name)
            out[key] = from_megatron(v) if gated and key[0].endswith(GATED_SUFFIXES) else v
    return out


LLAMA = ("--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--group-query-attention",
         "--num-query-groups", "2", "--disable-bias-linear")
"""Llama-style: gated MLP (its linear_fc1 saved with the gate axis, (2, F, H), while DeepSpeed holds [gate; up]),
RMSNorm, RoPE, 2 query groups, no linear biases; with test_packed_training's Adam epsilon (ADAM_EPS: with 1e-8 an
element whose gradient is near epsilon turns last-bit differences of sums into weight differences; measured here
2.55e-6 on the weights after 6 steps, over the 2e-6 tolerance, with the 6 losses equal)."""


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_megatron_to_deepspeed_and_back(family, sample_prefix, tmp_path):
    model = (*LLAMA, "--adam-eps", ADAM_EPS) if family == "llama" else ()
    reference = megatron_run(1, gpt_argv(1, 1, sample_prefix, SCHEDULE[:2] + model + ("--lr-decay-iters", "6",
                                                                                 "--train-iters", "6")))["final"]
    schedule = model + ("--lr-decay-iters", "6")
    first, second = tmp_path / "megatron", tmp_path / "deepspeed"
    world, argv = _plan_argv("h3", sample_prefix, tmp_path, schedule + ("--train-iters", "2", "--save", str(first)))
    megatron = megatron_run(world, argv)["final"]
    ds_argv = gpt_argv(1, 1, sample_prefix, SCHEDULE[:2] + schedule + ("--train-iters", "4"))
    ds = run_ranks(ds_hetu_body, 2, ds_argv, 3, str(first), str(second), timeout=240)[0]
    assert (ds["loaded"].source, ds["loaded"].iteration, ds["loaded"].saved_world_size) == ("hetu", 2, 3)
    after = _as_hetu(ds["after_load"], bool(model))
    assert after.keys() == megatron["tensors"].keys()
    assert all(torch.equal(after[k], v) for k, v in megatron["tensors"].items())
    assert ds["step"] == 2.0 and ds["iteration"] == 2 and ds["scheduler"] == megatron["scheduler"]
    world, argv = _plan_argv("pp2", sample_prefix, tmp_path, schedule + ("--train-iters", "6", "--load", str(second)))
    back = megatron_run(world, argv)
    loaded, final = back["loaded"], back["final"]
    saved = _as_hetu(ds["final"], bool(model))
    assert loaded["tensors"].keys() == saved.keys()
    assert all(torch.equal(loaded["tensors"][k], v) for k, v in saved.items())
    assert loaded["steps"] == {4.0} and loaded["iteration"] == 4 and loaded["scheduler"] == ds["final_scheduler"]
    losses = final["losses"]
    assert losses[:2] == megatron["losses"] and losses[2:4] == ds["losses"][2:] and len(losses) == 6
    loss = max(abs(a - b) / abs(b) for a, b in zip(losses, reference["losses"]))
    weight = max(float((v - reference["tensors"][k]).abs().max()) for k, v in final["tensors"].items()
                 if k[0].startswith("param/"))
    print(f"{family}: Megatron h3 -> DeepSpeed ZeRO-3 x2 -> Megatron pp2 vs one process: loss rel diff {loss:.2e}, "
          f"weight abs diff {weight:.2e}")
    assert loss <= LOSS_RTOL and weight <= WEIGHT_ATOL

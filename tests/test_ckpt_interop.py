"""Megatron-core dist_checkpointing (torch_dist) checkpoints load into any plan with no offline step: a TP2 x PP2
checkpoint written by Megatron's own save (uniform runtime) is read tensor by tensor and resharded into
heterogeneous plans (plan runtime). Parameters, Adam moments and step, iteration, LR schedule and losses must
equal the saved ones bit for bit, and 2 more steps must match the uninterrupted single-process run within
test_uniform_equivalence's tolerances (other layout: other order of floating-point sums)."""

from __future__ import annotations

import pytest
import torch
from test_ckpt_resume import SCHEDULE, _assert_restored, _continuation_diffs, _plan_argv, _run
from helpers import LOSS_RTOL, WEIGHT_ATOL, gpt_argv

from hetu_ext.testing.multiproc import run_ranks


@pytest.fixture(scope="module")
def saved(sample_prefix, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torch_dist")
    argv = gpt_argv(2, 2, sample_prefix, SCHEDULE + ("--train-iters", "2", "--save", str(tmp / "ckpt"),
                                                  "--hetu-ckpt-format", "torch_dist"))
    state = _run(4, argv)["final"]
    assert (tmp / "ckpt" / "iter_0000002" / "metadata.json").exists()  # Megatron's format, not hetu's
    reference = _run(1, gpt_argv(1, 1, sample_prefix, SCHEDULE + ("--train-iters", "4")))["final"]
    return tmp / "ckpt", state, reference


@pytest.mark.parametrize("plan", ["h3", "idle"])
def test_dist_checkpointing_tp2pp2_into_a_heterogeneous_plan(plan, saved, sample_prefix, tmp_path):
    ckpt, state, reference = saved
    world, argv = _plan_argv(plan, sample_prefix, tmp_path, ("--train-iters", "4", "--load", str(ckpt)))
    result = _run(world, argv)
    loaded = result["loaded"]
    assert any(k[0].startswith("exp_avg/") for k in state["tensors"])
    _assert_restored(loaded, state["tensors"], state)
    final = result["final"]
    loss, weight = _continuation_diffs(final, reference)
    print(f"torch_dist tp2pp2->{plan}: loss rel diff {loss:.2e}, weight abs diff {weight:.2e}")
    assert len(final["losses"]) == 4 and loss <= LOSS_RTOL and weight <= WEIGHT_ATOL


def megatron_model_load_body(rank: int, world: int, argv: list[str], path: str) -> dict | None:
    """Megatron-core's own dist_checkpointing.load of the model weights (its ShardedTensors: the layers'
    ``_extra_state`` objects, empty for the local layer spec, are not exported), on Megatron's uniform runtime."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from test_ckpt_resume import _gather

    from hetu_ext.cli.args import parse_run_config
    from hetu_ext.megatron.state import state_pieces
    from hetu_ext.cli.train import build_run

    trainer = build_run(parse_run_config(argv))
    module = trainer.model.module
    tensors, _ = extract_matching_values(module.sharded_state_dict(), lambda v: isinstance(v, ShardedTensor))
    module.load_state_dict(dist_checkpointing.load(tensors, path), strict=False)
    params = _gather([p for p in state_pieces(trainer.placement) if p.key.startswith("param/")])
    return params if rank == 0 else None


def test_export_to_dist_checkpointing(sample_prefix, tmp_path):
    """A hetu checkpoint (TP2) exported with ``convert --to torch_dist``: Megatron-core's own loader reads its
    weights bit for bit into a TP1 x PP2 model, and the whole state (moments, step) loads through the
    resharding reader into a heterogeneous plan bit for bit."""
    from hetu_ext.checkpoint.cli import main

    ckpt, exported = tmp_path / "hetu", tmp_path / "exported"
    state = _run(2, gpt_argv(2, 1, sample_prefix, SCHEDULE + ("--train-iters", "2", "--save", str(ckpt))))["final"]
    assert main(["convert", str(ckpt), str(exported), "--to", "torch_dist"]) == 0
    argv = gpt_argv(1, 2, sample_prefix, SCHEDULE + ("--train-iters", "2"))
    params = next(r for r in run_ranks(megatron_model_load_body, 2, argv, str(exported / "iter_0000002"),
                                       timeout=180) if r is not None)
    want = {k: v for k, v in state["tensors"].items() if k[0].startswith("param/")}
    assert params.keys() == want.keys() and all(torch.equal(params[k], v) for k, v in want.items())
    world, argv = _plan_argv("h3", sample_prefix, tmp_path, ("--train-iters", "2", "--load", str(exported)))
    loaded = _run(world, argv)["loaded"]
    assert loaded["tensors"].keys() == state["tensors"].keys()
    assert all(torch.equal(loaded["tensors"][k], v) for k, v in state["tensors"].items())
    assert loaded["steps"] == {2.0}

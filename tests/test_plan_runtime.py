"""The gold test of the plan runtime: heterogeneous plans train exactly like one process.

Each of the 9 plans below runs K=3 Adam steps of Megatron-core's GPTModel on 4-6 gloo ranks (pretrain_gpt.py's code path,
``--hetu-plan``) on the same global batches as the 1x1x1 reference (8 samples: 4 microbatches of 2, split over
the pipelines as the plan says). Losses and the final gathered weights must match the reference with the
tolerances of test_uniform_equivalence (1e-6 relative on losses, 2e-6 absolute on weights): the plans change
only the order of floating-point sums, and gather_weights additionally requires every copy of an element on
every rank to be bit-identical. A gradient summed over the wrong ranks (an element reduced twice, a TP copy
counted as a replica, a tied output layer not added to its embedding) or a loss normalised per pipeline moves
step-2 losses by >1e-3.
"""

from __future__ import annotations

import pytest
from helpers import LOSS_RTOL, WEIGHT_ATOL, compare, gpt_argv

from hetu_ext.testing.multiproc import run_ranks
from hetu_ext.testing.plans import PLANS
from hetu_ext.cli.runs import train


@pytest.fixture(scope="module")
def reference(sample_prefix, one_process):
    return one_process(gpt_argv(1, 1, sample_prefix))


@pytest.fixture(scope="module")
def reference_untied(sample_prefix, one_process):
    return one_process(gpt_argv(1, 1, sample_prefix, ("--untie-embeddings-and-output-weights",)))


def _run(tmp_path, sample_prefix, name, world, text, extra=()):
    plan = tmp_path / f"{name}.yaml"
    plan.write_text(text)
    results = run_ranks(train, world, gpt_argv(1, 1, sample_prefix, ("--hetu-plan", str(plan), *extra)), timeout=240)
    return next(r for r in results if r is not None)


@pytest.mark.parametrize("name,world,covers,text", PLANS, ids=[p[0] for p in PLANS])
def test_heterogeneous_plan_matches_single_process(name, world, covers, text, reference, sample_prefix, tmp_path):
    result = _run(tmp_path, sample_prefix, name, world, text)
    loss_diff, weight_diff = compare(result, reference)
    print(f"{name} ({covers}): loss rel diff {loss_diff:.2e}, weight abs diff {weight_diff:.2e}")
    assert loss_diff <= LOSS_RTOL, (result["losses"], reference["losses"])
    assert weight_diff <= WEIGHT_ATOL


@pytest.mark.parametrize("name", ["microbatches_3_1", "tp_1_to_2_in_pipeline"])
def test_untied_output_layer_on_heterogeneous_plans(name, reference_untied, sample_prefix, tmp_path):
    """The output layer as its own tensor (--untie-embeddings-and-output-weights), held at other TP degrees."""
    _, world, _, text = next(p for p in PLANS if p[0] == name)
    result = _run(tmp_path, sample_prefix, name, world, text, ("--untie-embeddings-and-output-weights",))
    loss_diff, weight_diff = compare(result, reference_untied)
    assert loss_diff <= LOSS_RTOL and weight_diff <= WEIGHT_ATOL


def test_uniform_plan_on_the_plan_runtime_matches_megatrons_uniform_path(sample_prefix, tmp_path):
    """TP2 x DP2 as a Plan through the plan runtime against Megatron's parallel_state path, same flags."""
    megatron = run_ranks(train, 4, gpt_argv(2, 1, sample_prefix), timeout=180)[0]
    plan_rt = run_ranks(train, 4, gpt_argv(2, 1, sample_prefix, ("--hetu-runtime", "plan")), timeout=180)[0]
    loss_diff, weight_diff = compare(plan_rt, megatron)
    assert loss_diff <= LOSS_RTOL and weight_diff <= WEIGHT_ATOL


def test_a_malleus_plan_trains_like_single_process(reference, sample_prefix, tmp_path):
    """Planner to runtime: the plan Malleus makes around two stragglers (ranks 1 and 2 at 1.5x and 3x) on 4
    ranks, written by ``python -m hetu_ext.plan malleus``, trains exactly like one process."""
    from hetu_ext.plan import load_plan, uniform_shape
    from hetu_ext.plan.__main__ import main as plan_main

    path = tmp_path / "malleus.yaml"
    assert plan_main(["malleus", "--world-size", "4", "--gpus-per-node", "4", "--slowdown", "1=1.5",
                      "--slowdown", "2=3", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
                      "--ffn-hidden-size", "64", "--seq-length", "32", "--micro-batch-size", "2",
                      "--global-batch-size", "8", "--vocab-size", "257", "--output", str(path)]) == 0
    plan = load_plan(path)
    assert uniform_shape(plan) is None and plan.stage_of(2) is None  # the 3x straggler is left out
    results = run_ranks(train, 4, gpt_argv(1, 1, sample_prefix, ("--hetu-plan", str(path))), timeout=240)
    loss_diff, weight_diff = compare(next(r for r in results if r is not None), reference)
    assert loss_diff <= LOSS_RTOL and weight_diff <= WEIGHT_ATOL

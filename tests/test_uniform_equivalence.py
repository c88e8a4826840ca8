"""The main correctness test: every uniform TP x PP x DP layout trains like one process.

For each layout, K=3 Adam steps of Megatron-core's GPTModel (through pretrain_gpt.py's code path, on the shipped
text sample) must give the same per-step losses and the same final gathered weights as the 1x1x1 run on the same
global batches.

Tolerance (fp32): the layouts differ only in the order of floating-point sums (TP splits the matmul reductions
and all-reduces partial sums; DP all-reduces gradients; the per-token normalisation happens once either way), so
they agree to a few ulps per step. Measured here: losses within 5e-8 relative, weights within 3.3e-7 absolute
after 3 Adam steps of lr=1e-3. We allow 1e-6 relative on losses and 2e-6 absolute on weights (0.2% of one Adam
step). This is tight enough to catch real bugs: Megatron-core 0.16.1 built with perform_initialization=False
leaves TP-split weights unmarked, the grad norm then counts one TP shard, clipping differs and the weights move
1.4e-5 away (seen while writing this test); a missed or doubled all-reduce, or a loss averaged per rank instead
of per token, moves losses by >1e-3 at step 2.
"""

from __future__ import annotations

import pytest

from helpers import LOSS_RTOL, WEIGHT_ATOL, compare, gpt_argv

from hetu_ext.testing.multiproc import run_ranks
from hetu_ext.cli.runs import train

LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (1, 2, 2)]  # (TP, PP, DP)


@pytest.fixture(scope="module")
def reference(sample_prefix, one_process):
    return one_process(gpt_argv(1, 1, sample_prefix))


@pytest.mark.parametrize("tp,pp,dp", LAYOUTS, ids=[f"tp{t}pp{p}dp{d}" for t, p, d in LAYOUTS])
def test_uniform_layout_matches_single_process(tp, pp, dp, reference, sample_prefix):
    result = run_ranks(train, tp * pp * dp, gpt_argv(tp, pp, sample_prefix), timeout=180)[0]
    loss_diff, weight_diff = compare(result, reference)
    print(f"tp{tp}pp{pp}dp{dp}: max loss rel diff {loss_diff:.2e}, max weight abs diff {weight_diff:.2e}")
    assert loss_diff <= LOSS_RTOL, (result["losses"], reference["losses"])
    assert weight_diff <= WEIGHT_ATOL


def test_reference_learns_and_weights_move(reference, sample_prefix):
    """Guards the matrix against passing vacuously: training changes weights and lowers the loss."""
    assert reference["losses"][-1] < reference["losses"][0]
    untrained = run_ranks(train, 1, gpt_argv(1, 1, sample_prefix, ("--lr", "0", "--min-lr", "0")), timeout=120)[0]
    moved = max(float((reference["weights"][k] - w).abs().max()) for k, w in untrained["weights"].items())
    assert moved > 100 * WEIGHT_ATOL


def test_untied_embeddings_match_across_pipeline_stages(reference, sample_prefix, one_process):
    """Untied output layer under PP=2 (embedding and output on different ranks) against its own reference."""
    extra = ("--untie-embeddings-and-output-weights",)
    ref = one_process(gpt_argv(1, 1, sample_prefix, extra))
    result = run_ranks(train, 2, gpt_argv(1, 2, sample_prefix, extra), timeout=120)[0]
    assert "output_layer.weight" in ref["weights"]
    loss_diff, weight_diff = compare(result, ref)
    assert loss_diff <= LOSS_RTOL and weight_diff <= WEIGHT_ATOL


def test_distributed_optimizer_matches_single_process(reference, sample_prefix):
    """--use-distributed-optimizer (ZeRO-1 over DP) shards Adam's state; the update must not change."""
    result = run_ranks(train, 2, gpt_argv(1, 1, sample_prefix, ("--use-distributed-optimizer",)), timeout=120)[0]
    loss_diff, weight_diff = compare(result, reference)
    assert loss_diff <= LOSS_RTOL and weight_diff <= WEIGHT_ATOL


def test_bf16_tracks_fp32(reference, sample_prefix):
    """--bf16 on TP2 (bf16 weights and activations, fp32 master weights in Megatron's Float16 optimizer) runs
    on CPU and follows the fp32 run: losses within 1e-2 relative (measured 1e-3). Weights are not compared:
    the model holds bf16 copies whose rounding (2^-8 relative, 4e-3 on layernorm weights near 1) is larger than
    3 steps of lr=1e-3, so such a check would test bf16 rounding, not our code."""
    result = run_ranks(train, 2, gpt_argv(2, 1, sample_prefix, ("--bf16",)), timeout=120)[0]
    for got, want in zip(result["losses"], reference["losses"]):
        assert abs(got - want) <= 1e-2 * abs(want)
    assert result["losses"] != reference["losses"]  # it really ran in bf16

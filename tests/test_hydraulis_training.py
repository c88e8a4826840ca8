"""Hydraulis part 2 gold test: every step trains under the candidate plan with the lowest predicted time for its
lengths (``--hetu-strategies``), switched to and from the home candidate that holds the optimizer, and equals the
single-process reference on the unpacked documents of the same global batches.

Candidates on 3 ranks: DP 3 (holds sequences of at most 24 tokens), a 1-stage + 2-stage heterogeneous plan (at
most 40) and a TP-heavy single pipeline (a TP 2 stage, then a TP 1 stage; holds 64, the home). The data (log-normal
lengths of mean 10, seed 5, 300-token global batches) gives steps whose longest sequences are 64, 23 and 26 tokens:
only the home holds step 1's, DP 3 is the cheapest holding step 2's, the heterogeneous plan step 3's, so the run
switches 0, 1 and 1 times, into three different layouts. Model and tolerances: test_packed_training's (fp32, 3 Adam
steps at lr 1e-3: losses 1e-6 relative, weights 2e-6 absolute).
"""

from __future__ import annotations

import json

import pytest
from test_hotspa import assert_launch_refused
from helpers import ADAM_EPS
from test_packed_training import HETERO
from helpers import LOSS_RTOL, WEIGHT_ATOL, compare

from hetu_ext.metrics import read_records
from hetu_ext.testing.multiproc import run_ranks
from hetu_ext.cli.runs import train

LENGTHS = json.dumps({"mode": "distribution", "type": "lognormal", "min_seq_len": 2, "max_seq_len": 64,
                      "mean_seq_len": 10, "lognormal_sigma": 1.0})
SEED = "5"

TP_HEAVY = """
pipelines:
  - num_microbatches: 1
    stages:
      - {ranks: [0, 1], layers: [0, 2]}
      - {ranks: [2], layers: [2, 4]}
"""

CANDIDATES = """
home: tp_heavy
strategies:
  - {name: dp3, dp: 3, max_len: 24}
  - {name: hetero, plan: hetero.yaml, max_len: 40}
  - {name: tp_heavy, plan: tp_heavy.yaml, max_len: 64}
"""


def _argv(method: str, *extra: str) -> list[str]:
    return ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
            "--seq-length", "64", "--micro-batch-size", "1", "--hetu-global-batch-tokens", "300",
            "--train-iters", "3", "--lr", "1e-3", "--adam-eps", ADAM_EPS,  # why: test_packed_training.ADAM_EPS
            "--lr-decay-style", "constant", "--clip-grad", "1.0",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", SEED, "--mock-data",
            "--hetu-varlen-mock", LENGTHS, "--hetu-mock-documents", "2000", "--hetu-packing", method, *extra]


def _candidates(tmp_path) -> str:
    (tmp_path / "hetero.yaml").write_text(HETERO)
    (tmp_path / "tp_heavy.yaml").write_text(TP_HEAVY)
    path = tmp_path / "candidates.yaml"
    path.write_text(CANDIDATES)
    return str(path)


def test_steps_longest_sequences_force_three_choices():
    """The data's precondition, checked with the training's own batching: longest sequences 64, 23, 26."""
    import numpy as np

    from hetu_ext.data.lengths import parse_length_spec
    from hetu_ext.data.sequences import GlobalBatches, SequenceTable

    lengths = parse_length_spec(LENGTHS).sample(2000, int(SEED))
    table = SequenceTable.from_documents(np.asarray(lengths) + 1, 64)
    batches = GlobalBatches(table, seed=int(SEED), tokens=300)
    assert [int(table.length[batches[g]].max()) for g in range(3)] == [64, 23, 26]


def test_each_step_under_its_candidate_matches_unpacked_reference(tmp_path):
    reference = run_ranks(train, 1, _argv("unpacked"), timeout=180)[0]
    metrics = tmp_path / "metrics.jsonl"
    argv = _argv("balanced", "--hetu-strategies", _candidates(tmp_path), "--hetu-metrics-file", str(metrics))
    result = run_ranks(train, 3, argv, timeout=300)[0]
    loss_diff, weight_diff = compare(result, reference)
    print(f"hydraulis: loss rel diff {loss_diff:.2e}, weight abs diff {weight_diff:.2e}")
    assert loss_diff <= LOSS_RTOL and weight_diff <= WEIGHT_ATOL, (loss_diff, weight_diff)
    steps = read_records(metrics, kind="step")
    chosen = [r["packing"]["hydraulis"] for r in steps]
    assert [c["candidate"] for c in chosen] == ["tp_heavy", "dp3", "hetero"], chosen
    assert chosen[0]["switches"] == [] and chosen[0]["predicted_switch_s"] == 0.0
    for c in chosen[1:]:  # into the candidate's layout and back: weights out, gradients in, both moved bytes
        assert len(c["switches"]) == 2 and c["switch_bytes"] > 0 and c["predicted_switch_s"] > 0, c
        assert c["predicted_s"] == pytest.approx(c["predicted_compute_s"] + c["predicted_switch_s"])
    # the switch volume the selection prices (hetu_ext.plan.hotspa.switch_elements: every parameter of the model,
    # TP-split or whole, the last stage's tied embedding copy) equals the bytes the reshards sent, over all ranks
    from hetu_ext.plan.hotspa import load_strategies, switch_elements
    from hetu_ext.plan import ModelSpec

    spec = ModelSpec(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=257,
                     seq_length=64)
    strategies = load_strategies(_candidates(tmp_path), model=spec, world_size=3, flag="--hetu-strategies")
    plans = {s.name: s.plan for s in strategies.items}
    home = plans["tp_heavy"]
    for c in chosen[1:]:
        push, pull = (sw["bytes_total"] for sw in c["switches"])
        want_push = 4 * sum(switch_elements(home, plans[c["candidate"]], spec).values())
        want_pull = 4 * sum(switch_elements(plans[c["candidate"]], home, spec).values())
        assert (push, pull) == (want_push, want_pull), (c["candidate"], push, want_push, pull, want_pull)


@pytest.mark.parametrize("extra, message", [
    (("--hetu-hotspa", "auto"), "both choose the step's strategies; keep one"),
    (("--hetu-packing", "concat"), "--hetu-strategies needs --hetu-packing one of"),
    (("--hetu-plan", "hetero.yaml"), "--hetu-strategies sets the plans"),
], ids=["with-hotspa", "concat-packing", "with-plan"])
def test_bad_strategies_exit_2_with_one_line(tmp_path, extra, message):
    assert_launch_refused(3, _argv("balanced", "--hetu-strategies", _candidates(tmp_path), *extra), message,
                          cwd=tmp_path)

"""The grouping relaxation's program (hetu_ext.plan.hotspa.relaxation) is the one saved before its rewrite as a
builder (issue 46): on a handful of cases (every strategy 8 or 16 GPUs offer, real Wikipedia lengths, with and
without a known price U, buckets, fixed costs, the cutoff, at least two strategies, some rows switched off), the
constraint matrix, its row bounds, the objective, the integrality and the variable bounds are equal to the last bit.

The program is captured where it is handed to HiGHS (``scipy.optimize.milp``, replaced for the call); nothing is
solved. ``python tests/test_hotspa_relaxation_program.py --save`` rewrote tests/data/relaxation_programs.npz from
the relaxation as it was before the rewrite; it is not to be rerun to make this test pass.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

DATA = Path(__file__).resolve().parent / "data" / "relaxation_programs.npz"
ROOT = Path(__file__).resolve().parents[1]


class _Captured(Exception):
    def __init__(self, program: dict[str, np.ndarray]) -> None:
        super().__init__("captured")
        self.program = program


def _capture_milp(c, *, constraints, integrality, bounds, options):
    """Stands in for scipy's milp: the program as arrays (every constraint's matrix in CSR parts), then stop."""
    from scipy.sparse import csr_matrix

    program = {"c": np.asarray(c, dtype=np.float64), "integrality": np.asarray(integrality, dtype=np.float64),
               "lb": np.asarray(bounds.lb, dtype=np.float64), "ub": np.asarray(bounds.ub, dtype=np.float64),
               "options": np.array(sorted(f"{k}={v!r}" for k, v in options.items()))}
    for i, con in enumerate(constraints):
        A = csr_matrix(con.A)
        program[f"A{i}_data"], program[f"A{i}_indices"], program[f"A{i}_indptr"] = A.data, A.indices, A.indptr
        program[f"A{i}_shape"] = np.array(A.shape)
        program[f"A{i}_lb"] = np.broadcast_to(np.asarray(con.lb, dtype=np.float64), (A.shape[0],)).copy()
        program[f"A{i}_ub"] = np.broadcast_to(np.asarray(con.ub, dtype=np.float64), (A.shape[0],)).copy()
    raise _Captured(program)


def _setting(gpus: int, max_len: int, count: int, seed: int):
    """A 7B-shaped model on the A100 FLOP table (sequence parallelism, distributed optimizer), every strategy
    HotSPa's auto offers over ``gpus`` GPUs, and ``count`` Wikipedia lengths (the shipped 20K sample, cut at
    ``max_len``)."""
    from hetu_ext.data.lengths import read_lengths, split_long
    from hetu_ext.plan import ModelSpec
    from hetu_ext.plan.core.options import search_space
    from hetu_ext.plan.core.replicas import replica_specs
    from hetu_ext.plan.cost.stage import CostModel
    from hetu_ext.plan.hotspa import auto_strategies
    from hetu_ext.plan.hydraulis import flops_cost_table

    spec = ModelSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=11008,
                     vocab_size=32000, seq_length=max_len, untie_embeddings_and_output_weights=True)
    cost = flops_cost_table(spec, memory_bytes=80e9, options=search_space(("none", "full"))[0], world_size=gpus,
                            cost=CostModel(intra_node_bytes_per_s=150e9))
    sample = ROOT / "hetu_ext" / "data" / "samples" / "wikipedia_lengths_20k.txt.gz"
    pieces = split_long(read_lengths(str(sample)), max_len).length
    rng = np.random.default_rng(seed)
    lengths = [int(x) for x in rng.choice(pieces, size=count, replace=False)]
    strategies = auto_strategies(spec, gpus, cost, max_pp=8)
    plans = [st.plan for st in strategies.items]
    replicas = [replica_specs(st.plan, spec, cost, max_pack_tokens=st.max_len) for st in strategies.items]
    return lengths, plans, replicas


CASES = {  # name: (gpus, max_len, sequences, seed, relaxation's keyword arguments)
    "plain": (8, 8192, 60, 0, {}),
    "upper": (8, 8192, 80, 1, {"upper_s": 3.0, "fixed_s": "ramp"}),
    "buckets": (8, 4096, 150, 2, {"upper_s": 2.0, "binary": 0, "bucket_ratio": 2.0}),
    "cutoff-two": (16, 8192, 80, 3, {"upper_s": 2.5, "cutoff": True, "min_strategies": 2, "node_limit": 5,
                                     "fixed_s": "ramp"}),
    "rows-off": (16, 16384, 80, 4, {"upper_s": 4.0, "microbatch_rows": False, "bucket_lines": False,
                                     "bucket_sums": False, "anchor_rows": False, "pack_rows": 0,
                                     "explicit_pipelines": 0, "thresholds": 5}),
    "levels": (8, 16384, 60, 5, {"upper_s": 5.0, "anchor_levels": 4, "pack_rows": 5, "explicit_pipelines": 4,
                                 "binary": 10, "time_limit_s": 7.0}),
}


def _program(name: str) -> dict[str, np.ndarray]:
    from hetu_ext.plan.hotspa.relaxation import relaxation

    gpus, max_len, count, seed, kwargs = CASES[name]
    lengths, plans, replicas = _setting(gpus, max_len, count, seed)
    kwargs = dict(kwargs)
    if kwargs.get("fixed_s") == "ramp":
        kwargs["fixed_s"] = [0.01 * (k + 1) for k in range(len(plans))]
    with pytest.MonkeyPatch.context() as mp:
        import scipy.optimize

        mp.setattr(scipy.optimize, "milp", _capture_milp)
        try:
            relaxation(lengths, plans, replicas, **kwargs)
        except _Captured as done:
            return done.program
    raise AssertionError(f"{name}: the relaxation returned without handing a program to HiGHS")


@pytest.fixture(scope="module")
def saved() -> dict[str, np.ndarray]:
    with np.load(DATA) as data:
        return {key: data[key] for key in data.files}


@pytest.mark.parametrize("name", sorted(CASES))
def test_relaxation_program_is_the_saved_one(name, saved):
    program = _program(name)
    keys = sorted(key[len(name) + 1:] for key in saved if key.startswith(name + "/"))
    assert keys and sorted(program) == keys, (name, sorted(program), keys)
    for key in keys:
        want, got = saved[f"{name}/{key}"], program[key]
        assert got.shape == want.shape and got.dtype == want.dtype, (name, key, got.shape, want.shape)
        assert np.array_equal(got, want), (name, key)  # to the bit (no inf or nan appears where a number does)


def _save() -> None:
    arrays = {}
    for name in sorted(CASES):
        for key, value in _program(name).items():
            arrays[f"{name}/{key}"] = value
    DATA.parent.mkdir(exist_ok=True)
    np.savez_compressed(DATA, **arrays)
    print(f"wrote {DATA} ({DATA.stat().st_size} bytes, {len(arrays)} arrays)")


if __name__ == "__main__":
    if sys.argv[1:] != ["--save"]:
        sys.exit("usage: python tests/test_hotspa_relaxation_program.py --save")
    _save()

"""LobRA's branch-and-bound ranking of the fillings (hetu_ext.plan.lobra.search) gives what scoring every filling
gives: the same candidates in the same order, so plan_deployment returns the same deployment and step time, while
scoring fewer fillings; and its bound on a partial filling is below the score of every completion."""

import numpy as np
import pytest

from hetu_ext.plan import ModelSpec
from hetu_ext.plan.lobra import TenantLengths, capacity_bound_s, lobra_cost_model, plan_deployment, sample_steps
from hetu_ext.plan.lobra import deployment, strategy_pool
from hetu_ext.plan.lobra.bounds import SortedLengths, fillings
from hetu_ext.plan.lobra.search import Ranking, partial_bound_s, rank_fillings

SPEC = ModelSpec(num_layers=8, hidden_size=1024, num_attention_heads=8, ffn_hidden_size=4096, vocab_size=32000,
                 seq_length=8192)


def _case(memory: float, gpus: int, seed: int, prune: bool):
    pool = strategy_pool(SPEC, lobra_cost_model(), gpu_memory_bytes=memory, gpus_per_node=8, max_gpus=gpus,
                         cp_degrees=(1, 2, 4), prune=prune)
    rng = np.random.default_rng(seed)
    tenants = [TenantLengths(f"t{k}", np.maximum(rng.lognormal(6 + k, 1.0, 2000).astype(np.int64), 1), 16)
               for k in range(3)]
    batches = sample_steps(tenants, steps=3, seed=seed, max_len=8192)
    return pool, batches


def _exhaustive(pool, steps, world_size, longest, keep=8):
    """The ranking as plan_deployment computed it before the search: every filling scored, a stable sort."""
    scored = []
    for counts in fillings(pool, world_size):
        chosen = tuple((s, n) for s, n in zip(pool, counts) if n)
        if not chosen or max(s.capacity for s, _ in chosen) < longest:
            continue
        scored.append((sum(capacity_bound_s(step, chosen) for step in steps), chosen))
    scored.sort(key=lambda item: item[0])
    return scored, [chosen for _, chosen in scored[:keep]] + [c for _, c in scored[keep:] if len(c) == 1]


# 1.5 GB: TP 1's capacity is below the longest sequence, so capacity levels above 0 count; unpruned pools (15-20
# strategies, PP and CP shapes); 6 GB pruned: TP 1, TP 1 x CP 2 and x CP 4, whose scores tie exactly (a / cp)
CASES = [(1.5e9, 12, 0, False), (1.5e9, 16, 1, False), (3e9, 12, 2, False), (6e9, 16, 0, True)]


@pytest.mark.parametrize("memory,gpus,seed,prune", CASES)
def test_ranking_and_deployment_equal_exhaustive_scoring(memory, gpus, seed, prune, monkeypatch):
    pool, batches = _case(memory, gpus, seed, prune)
    assert any(s.cp > 1 for s in pool)
    steps = [np.concatenate(step) for step in batches]
    longest = max(int(step.max()) for step in steps)
    scored, expected = _exhaustive(pool, steps, gpus, longest)
    ranking = rank_fillings(pool, [SortedLengths.of(step) for step in steps], world_size=gpus, longest=longest,
                            keep=8)
    assert [[(id(s), n) for s, n in c] for c in ranking.candidates] == [[(id(s), n) for s, n in c] for c in expected]
    assert ranking.cut > 0 and ranking.scored < len(scored) * (0.75 if prune else 0.25)  # it does cut, and much
    pruned = plan_deployment(pool, batches, world_size=gpus, max_len=8192)
    monkeypatch.setattr(deployment, "rank_fillings", lambda *a, **k: Ranking(expected, len(scored), 0))
    full = plan_deployment(pool, batches, world_size=gpus, max_len=8192)
    assert [(id(s), n) for s, n in pruned.counts] == [(id(s), n) for s, n in full.counts]
    assert pruned.step_s == full.step_s
    if prune:  # ties at the 8th place: the order among equal scores (the enumeration's) is kept too
        assert scored[7][0] == scored[8][0]


@pytest.mark.parametrize("memory,gpus,seed", [(1.5e9, 12, 0), (3e9, 8, 1)])
def test_partial_bound_is_below_every_completion(memory, gpus, seed):
    pool, batches = _case(memory, gpus, seed, prune=False)
    steps = [np.concatenate(step) for step in batches]
    longest = max(int(step.max()) for step in steps)
    sorted_steps = [SortedLengths.of(step) for step in steps]
    least: dict[tuple[int, ...], float] = {}  # per prefix of counts, the least score of its valid completions
    for counts in fillings(pool, gpus):
        chosen = tuple((s, n) for s, n in zip(pool, counts) if n)
        if not chosen or max(s.capacity for s, _ in chosen) < longest:
            continue
        score = sum(capacity_bound_s(step, chosen) for step in steps)
        for i in range(len(pool) + 1):
            least[counts[:i]] = min(least.get(counts[:i], np.inf), score)
    tight = 0
    for prefix, score in least.items():
        left = gpus - sum(n * s.gpus for n, s in zip(prefix, pool))
        bound = partial_bound_s(sorted_steps, [(s, n) for s, n in zip(pool, prefix) if n], pool[len(prefix):], left)
        assert bound <= score * (1 + 1e-12), (prefix, bound, score)
        tight += bound > 0.9 * score
    assert tight > len(least) / 2  # and not a trivial one

"""HotSPa: one step's grouping over two strategies without pipelining, solved as one exact program.

A study of a row of ``benchmarks/hotspa.py`` whose ceiling is below 0.01%: is there a grouping over these two
strategies that beats the static best at all, and how far are HotSPa's packer and the benchmark's bound from it?

For strategies whose pipelines are identical and have one stage (PP 1), a pipeline's time is its sequences' work
``a s^2 + b s`` plus ``c`` per pack, and a pack holds at most ``cap`` tokens. The program (scipy's HiGHS) puts
every sequence on one pipeline of one of the two strategies (a binary each), gives each pipeline an integer count
of packs that holds its tokens (``cap M >= tokens``, and one pack per sequence over half a pack), and minimises
``T_1 + T_2``, each ``T`` at least every one of its pipelines' time; both groups hold at least one sequence per
pipeline (HotSPa's rule). Pipelines of one strategy are interchangeable, so pipeline ``r`` takes sequence ``i``
only if pipeline ``r - 1`` holds one before it, longest first (orders the pipelines by their first sequence in
that order: no grouping lost).
``M >= tokens / cap`` is weaker than packing, so HiGHS's dual bound bounds every grouping over exactly these two
strategies; its grouping is then packed exactly, pipeline by pipeline (the fewest packs, by search), and priced by
the packer's own model (``ReplicaSpec.time_s``): a real grouping and packing. The packer's price of the same two
groups shows what HotSPa's planner, which prices groups by the packer, can make of them.

    python -m benchmarks.hotspa_pair_exact --lengths benchmarks/results/code_lengths_site_packages_2026-12-06.txt.gz
    python -m benchmarks.hotspa_pair_exact ... --grouping RESULT   # price a grouping saved in a result's JSON line
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import lil_matrix

from benchmarks.common import ROOT, Table, print_result
from benchmarks.hotspa import RECOMPUTE_SEARCHED, candidates
from hetu_ext.data.lengths import read_lengths, split_long
from hetu_ext.data.packing import ReplicaSpec
from hetu_ext.plan import ModelSpec
from hetu_ext.plan.cost.stage import CostModel
from hetu_ext.plan.hotspa import GroupPricer, replica_specs
from hetu_ext.plan.hydraulis import flops_cost_table, sample_batches
from hetu_ext.plan.core.options import search_space

HELD_OUT = ROOT / "benchmarks" / "results" / "code_lengths_site_packages_2026-12-06.txt.gz"


def fewest_packs(lengths: list[int], cap: int) -> list[list[int]]:
    """The fewest packs of at most ``cap`` tokens holding ``lengths`` (positions into it), by depth-first search
    over pack counts from the token bound up (a pipeline holds a handful of sequences here)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    for m in range(max(1, -(-sum(lengths) // cap)), len(lengths) + 1):
        packs: list[list[int]] = [[] for _ in range(m)]
        loads = [0] * m

        def place(j: int) -> bool:
            if j == len(order):
                return True
            tried = set()
            for p in range(m):
                x = lengths[order[j]]
                if loads[p] + x <= cap and loads[p] not in tried:  # packs of equal load are interchangeable
                    tried.add(loads[p])
                    loads[p] += x
                    packs[p].append(order[j])
                    if place(j + 1):
                        return True
                    loads[p] -= x
                    packs[p].pop()
            return False

        if place(0):
            return [p for p in packs if p]
    return [[i] for i in range(len(lengths))]


def pair_program(lengths: list[int], reps: list[ReplicaSpec], counts: list[int], *, time_limit_s: float
                 ) -> tuple[float, list[list[list[int]]] | None]:
    """HiGHS's dual bound on ``T_1 + T_2`` (seconds) and its grouping: per strategy, per pipeline, positions into
    ``lengths``; ``reps``: one (identical) pipeline of each strategy, PP 1; ``counts``: its pipelines."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # position r in order: the r-th longest
    s = np.array([lengths[i] for i in order], dtype=np.float64)
    pipes = [(t, r) for t in range(2) for r in range(counts[t])]
    var: dict[tuple[int, int], int] = {}
    for p, (t, _) in enumerate(pipes):
        for i in range(s.size):
            if s[i] <= reps[t].token_capacity:
                var[i, p] = len(var)
    packs0, t0 = len(var), len(var) + len(pipes)
    size = t0 + 2
    rows, lo, hi = [], [], []

    def row(coefs: dict[int, float], low: float, high: float) -> None:
        rows.append(coefs)
        lo.append(low)
        hi.append(high)

    for i in range(s.size):
        row({var[i, p]: 1.0 for p in range(len(pipes)) if (i, p) in var}, 1.0, 1.0)
    for p, (t, r) in enumerate(pipes):
        cost, cap = reps[t].stage_costs[0], reps[t].token_capacity
        mine = [i for i in range(s.size) if (i, p) in var]
        row({**{var[i, p]: s[i] for i in mine}, packs0 + p: -cap}, -np.inf, 0.0)
        row({**{var[i, p]: 1.0 for i in mine if s[i] > cap / 2}, packs0 + p: -1.0}, -np.inf, 0.0)
        row({**{var[i, p]: cost.a * s[i] ** 2 + cost.b * s[i] for i in mine}, packs0 + p: cost.c, t0 + t: -1.0},
            -np.inf, 0.0)
        if r > 0:
            before = pipes.index((t, r - 1))
            for i in mine:
                coefs = {var[i, p]: 1.0}
                coefs.update({var[j, before]: -1.0 for j in range(i) if (j, before) in var})
                row(coefs, -np.inf, 0.0)
    for t in range(2):
        row({v: 1.0 for (i, p), v in var.items() if pipes[p][0] == t}, counts[t], np.inf)
    matrix = lil_matrix((len(rows), size))
    for r, coefs in enumerate(rows):
        for v, a in coefs.items():
            matrix[r, v] = a
    objective = np.zeros(size)
    objective[t0:] = 1.0
    integrality = np.ones(size)
    integrality[t0:] = 0
    upper = np.ones(size)
    upper[packs0:t0] = s.size
    upper[t0:] = np.inf
    out = milp(objective, constraints=LinearConstraint(matrix.tocsr(), lo, hi), integrality=integrality,
               bounds=Bounds(np.zeros(size), upper), options={"time_limit": time_limit_s, "mip_rel_gap": 1e-9})
    bound = getattr(out, "mip_dual_bound", None)
    if bound is None or not np.isfinite(bound):
        raise SystemExit(f"HiGHS gave no bound in {time_limit_s:g} s: {out.message}")
    if out.x is None:
        return float(bound), None
    grouping: list[list[list[int]]] = [[[] for _ in range(c)] for c in counts]
    for (i, p), v in var.items():
        if out.x[v] > 0.5:
            grouping[pipes[p][0]][pipes[p][1]].append(order[i])
    return float(bound), grouping


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default=str(HELD_OUT))
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=0, help="which of the benchmark's batches (its --batches 2)")
    parser.add_argument("--strategies", default="tp1pp1dp8,tp2pp1dp4", help="two PP 1 strategies, by name")
    parser.add_argument("--options", default="sp,do", help="the option set of benchmarks/hotspa.py's search")
    parser.add_argument("--time-limit", type=float, default=1000.0, help="seconds HiGHS may take")
    parser.add_argument("--grouping", help="price the grouping of a file's last line (JSON: \"grouping\", per "
                        "strategy, per pipeline, the lengths; this script's own result line has it), solve nothing")
    args = parser.parse_args()

    # the row exactly as benchmarks/hotspa.py builds it (its defaults: 256K tokens per 8 GPUs, 2 batches, 100 and
    # 150 GB/s, 80 GB)
    spec = ModelSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=11008,
                     vocab_size=32000, seq_length=args.max_len, untie_embeddings_and_output_weights=True)
    pieces = split_long(read_lengths(args.lengths), args.max_len).length
    batch_list = sample_batches(pieces, tokens=256 * 1024 * args.gpus // 8, count=2, seed=args.gpus)
    options = {o.name: o for o in search_space(RECOMPUTE_SEARCHED)}[args.options]
    cost = flops_cost_table(spec, memory_bytes=80e9, options=options, world_size=args.gpus,
                            cost=CostModel(intra_node_bytes_per_s=150e9))
    row = candidates(spec, args.gpus, cost, batch_list, bandwidth=100e9)
    items = row.home.items
    names = [it.name for it in items]
    pair = [names.index(name) for name in args.strategies.split(",")]
    batch = [int(x) for x in batch_list[args.batch]]
    reps = [replica_specs(items[k].plan, spec, cost, max_pack_tokens=items[k].max_len) for k in pair]
    if any(r.pp != 1 or any(x != r for x in rs) for rs in reps for r in rs[:1]):
        raise SystemExit(f"--strategies: both must have identical pipelines of one stage; got {args.strategies}")
    fixed = [row.allreduce[k] + row.switch[k] for k in pair]
    pricer = GroupPricer(row.home, spec, cost)  # the packer, as benchmarks/hotspa.py prices groups
    static = min(pricer.exact(k, batch) + row.allreduce[k] + row.switch[k]
                 for k, it in enumerate(items) if it.max_len >= max(batch) and len(it.plan.pipelines) <= len(batch))

    start = time.perf_counter()
    if args.grouping:
        saved = json.loads(Path(args.grouping).read_text().strip().splitlines()[-1])
        bound, grouping = saved.get("pair_bound_s"), saved["grouping"]  # a grouping from elsewhere: no bound
        index: dict[int, list[int]] = {}
        for i, x in enumerate(batch):
            index.setdefault(x, []).append(i)
        if any(len(group) > len(r) for group, r in zip(grouping, reps)) or len(grouping) != 2:
            raise SystemExit(f"--grouping {args.grouping}: two groups of at most {[len(r) for r in reps]} pipelines")
        if sorted(x for group in grouping for pipe in group for x in pipe) != sorted(batch):
            raise SystemExit(f"--grouping {args.grouping}: its lengths are not this batch's ({len(batch)} sequences)")
        grouping = [[[index[x].pop() for x in pipe] for pipe in group] for group in grouping]  # lengths -> positions
    else:
        bound, grouping = pair_program(batch, [r[0] for r in reps], [len(r) for r in reps],
                                       time_limit_s=args.time_limit)
    solve_s = time.perf_counter() - start
    if grouping is None:
        raise SystemExit(f"HiGHS found no grouping in {args.time_limit:g} s (dual bound {bound + sum(fixed):.6f} s)")

    exact, packer, groups = [], [], []
    for t, group in enumerate(grouping):
        times = []
        for pipe in group:
            packs = [[pipe[j] for j in p] for p in fewest_packs([batch[i] for i in pipe], reps[t][0].token_capacity)]
            assert all(sum(batch[i] for i in p) <= reps[t][0].token_capacity for p in packs), "a pack over capacity"
            times.append(reps[t][0].time_s(packs, batch))
        exact.append(max(times))
        members = [batch[i] for pipe in group for i in pipe]
        packer.append(pricer.exact(pair[t], members))
        groups.append(sorted(members, reverse=True))
    assert sorted(x for g in groups for x in g) == sorted(batch), "a grouping must hold every sequence once"
    assert all(len(group) >= len(r) for group, r in zip(groups, reps)), "a group holds a sequence per pipeline"
    out = {"lengths": args.lengths, "gpus": args.gpus, "max_len": args.max_len, "batch": args.batch,
           "options": args.options, "strategies": args.strategies.split(","), "sequences": len(batch),
           "static_s": static, "pair_bound_s": bound,
           "pair_bound_step_s": None if bound is None else bound + sum(fixed),
           "exact_step_s": sum(exact) + sum(fixed), "packer_step_s": sum(packer) + sum(fixed),
           "group_exact_s": exact, "group_packer_s": packer, "fixed_s": fixed, "solve_s": solve_s,
           "grouping": [[sorted((batch[i] for i in pipe), reverse=True) for pipe in group] for group in grouping]}
    print(f"{args.lengths}, {args.gpus} GPUs, {args.max_len} tokens, batch {args.batch} ({len(batch)} sequences), "
          f"options {args.options}: {' + '.join(out['strategies'])}"
          + (f" (HiGHS {solve_s:.0f} s)" if not args.grouping else f" (grouping of {args.grouping})"))
    steps = Table.of(("", "<28"), ("step s", ">10.6f"), ("vs static", ">+10.5%"))
    steps.print_header()
    for label, value in (("static best, packer", static), ("pair program's dual bound", out["pair_bound_step_s"]),
                         ("its grouping, fewest packs", out["exact_step_s"]),
                         ("same groups, packer", out["packer_step_s"])):
        if value is not None:
            steps.print_row([label, value, value / static - 1])
    for t, name in enumerate(out["strategies"]):
        print(f"  {name}: {len(groups[t])} sequences, slowest pipeline {exact[t]:.6f} s packed fewest, "
              f"{packer[t]:.6f} s by the packer; fixed (all-reduce, switch) {fixed[t]:.5f} s")
    print_result(out)


if __name__ == "__main__":
    main()

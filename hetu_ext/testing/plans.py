"""Heterogeneous plans that exercise the plan runtime's odd layouts, on 4-6 ranks of a 4-layer model: the gold test
tests/test_plan_runtime.py trains each against one process, and benchmarks/plan_runtime.py measures each one's
gradient bytes against the plan's minimum. Pure data (plan YAML text), no import.
"""

from __future__ import annotations

PLANS: list[tuple[str, int, str, str]] = [
    ("stages_2_and_1", 4, "pipelines with different stage counts and layer splits (3+1 vs 4 vs 4), 2/1/1 "
     "microbatches",
     "pipelines: [{num_microbatches: 2, stages: [{ranks: [0], layers: [0, 3]}, {ranks: [1], layers: [3, 4]}]},"
     " {num_microbatches: 1, stages: [{ranks: [2], layers: [0, 4]}]},"
     " {num_microbatches: 1, stages: [{ranks: [3], layers: [0, 4]}]}]"),
    ("microbatches_3_1", 4, "different microbatch counts (3 vs 1) and TP 2 -> 1 inside a pipeline, tied "
     "embedding on stages of different TP degree",
     "pipelines: [{num_microbatches: 3, stages: [{ranks: [0, 1], layers: [0, 3]}, {ranks: [2], layers: [3, 4]}]},"
     " {num_microbatches: 1, stages: [{ranks: [3], layers: [0, 4]}]}]"),
    ("tp_differs_between_pipelines", 4, "the same layers at TP 2 in one replica and TP 1 in two others",
     "pipelines: [{num_microbatches: 2, stages: [{ranks: [0, 1], layers: [0, 4]}]},"
     " {num_microbatches: 1, stages: [{ranks: [2], layers: [0, 4]}]},"
     " {num_microbatches: 1, stages: [{ranks: [3], layers: [0, 4]}]}]"),
    ("tp_1_to_2_in_pipeline", 4, "TP 1 -> 2 inside a pipeline (one sender, two receivers; two senders back)",
     "pipelines: [{num_microbatches: 1, stages: [{ranks: [0], layers: [0, 1]}, {ranks: [1, 2], layers: [1, 4]}]},"
     " {num_microbatches: 3, stages: [{ranks: [3], layers: [0, 4]}]}]"),
    ("unused_ranks", 5, "unused ranks (one in the middle, one at the end) stay idle and alive",
     "pipelines: [{num_microbatches: 2, stages: [{ranks: [0], layers: [0, 2]}, {ranks: [1], layers: [2, 4]}]},"
     " {num_microbatches: 2, stages: [{ranks: [3], layers: [0, 4]}]}]\nunused_ranks: [2, 4]"),
    ("rank0_unused_and_rank_order", 5, "rank 0 unused; stages on ranks in decreasing order",
     "pipelines: [{num_microbatches: 1, stages: [{ranks: [4], layers: [0, 1]}, {ranks: [2, 1], layers: [1, 4]}]},"
     " {num_microbatches: 3, stages: [{ranks: [3], layers: [0, 4]}]}]\nunused_ranks: [0]"),
    ("three_pipelines", 6, "three pipelines of 3, 1 and 1 stages, splits 1/2/1, TP 1, 2 and 1, microbatches 1/2/1",
     "pipelines: [{num_microbatches: 1, stages: [{ranks: [0], layers: [0, 1]}, {ranks: [1], layers: [1, 3]},"
     " {ranks: [2], layers: [3, 4]}]}, {num_microbatches: 2, stages: [{ranks: [3, 4], layers: [0, 4]}]},"
     " {num_microbatches: 1, stages: [{ranks: [5], layers: [0, 4]}]}]"),
    ("tp_2_1_2_chain", 6, "TP 2 -> 1 -> 2 along one pipeline of three stages, beside a TP-1 replica",
     "pipelines: [{num_microbatches: 2, stages: [{ranks: [0, 1], layers: [0, 1]}, {ranks: [2], layers: [1, 3]},"
     " {ranks: [3, 4], layers: [3, 4]}]}, {num_microbatches: 2, stages: [{ranks: [5], layers: [0, 4]}]}]"),
    ("one_pipeline_uneven", 4, "a single pipeline, uneven 1/2/1 split, TP 1 -> 2 -> 1 (no replicas: only the "
     "tied embedding of the first and last stage is reduced)",
     "pipelines: [{num_microbatches: 4, stages: [{ranks: [0], layers: [0, 1]}, {ranks: [1, 2], layers: [1, 3]},"
     " {ranks: [3], layers: [3, 4]}]}]"),
]
"""(id, world size, what it covers, plan YAML)."""

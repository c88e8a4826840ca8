"""HotSPa: which parallel strategy trains which sequences of a step (pure: numpy and PyYAML, no torch).

A step's global batch is split by length into groups; each group trains under its own strategy (a plan over the
same ranks), one group after another, and one strategy, the *home*, holds the optimizer (HotSPa, SOSP'24). This
module decides the groups; hetu_ext.megatron.switching runs them.

StrategySet come from a YAML file (``--hetu-hotspa FILE``)::

    home: long            # the strategy holding the optimizer (default: the one taking the longest sequences)
    home_first: true      # run the home's group first (default) or last
    strategies:
      - name: short
        dp: 2             # a uniform TP x PP x DP shape (tp, pp default 1; dp default: the ranks left) ...
        max_len: 256      # ... and the longest sequence it takes (tokens)
      - name: long
        plan: plans/long.yaml   # ... or a plan file (a path relative to this file)
        max_len: 1024

or from ``auto``: every uniform TP x PP x DP shape over the world whose memory (the cost table's model) holds at
least one pack, grouped by :func:`auto_groups`: a dynamic program over split points of the step's sorted lengths
that minimises the sum over groups of the packer's predicted time plus the predicted switch time.

Fixed grouping: every sequence goes to the strategy with the smallest ``max_len`` that takes it. A group with fewer
sequences than its strategy has pipelines moves up into the next strategy (which takes longer ones, so it takes
them too); the longest group, if short of sequences, borrows the longest sequences of the groups below it.
"""

from __future__ import annotations

from hetu_ext.plan.core.strategies import Strategy, StrategySet, strategies_from_dict, load_strategies
from hetu_ext.plan.hotspa.strategies import auto_strategies
from hetu_ext.plan.hotspa.grouping import Group, check_capacity, fixed_groups, run_order, auto_groups
from hetu_ext.plan.hotspa.bound import PAIR_ANCHOR_LEVELS, grouping_bound_s
from hetu_ext.plan.hotspa.switch_cost import switch_elements, switch_seconds, allreduce_seconds, group_seconds
from hetu_ext.plan.hotspa.pricer import RELAXED_NODES, RELAXED_TIME_LIMIT_S, GroupPricer
from hetu_ext.plan.core.replicas import replica_specs  # noqa: F401 (benchmarks/hotspa_pair_exact.py imports it here)

__all__ = [
    "Strategy", "StrategySet", "strategies_from_dict", "load_strategies", "auto_strategies", "Group", "check_capacity",
    "fixed_groups", "run_order", "auto_groups", "PAIR_ANCHOR_LEVELS", "grouping_bound_s", "switch_elements",
    "switch_seconds", "allreduce_seconds", "group_seconds", "RELAXED_NODES", "RELAXED_TIME_LIMIT_S", "GroupPricer",
]

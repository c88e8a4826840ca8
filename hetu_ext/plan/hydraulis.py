"""Hydraulis, part 2: heterogeneous parallel strategies chosen per step (pure: numpy, no torch).

Candidates are :class:`hetu_ext.data.hotspa.Strategies` (each a plan over the same ranks and the longest sequence
it takes; the home holds the optimizer). Every step trains under one of them, switched to and from the home's
layout by hetu_ext.megatron.switching (one length group per step).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hetu_ext.data.hotspa import Strategies, check_capacity


def select_candidate(lengths: Sequence[int], strategies: Strategies, *, estimate: Callable[[int, list[int]], float],
                     exact: Callable[[int, list[int]], float], switch_s: Sequence[float]) -> tuple[int, float]:
    """The candidate with the lowest predicted step time ``exact(k, lengths) + switch_s[k]`` among those that hold
    the step's longest sequence, and that time. ``estimate`` must lower-bound ``exact`` (the packer's certified
    bound): candidates are priced exactly in order of their estimate until the next estimate cannot win, so the
    result equals brute force over every candidate (ties: the lower index)."""
    check_capacity(lengths, strategies)
    s = list(lengths)
    longest = max(s, default=0)
    able = [k for k, st in enumerate(strategies.items) if st.max_len >= longest and len(st.plan.pipelines) <= len(s)]
    if not able:
        raise ValueError(f"Hydraulis: the step's {len(s)} sequences are fewer than every candidate's pipelines "
                         f"that holds {longest} tokens; raise the global batch")
    bounds = sorted((estimate(k, s) + switch_s[k], k) for k in able)
    best_k, best_s = -1, float("inf")
    for bound, k in bounds:
        if bound > best_s:
            break
        t = exact(k, s) + switch_s[k]
        if t < best_s or (t == best_s and k < best_k):
            best_k, best_s = k, t
    return best_k, best_s

"""The training options the planners search besides the layout (pure): activation recomputation, sequence
parallelism and the distributed optimizer, Megatron-LM's ``--recompute-granularity``, ``--sequence-parallel`` and
``--use-distributed-optimizer``.

They are job-wide flags in Megatron-LM, so a plan is chosen together with one set of them, and every baseline a
planner is compared with searches the same sets. What each costs under the project's models
(hetu_ext.plan.cost.stage.stage_cost, hetu_ext.plan.hydraulis.flops_cost_table):

* recomputation trades time for memory: ``selective`` recomputes the attention core (its FLOPs) and keeps no
  ``s x s`` scores, ``full`` runs each layer's forward again in its backward and keeps only its input; a planner
  tries the lighter granularity first and a heavier one only where memory binds (:func:`search_space` orders them);
* sequence parallelism turns each TP all-reduce into a reduce-scatter and an all-gather of the same bytes (time
  unchanged) and splits the activations TP left whole: never slower, never more memory, so it is on whenever
  TP > 1 (tests/test_plan_options.py checks the claim on both cost models);
* the distributed optimizer keeps each parameter's Adam state on one of its data-parallel holders: less memory;
  its reduce-scatter of fp32 gradients and all-gather of bf16 weights move 6 bytes per element where the plain
  all-reduce moves 8, priced here as the all-reduce (an upper bound), so it is never slower in these models.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetu_ext.model.inventory import RECOMPUTE, check_recompute


@dataclass(frozen=True)
class Options:
    """One set of training options (Megatron-LM's flags)."""

    recompute: str = "none"
    sequence_parallel: bool = False
    distributed_optimizer: bool = False

    def __post_init__(self) -> None:
        check_recompute(self.recompute)

    @property
    def name(self) -> str:
        """``rc=full,sp,do``: what differs from Megatron-LM's defaults."""
        parts = [f"rc={self.recompute}"] if self.recompute != "none" else []
        parts += ["sp"] if self.sequence_parallel else []
        parts += ["do"] if self.distributed_optimizer else []
        return ",".join(parts) or "plain"

    def flags(self) -> list[str]:
        """The Megatron-LM flags that select these options."""
        out = ["--recompute-granularity", self.recompute] if self.recompute != "none" else []
        out += ["--sequence-parallel"] if self.sequence_parallel else []
        out += ["--use-distributed-optimizer"] if self.distributed_optimizer else []
        return out


PLAIN = Options()


def search_space(recompute: tuple[str, ...] = RECOMPUTE, *,
                 distributed_optimizer: tuple[bool, ...] = (True,)) -> list[Options]:
    """The option sets a planner searches, lightest first: recomputation in the order given, then (within each)
    the distributed optimizer as given, sequence parallelism on. Sequence parallelism is never searched off: under
    these cost models it never makes a layout slower or needs more memory. The distributed optimizer is searched
    off too where a planner may leave ranks idle (Malleus: an idle pipeline cannot keep its optimizer shard)."""
    for r in recompute:
        check_recompute(r)
    return [Options(recompute=r, sequence_parallel=True, distributed_optimizer=d)
            for r in recompute for d in distributed_optimizer]

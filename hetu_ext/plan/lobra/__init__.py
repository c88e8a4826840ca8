"""LobRA's deployment planner (pure): which replicas, of which shapes, to run many tenants' LoRA fine-tuning on.

Tenants' sequence lengths differ and are skewed per step; one replica shape is either too small for the longest
sequences or wasteful for the short ones. Given the cluster (GPUs, GPUs per node, memory per GPU), the model and
the tenants' length distributions and per-step shares, the planner chooses a *deployment*, a count of replicas
for each strategy (TP x PP), minimising the expected step time, as LobRA does:

1. **Strategy pool.** Every (tp, pp) with tp <= GPUs per node and pp dividing the layers; each strategy's
   per-layer time comes from the FLOP / all-reduce model of hetu_ext.plan.cost.stage (as a ``a s^2 + b s + c``
   LengthCost) and its token capacity from memory: frozen bf16 base weights (no gradients, no optimizer state:
   adapters are negligible) plus FlashAttention-style activations (34 h bytes per token and layer, divided by
   tp) for the microbatches 1F1B keeps in flight. Per TP degree only the fewest pipeline stages that fit, and the
   fewest that hold MIN_CAPACITY tokens, are kept (more stages add GPUs and bubbles, little capacity), and a
   strategy is pruned when another one of no more GPUs holds as many tokens at no higher GPU-seconds per token.
2. **Enumeration.** Every combination of pool strategies filling the GPUs (fewer idle GPUs than the smallest
   strategy) whose largest replica holds the longest sequence; each is scored by a capacity-aware lower bound
   (:func:`capacity_bound_s`), and the best few (and every homogeneous one) are evaluated exactly; the best few
   are found by branch and bound (:mod:`hetu_ext.plan.lobra.search`), the same ones as scoring every filling.
3. **Evaluation.** The existing two-stage assignment (hetu_ext.data.packing.assign, ``hetu``) of every sampled
   step's sequences over the deployment's replicas; the step time is the slowest replica's predicted time.

The same functions price the baselines: homogeneous replicas of the smallest strategy able to hold the longest
sequence with Megatron-style packs (``concat``: sequences laid end to end and cut every ``max_len`` tokens, each
piece attending to itself; ``concat-causal``: Megatron-LM's default, attention over the whole pack), and the
tenants trained one after another (each on all GPUs, on its own smallest strategy, Megatron-style packs).
"""

from __future__ import annotations

from hetu_ext.plan.lobra.pool import DEGREES, MIN_CAPACITY, layer_cost, strategy_pool, lobra_cost_model
from hetu_ext.plan.lobra.tenants import TenantLengths, sample_steps, tenant_lengths
from hetu_ext.plan.lobra.step_time import joint_time_s, megatron_time_s, smallest_holding, homogeneous_s, sequential_s
from hetu_ext.plan.lobra.bounds import least_step_s, work_bound_gpu_s, capacity_bound_s
from hetu_ext.plan.lobra.deployment import Deployment, plan_deployment, deployment_plan
from hetu_ext.plan.lobra.report import deployment_report

__all__ = [
    "DEGREES", "MIN_CAPACITY", "layer_cost", "strategy_pool", "lobra_cost_model", "TenantLengths", "sample_steps",
    "tenant_lengths", "joint_time_s", "megatron_time_s", "smallest_holding", "homogeneous_s", "sequential_s",
    "least_step_s", "work_bound_gpu_s", "capacity_bound_s", "Deployment", "plan_deployment", "deployment_plan",
    "deployment_report",
]

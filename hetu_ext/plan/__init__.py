"""Plans and planners: pure (no torch.distributed, no host framework)."""

from hetu_ext.plan.core.io import dump_plan, format_plan, load_plan, plan_from_dict, plan_to_dict
from hetu_ext.model.spec import ModelSpec
from hetu_ext.plan.core.plan import Pipeline, Plan, PlanError, Stage, uniform_plan, uniform_shape

__all__ = ["ModelSpec", "Pipeline", "Plan", "PlanError", "Stage", "dump_plan", "format_plan", "load_plan",
           "plan_from_dict", "plan_to_dict", "uniform_plan", "uniform_shape"]

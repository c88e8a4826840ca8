"""Plans to and from YAML, and a readable table of a plan (pure: PyYAML only).

The YAML form (``layers`` is ``[start, stop)``; ``has_embedding`` / ``has_output`` may be omitted and then
default to the first / last stage)::

    pipelines:
      - num_microbatches: 3
        stages:
          - {ranks: [0, 1], layers: [0, 3]}
          - {ranks: [2], layers: [3, 4]}
      - num_microbatches: 1
        stages:
          - {ranks: [3], layers: [0, 4]}
    unused_ranks: [4]

A stage may add ``cp: C`` (context parallelism): its ranks are then C TP groups of ``len(ranks) / C`` ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from hetu_ext.keys import check_keys, read_yaml

from hetu_ext.plan.core.plan import Pipeline, Plan, PlanError, Stage

_PLAN_KEYS = {"pipelines", "unused_ranks"}
_PIPELINE_KEYS = {"stages", "num_microbatches"}
_STAGE_KEYS = {"ranks", "layers", "has_embedding", "has_output", "cp"}



def _int_list(value: Any, where: str) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                        for v in value):
        raise PlanError(f"{where}: expected a list of integers, got {value!r}")
    return list(value)


def plan_from_dict(data: Any) -> Plan:
    """Build a Plan from its YAML mapping (structure only; call ``Plan.validate`` for the rules)."""
    data = check_keys(data, _PLAN_KEYS, "plan", error=PlanError)
    if "pipelines" not in data or not isinstance(data["pipelines"], list):
        raise PlanError("plan: 'pipelines' must be a list of pipelines; see configs/plans/*.yaml for examples")
    pipelines = []
    for i, p in enumerate(data["pipelines"]):
        p = check_keys(p, _PIPELINE_KEYS, f"pipeline {i}", error=PlanError)
        stages_raw = p.get("stages")
        if not isinstance(stages_raw, list) or not stages_raw:
            raise PlanError(f"pipeline {i}: 'stages' must be a non-empty list, got {stages_raw!r}")
        stages = []
        for j, s in enumerate(stages_raw):
            where = f"pipeline {i} stage {j}"
            s = check_keys(s, _STAGE_KEYS, where, error=PlanError)
            for key in ("ranks", "layers"):
                if key not in s:
                    raise PlanError(f"{where}: missing required key {key!r}")
            layers = _int_list(s["layers"], f"{where} layers")
            if len(layers) != 2:
                raise PlanError(f"{where}: layers must be [start, stop), got {layers!r}")
            stages.append(Stage(ranks=tuple(_int_list(s["ranks"], f"{where} ranks")), layer_start=layers[0],
                                layer_stop=layers[1], has_embedding=bool(s.get("has_embedding", j == 0)),
                                has_output=bool(s.get("has_output", j == len(stages_raw) - 1)),
                                cp=s.get("cp", 1)))
        pipelines.append(Pipeline(stages=tuple(stages), num_microbatches=p.get("num_microbatches", 1)))
    unused = _int_list(data.get("unused_ranks", []) or [], "plan unused_ranks")
    return Plan(pipelines=tuple(pipelines), unused_ranks=tuple(unused))


def plan_to_dict(plan: Plan) -> dict:
    return {
        "pipelines": [
            {"num_microbatches": p.num_microbatches,
             "stages": [{"ranks": list(s.ranks), "layers": [s.layer_start, s.layer_stop],
                         "has_embedding": s.has_embedding, "has_output": s.has_output,
                         **({"cp": s.cp} if s.cp > 1 else {})} for s in p.stages]}
            for p in plan.pipelines],
        "unused_ranks": list(plan.unused_ranks),
    }


def load_plan(path: str | Path) -> Plan:
    """Read a plan file. Raises PlanError (a ValueError) naming the file for unreadable or malformed input."""
    path = Path(path)
    data = read_yaml(path, "plan file", error=PlanError)
    if isinstance(data, dict) and "plan" in data and "pipelines" not in data:
        data = data["plan"]
    try:
        return plan_from_dict(data)
    except PlanError as exc:
        raise PlanError(f"plan file {str(path)!r}: {exc}") from exc


def dump_plan(plan: Plan) -> str:
    return yaml.safe_dump(plan_to_dict(plan), sort_keys=False, default_flow_style=None)


def format_plan(plan: Plan) -> str:
    """A table of pipelines and stages, then each rank's layers (with a ``cp`` column when a stage has cp > 1)."""
    with_cp = any(s.cp > 1 for p in plan.pipelines for s in p.stages)
    rows = [("pipeline", "stage", "ranks", "tp", *(("cp",) if with_cp else ()), "layers", "embedding", "output",
             "microbatches")]
    for i, p in enumerate(plan.pipelines):
        for j, s in enumerate(p.stages):
            rows.append((str(i), str(j), ",".join(map(str, s.ranks)), str(s.tp), *((str(s.cp),) if with_cp else ()),
                         f"{s.layer_start}-{s.layer_stop - 1}" if s.num_layers else "-",
                         "yes" if s.has_embedding else "", "yes" if s.has_output else "",
                         str(p.num_microbatches) if j == 0 else ""))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    lines.append(f"{len(plan.pipelines)} pipeline(s), {plan.num_microbatches} microbatches per global batch, "
                 f"{len(plan.used_ranks)} used rank(s), unused: {list(plan.unused_ranks) or 'none'}")
    lines.append("")
    lines.append("rank  pipeline  stage  tp-rank  " + ("cp-rank  " if with_cp else "") + "layers")
    for rank in sorted(plan.used_ranks + plan.unused_ranks):
        where = plan.stage_of(rank)
        if where is None:
            lines.append(f"{rank:<4}  {'-':<8}  {'-':<5}  {'-':<7}  " + (f"{'-':<7}  " if with_cp else "") + "unused")
            continue
        stage = plan.pipelines[where[0]].stages[where[1]]
        layers = f"{stage.layer_start}-{stage.layer_stop - 1}" if stage.num_layers else "none"
        extra = "".join([" +embedding" if stage.has_embedding else "", " +output" if stage.has_output else ""])
        cp_rank, tp_rank = stage.position(rank)
        lines.append(f"{rank:<4}  {where[0]:<8}  {where[1]:<5}  {tp_rank:<7}  " + (f"{cp_rank:<7}  " if with_cp else "")
                     + f"{layers}{extra}")
    return "\n".join(lines)

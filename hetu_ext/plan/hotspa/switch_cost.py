"""What a strategy costs besides its group's compute (pure): the elements a switch from the home moves, its
seconds, the gradient all-reduce, and a group's predicted seconds under a plan."""

from __future__ import annotations

from hetu_ext.data.cost import CostTable
from hetu_ext.data.packing import ReplicaSpec, assign
from hetu_ext.model import inventory
from hetu_ext.model.spec import ModelSpec
from hetu_ext.plan.core.plan import Plan
from hetu_ext.plan.core.replicas import replica_specs


def _part_sizes(spec: ModelSpec) -> dict:
    """Elements of each part of a Megatron GPT model (local layer spec, learned positions): per layer what TP
    splits (the four weight matrices, the column-parallel biases) and what every TP rank holds whole (layernorms,
    the row-parallel biases); the word embeddings (vocab-parallel), positions, final layernorm, output layer."""
    h = spec.hidden_size
    split, replicated = inventory.layer_params_by_split(spec)
    position = spec.max_position_embeddings * h if spec.position_embedding_type == "learned_absolute" else 0
    return {"split": split, "replicated": replicated, "word": spec.padded_vocab_size * h, "position": position,
            "final_norm": inventory.final_norm_params(spec), "output": spec.padded_vocab_size * h}


def _holdings(plan: Plan, spec: ModelSpec) -> dict[int, list[tuple[tuple, float, float]]]:
    """rank -> (part, start, stop): the fraction [start, stop) of each part it holds; a part is (layer, "split" or
    "replicated") or ("word" | "position" | "final_norm" | "output",). A pipeline's last stage keeps its own
    copy of the word embeddings when they are tied to the output layer (Megatron's shared embedding)."""
    out: dict[int, list] = {}
    for pipeline in plan.pipelines:
        for stage in pipeline.stages:
            parts = [((layer, "split"), True) for layer in stage.layers] + \
                [((layer, "replicated"), False) for layer in stage.layers]
            if stage.has_embedding:
                parts += [(("word",), True), (("position",), False)]
            if stage.has_output:
                parts.append((("final_norm",), False))
                if spec.untie_embeddings_and_output_weights:
                    parts.append((("output",), True))
                elif not stage.has_embedding:
                    parts.append((("word",), True))
            for k, rank in enumerate(stage.ranks):  # CP ranks hold their TP rank's shard (weights replicated)
                t = k % stage.tp
                out.setdefault(rank, []).extend((part, t / stage.tp, (t + 1) / stage.tp) if split else (part, 0.0, 1.0)
                                                for part, split in parts)
    return out


def switch_elements(source: Plan, target: Plan, spec: ModelSpec) -> dict[int, float]:
    """rank -> parameter elements it must receive to hold ``target``'s shards when it holds ``source``'s: what
    a switch moves per rank, the receiving side (weights one way, gradients the other are the same volume)."""
    sizes = _part_sizes(spec)
    have, need = _holdings(source, spec), _holdings(target, spec)
    out = {}
    for rank, wanted in need.items():
        mine: dict[tuple, list[tuple[float, float]]] = {}
        for part, a, b in have.get(rank, []):
            mine.setdefault(part, []).append((a, b))
        total = 0.0
        for part, a, b in wanted:
            overlap = sum(max(0.0, min(b, d) - max(a, c)) for c, d in mine.get(part, []))
            total += (b - a - overlap) * sizes[part[-1]]
        out[rank] = total
    return out


def switch_seconds(home: Plan, target: Plan, spec: ModelSpec, *, weight_bytes: int, grad_bytes: int = 4,
                   bandwidth: float) -> float:
    """Predicted seconds of switching to ``target`` and back: the weights in (``weight_bytes`` per element) and
    the gradients out (fp32), over the slowest rank's link of ``bandwidth`` bytes/s."""
    into = switch_elements(home, target, spec)
    back = switch_elements(target, home, spec)
    ranks = set(into) | set(back)
    return max((into.get(r, 0.0) * weight_bytes + back.get(r, 0.0) * grad_bytes) / bandwidth for r in ranks)


def allreduce_seconds(plan: Plan, spec: ModelSpec, *, bandwidth: float, grad_bytes: int = 4) -> float:
    """Predicted seconds of a data-parallel gradient all-reduce under ``plan`` (ring: 2 (d-1)/d of each rank's
    gradient bytes, ``d`` the pipelines times the stage's CP degree: CP ranks hold the same weights), the
    slowest rank's."""

    worst = 0.0
    for stage in plan.pipelines[0].stages:
        d = len(plan.pipelines) * stage.cp
        if d == 1:
            continue
        elements = inventory.layer_params(spec, tp=stage.tp) * stage.num_layers
        if stage.has_embedding:
            elements += spec.padded_vocab_size * spec.hidden_size / stage.tp
        worst = max(worst, 2 * (d - 1) / d * elements * grad_bytes / bandwidth)
    return worst


def group_seconds(plan: Plan, spec: ModelSpec, cost: CostTable, lengths: list[int], max_len: int) -> float:
    """The packer's predicted time of these sequences under ``plan`` (the slowest pipeline, Hydraulis packing)."""
    replicas: list[ReplicaSpec] = replica_specs(plan, spec, cost, max_pack_tokens=max_len)
    if not lengths:
        return 0.0
    return max(assign(lengths, replicas, method="hetu").predicted_s)

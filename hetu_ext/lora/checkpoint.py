"""LobRA checkpoints (issue 16): tenants' adapters and their Adam state in hetu_ext's layout-agnostic format.

``--save DIR`` with ``--hetu-lora-tenants`` writes, through the same format as the base model's checkpoints
(hetu_ext.megatron.checkpointing with the LoRA plug-in's parts, hetu_ext.lora.plugin: the progress, the LR
schedule, the RNG and :class:`~hetu_ext.lora.plugin.AdaptersPart`, whose pieces and record are made here; the
writer hetu_ext.checkpoint.writer: each unique element once, async persist, atomic commit, retention, run
identity):

* ``param/decoder.layers.<module>.lora_{A,B}.<tenant>`` (index: the global layer) for every adapter factor (its
  fp32 master under --bf16, from which a load casts the model's bf16 copy), and
  ``exp_avg/...``, ``exp_avg_sq/...`` for those of tenants Adam has stepped; boxes as in
  hetu_ext.lora.adapters (column B split by output rows, row A split by input columns under TP);
* in the manifest's ``state``: the iteration, losses and per-tenant losses so far, the LR schedule, **each
  tenant's Adam step count** (a tenant absent from some steps has fewer), and ``lora``: every tenant's LoRA
  settings and data (what fixes its sequences of step g), the seed and the sequence length;
* each rank's RNG states (restored when the loading plan is the saving plan, as for the base model).

The frozen base is not saved: a resumed run rebuilds it from ``--seed`` (hetu_ext's layout-independent
initialisation gives every plan the same base weights) or loads it again from ``--pretrained-checkpoint``
(hetu_ext.lora.pretrained); the checkpoint records which (``state["lora"]["base"]``), and a resume on another
base is refused, as is one with another seed.

``--load DIR`` reshards the adapters and moments into the running plan (any TP / PP / DP, heterogeneous or not,
another rank count), gives each tenant's parameters Adam state at that tenant's step count, and restores the rest.
A checkpoint whose tenants differ from the tenants file (a tenant missing or added, another LoRA rank, alpha,
dropout, targets, or other data) is refused with one line naming the tenant and both values: by
:func:`check_tenants`, before any process starts (``validate_lora_args``) and again on load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hetu_ext.checkpoint import CheckpointError, LocalStorage
from hetu_ext.checkpoint.manifest import Manifest
from hetu_ext.config.tenants import TenantSpec
from hetu_ext.runtime.reshard import Piece

from .pretrained import describe, same_base, saved_base, seed_base

MOMENTS = ("exp_avg", "exp_avg_sq")
FORMAT = "lobra-adapters-v1"
"""``state["lora"]["format"]`` of an adapters checkpoint."""


# ---------------------------------------------------------------- what identifies a tenant's adapter and data


def _resolved(path: str | None) -> str | None:
    return None if path is None else str(Path(path).resolve())


def tenant_record(tenant: TenantSpec) -> dict[str, Any]:
    """A tenant's LoRA settings and data, JSON-able (stored in the manifest, compared on load)."""
    lengths = dict(tenant.lengths) if tenant.lengths is not None else None
    if lengths is not None and lengths.get("mode") == "file":
        lengths["path"] = _resolved(str(lengths.get("path")))
    lora = tenant.lora
    return {"name": tenant.name,
            "lora": {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout,
                     "targets": list(lora.targets)},
            "data": json.loads(json.dumps({"lengths": lengths, "documents": tenant.documents,
                                           "data_path": _resolved(tenant.data_path),
                                           "samples": list(tenant.samples) if tenant.samples else None,
                                           "tokens": list(tenant.tokens) if tenant.tokens else None}))}


def lora_record(tenants: tuple[TenantSpec, ...], *, seed: int, seq_length: int,
                base: dict[str, Any] | None = None) -> dict[str, Any]:
    """``base``: the frozen base the adapters are trained on (hetu_ext.lora.pretrained.base_record; default: the
    seed's); the base's weights are not saved."""
    return {"format": FORMAT, "seed": seed, "seq_length": seq_length,
            "tenants": [tenant_record(t) for t in tenants], "base": base or seed_base(seed)}


def check_tenants(saved: dict[str, Any] | None, tenants: tuple[TenantSpec, ...], *, seed: int, seq_length: int,
                  where: str, base: dict[str, Any] | None = None) -> str | None:
    """None if the checkpoint's tenants (``saved``: its ``state["lora"]``) are the tenants file's and its base
    is ``base`` (this run's, hetu_ext.lora.pretrained.base_record; default: the seed's), else one line naming the
    first difference (tenant, setting, saved and given values) and the fix."""
    if not saved or saved.get("format") != FORMAT:
        return (f"{where} is not a LoRA adapters checkpoint (no tenants recorded); --load with "
                "--hetu-lora-tenants resumes a checkpoint that a run with --hetu-lora-tenants saved")
    was, now = saved_base(saved), base or seed_base(seed)
    if not same_base(was, now):  # LobRA pretrained base (issue 16)
        return (f"{where} holds adapters trained on {describe(was)}, but this run's base is {describe(now)}; "
                "resume on the base the adapters were trained on (the same --pretrained-checkpoint, or none)")
    fix = "resume with the tenants file the checkpoint was saved with"
    for name, value, now in (("--seed", saved.get("seed"), seed), ("--seq-length", saved.get("seq_length"),
                                                                      seq_length)):
        if value != now:
            return (f"{where} was saved with {name} {value}, this run has {now}: the frozen base (rebuilt from the "
                    f"seed) or the tenants' sequences would differ; resume with {name} {value}")
    old = {t["name"]: t for t in saved.get("tenants", [])}
    new = {t.name: tenant_record(t) for t in tenants}
    missing, added = [n for n in old if n not in new], [n for n in new if n not in old]
    if missing:
        return (f"{where} holds tenant {missing[0]!r} (tenants {sorted(old)}), which the tenants file does not "
                f"have (tenants {sorted(new)}); {fix}")
    if added:
        return (f"tenant {added[0]!r} of the tenants file is not in {where} (tenants {sorted(old)}, the file has "
                f"{sorted(new)}); {fix}")
    for name, record in new.items():
        for part in ("lora", "data"):
            for key, value in record[part].items():
                was = old[name].get(part, {}).get(key)
                if was != value:
                    label = f"LoRA {key}" if part == "lora" else key
                    return (f"tenant {name!r}: {where} has {label} {was!r}, the tenants file {value!r}; {fix}")
    return None


# ---------------------------------------------------------------- pieces and per-tenant Adam steps


def _optimizer_states(optimizer) -> dict[int, tuple[Any, torch.nn.Parameter]]:
    """parameter id -> (the torch optimizer holding it, the parameter)."""
    inners = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    return {id(p): (opt, p) for opt in inners for group in opt.param_groups for p in group["params"]}


def _shards(placement):
    from .adapters import adapter_shards  # Megatron-core: not imported by the launcher's checks

    return adapter_shards(placement.model, layer_offset=placement.shard_kwargs.get("layer_offset", 0))


def _stepped(param: torch.nn.Parameter) -> torch.Tensor:
    """What the optimizer steps for a model parameter: its fp32 master under --bf16, else the parameter."""
    master = getattr(param, "main_param", None)
    return param if master is None else master


def cast_masters_down(placement) -> None:
    """--bf16: the model's adapter weights from their fp32 masters, as after an optimizer step (after a load)."""
    if not placement.active:
        return
    for inner in getattr(placement.optimizer, "chained_optimizers", [placement.optimizer]):
        if getattr(inner, "float16_groups", None):
            inner._copy_main_params_to_model_params()
    sharded = getattr(placement.optimizer, "hetu_sharded", None)
    if sharded is not None:  # --use-distributed-optimizer: the owners' boxes to every holder
        sharded.sync.gather()


def adapter_pieces(placement, *, steps: dict[str, float | None] | None = None) -> list[Piece]:
    """This rank's adapter factors and their Adam moments as pieces (empty on idle ranks). With ``steps``
    (loading: tenant -> its Adam step, None if never stepped), every adapter parameter first gets Adam state at
    its tenant's step (zero moments, to be filled), or none."""
    if not placement.active:
        return []
    sharded = getattr(placement.optimizer, "hetu_sharded", None)
    if sharded is not None:
        return _sharded_pieces(placement, sharded, steps)
    held = _optimizer_states(placement.optimizer)
    pieces = []
    for s in _shards(placement):
        opt, param = held[id(_stepped(s.param))]  # under --bf16 the fp32 master: its weights and Adam state
        if steps is not None:
            step = steps.get(s.tenant)
            opt.state.pop(param, None)
            if step is not None:
                opt.state[param] = {"step": torch.tensor(float(step), dtype=torch.float32),
                                    **{m: torch.zeros_like(param.data) for m in MOMENTS}}
        box = tuple((sl.start, sl.stop) for sl in s.slices)
        pieces.append(Piece(f"param/{s.key}", s.index, box, s.view(param.data)))
        state = opt.state.get(param, {})
        pieces.extend(Piece(f"{m}/{s.key}", s.index, box, s.view(state[m])) for m in MOMENTS if m in state)
    return pieces


def _owned(placement, sharded):
    """--use-distributed-optimizer: (tenant, owned box, what the optimizer steps for it) for every box this rank
    owns: the box's view, or under --bf16 its fp32 master."""
    tenant_of = {id(s.param): s.tenant for s in _shards(placement)}
    return [(tenant_of[id(owned.local.param)], owned, getattr(view, "main_param", view))
            for owned, view in sharded.params]


def _sharded_pieces(placement, sharded, steps) -> list[Piece]:
    """adapter_pieces with --use-distributed-optimizer: Adam state of the owned boxes only; the weights from every
    holder (fp32) or the owned boxes' fp32 masters (--bf16; a load casts and all-gathers them after)."""
    opt = sharded.optimizer.optimizer
    pieces = []
    owned_boxes = _owned(placement, sharded)
    fp32 = all(getattr(view, "main_param", None) is None for _, view in sharded.params)
    if fp32:
        for s in _shards(placement):
            pieces.append(Piece(f"param/{s.key}", s.index, tuple((sl.start, sl.stop) for sl in s.slices),
                                s.view(s.param.data)))
    for tenant, owned, held in owned_boxes:
        key, index, box = owned.cell.key, owned.cell.index, owned.box
        if steps is not None:
            step = steps.get(tenant)
            opt.state.pop(held, None)
            if step is not None:
                opt.state[held] = {"step": torch.tensor(float(step), dtype=torch.float32),
                                   **{m: torch.zeros_like(held.data) for m in MOMENTS}}
        if not fp32:
            pieces.append(Piece(f"param/{key}", index, box, held.data))
        state = opt.state.get(held, {})
        pieces.extend(Piece(f"{m}/{key}", index, box, state[m]) for m in MOMENTS if m in state)
    return pieces


def local_tenant_steps(placement) -> dict[str, float | None]:
    """Tenant -> Adam's step count of its local adapter parameters (None: never stepped); they must agree."""
    if not placement.active:
        return {}
    found: dict[str, set] = {}
    sharded = getattr(placement.optimizer, "hetu_sharded", None)
    if sharded is not None:
        for tenant, _, held in _owned(placement, sharded):
            state = sharded.optimizer.optimizer.state.get(held, {})
            found.setdefault(tenant, set()).add(float(state["step"]) if "step" in state else None)
    held = _optimizer_states(placement.optimizer) if sharded is None else {}
    for s in _shards(placement) if sharded is None else []:
        opt, param = held[id(_stepped(s.param))]
        state = opt.state.get(param, {})
        found.setdefault(s.tenant, set()).add(float(state["step"]) if "step" in state else None)
    bad = {t: sorted(v, key=lambda x: -1 if x is None else x) for t, v in found.items() if len(v) > 1}
    if bad:
        raise AssertionError(f"a tenant's adapter parameters are at different Adam steps: {bad}")
    return {t: v.pop() for t, v in found.items()}


def tenant_steps(placement, tenants: tuple[TenantSpec, ...]) -> dict[str, float | None]:
    """Every tenant's Adam step over the plan (collective over the used ranks of ``placement``)."""
    mine = local_tenant_steps(placement)
    everyone: list = [None] * dist.get_world_size(placement.report_group)
    dist.all_gather_object(everyone, mine, group=placement.report_group)
    out: dict[str, float | None] = {}
    for part in everyone:
        for tenant, step in part.items():
            if out.setdefault(tenant, step) != step:
                raise AssertionError(f"tenant {tenant!r} is at Adam step {out[tenant]} on one rank, {step} on another")
    return {t.name: out.get(t.name) for t in tenants}


# ---------------------------------------------------------------- save and load


def latest_manifest(directory: str) -> Manifest | None:
    """The manifest of the latest committed hetu checkpoint under ``directory`` (pure), or None if there is
    none (a run then starts from scratch, as without tenants)."""
    from hetu_ext.checkpoint.reader import candidates, read_manifest

    storage = LocalStorage(directory)
    order = candidates(storage, fallback=False)
    if not order:
        return None
    return read_manifest(storage, order[0])


# ---------------------------------------------------------------- PEFT export of a saved checkpoint


def export_peft(directory: str, out: str, *, base: str | None = None, tenants: list[str] | None = None
                ) -> list[Path]:
    """Each tenant's adapter of the latest adapters checkpoint under ``directory`` in the PEFT format,
    ``out/<tenant>/`` (hetu_ext.lora.peft.write_peft; pure: one process reads the shards). ``base``: the
    ``base_model_name_or_path`` written into adapter_config.json (the Hugging Face GPT-2 export of the base)."""
    from hetu_ext.checkpoint.reader import ShardReader
    from hetu_ext.config.spec import recorded_model_spec
    from hetu_ext.config.tenants import LoRASettings

    from .peft import write_peft

    if not Path(directory).is_dir():
        raise CheckpointError(f"{directory}: no such directory; give the --save directory of a run with "
                              "--hetu-lora-tenants")
    manifest = latest_manifest(directory)
    if manifest is None:
        raise CheckpointError(f"{directory}: holds no committed checkpoint (no iter_NNNNNNN/manifest.json)")
    where = f"{directory} (iteration {manifest.iteration})"
    saved = manifest.state.get("lora")
    if not saved or saved.get("format") != FORMAT:
        raise CheckpointError(f"{where} is not a LoRA adapters checkpoint (no tenants recorded); export-peft reads "
                              "what a run with --hetu-lora-tenants saved")
    records = {t["name"]: t for t in saved["tenants"]}
    unknown = [t for t in tenants or () if t not in records]
    if unknown:
        raise CheckpointError(f"{where} has no tenant {unknown[0]!r}; its tenants are {sorted(records)}")
    heads = manifest.config.get("num_attention_heads")
    model = recorded_model_spec(manifest.config, where) if manifest.config.get("swiglu") else None
    full = ShardReader(LocalStorage(directory), manifest).read_full(
        [t.name for t in manifest.tensors if t.name.startswith("param/")])
    stacked: dict[str, list] = {}
    for (name, index), value in sorted(full.items()):
        stacked.setdefault(name.split("/", 1)[1], []).append((index, value))
    adapters = {key: torch.stack([v for _, v in sorted(parts)]) for key, parts in stacked.items()}
    written = []
    for name in tenants or list(records):
        lora = records[name]["lora"]
        spec = TenantSpec(name=name, samples=(1,), lora=LoRASettings(
            rank=lora["rank"], alpha=lora["alpha"], dropout=lora["dropout"], targets=tuple(lora["targets"])))
        written.append(write_peft(Path(out) / name, adapters, spec, num_attention_heads=heads, base=base,
                                  spec=model))
    return written

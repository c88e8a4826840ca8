"""``python -m hetu_ext.checkpoint inspect|verify|convert``: look into, check and export hetu checkpoints.

* ``inspect PATH``: iteration, data position, the saving plan, files and tensors (shape, dtype, shard count).
* ``verify PATH [--all]``: the manifest's checksum, every file's size and header, every shard's CRC-32; with
  ``--all`` every committed checkpoint under the directory. Prints one line per checkpoint, ``OK`` or ``BAD``
  with the error; exit code 2 if any is bad.
* ``convert PATH OUT.safetensors [--kind param]``: one plain safetensors file of full tensors (one kind:
  ``param``, ``master``, ``exp_avg``, ``exp_avg_sq``), per-layer names ``decoder.layers.3.mlp...``.
* ``convert PATH OUTDIR --to torch_dist``: a Megatron-core dist_checkpointing checkpoint (``OUTDIR/iter_N``).
* ``convert PATH OUTDIR --to hf-gpt2``: a Hugging Face GPT-2 directory (config.json, model.safetensors) that
  ``GPT2LMHeadModel.from_pretrained`` loads.

PATH is a ``--save`` directory (the checkpoint its ``latest_checkpointed_iteration.txt`` names, as ``--load``
reads) or one ``iter_NNNNNNN`` directory in it, or a DeepSpeed
ZeRO-1/2/3 ``save_checkpoint`` directory (or one of its tags): ``inspect`` and ``convert`` (safetensors, torch_dist)
read it directly. Bad input
(missing path, corrupt checkpoint, unknown kind) ends with one ``error:`` line and exit code 2.
"""
# Other frameworks' formats (DeepSpeed) come in through ``formats`` (checkpoint/formats.py), which the entry
# point __main__.py fills: this module imports no host framework.

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from .formats import ForeignCheckpoints, recognising
from .gated import is_gated, to_megatron
from .manifest import CheckpointError, Manifest
from .reader import ShardReader, candidates, read_manifest
from .storage import LocalStorage
from .writer import ITER_DIR, complete_iterations


def _locate(path: str) -> tuple[LocalStorage, int]:
    """(storage of the save directory, iteration) for a save directory or one of its iter_ directories."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"{path}: no such directory; give a --save directory or one of its iter_NNNNNNN")
    m = ITER_DIR.match(p.name)
    if m:
        return LocalStorage(p.parent), int(m.group(1))
    storage = LocalStorage(p)
    order = candidates(storage, fallback=False)
    if not order:
        raise CheckpointError(f"{path}: holds no committed hetu checkpoint (no iter_NNNNNNN/manifest.json)")
    return storage, order[0]


def _describe(m: Manifest) -> list[str]:
    from hetu_ext.plan import format_plan, plan_from_dict

    lines = [f"iteration {m.iteration}, consumed samples {m.consumed_samples}, written by {m.world_size} rank(s), "
             f"{len(m.files)} file(s), {m.total_bytes / 2**20:.2f} MiB"]
    if m.plan:
        lines += ["", "saved under the plan:", format_plan(plan_from_dict(m.plan))]
    lines += ["", f"{'tensor':<60} {'index':<6} {'shape':<16} {'dtype':<5} shards"]
    for t in m.tensors:
        note = "  gated: [gate; up]" if is_gated(t.name, t.shape) else ""
        lines.append(f"{t.name:<60} {','.join(map(str, t.index)):<6} {'x'.join(map(str, t.shape)):<16} "
                     f"{t.dtype:<5} {len(t.shards)}{note}")
    return lines


def _size_problems(reader: ShardReader) -> list[str]:
    """Shard files that are missing or whose size differs from the manifest's (a truncated copy, say)."""
    out = []
    for f in reader.manifest.files:
        path = reader.storage.local_path(f"{reader.directory}/{f.name}")
        if not os.path.exists(path):
            out.append(f"{path}: missing shard file (the manifest lists it)")
        elif os.path.getsize(path) != f.size:
            out.append(f"{path}: {os.path.getsize(path)} bytes but the manifest says {f.size}: the shard file is "
                       "truncated or was overwritten")
    return out


def _verify_all(path: str) -> tuple[list[str], list[str]]:
    """One line per committed checkpoint under ``path``, OK or BAD with its error; and the errors."""
    storage = LocalStorage(path)
    iterations = complete_iterations(storage)
    if not iterations:
        raise CheckpointError(f"{path}: holds no committed hetu checkpoint")
    lines, errors = [], []
    for iteration in iterations:
        try:
            manifest = read_manifest(storage, iteration)
            checked = ShardReader(storage, manifest).verify()
        except CheckpointError as e:
            lines.append(f"BAD: iteration {iteration}: {e}")
            errors.append(f"iteration {iteration}")
            continue
        lines.append(_ok(manifest, checked))
    return lines, errors


def _ok(manifest: Manifest, checked: int) -> str:
    return (f"OK: iteration {manifest.iteration}: manifest, {len(manifest.files)} file(s) and "
            f"{sum(len(t.shards) for t in manifest.tensors)} shard(s) ({checked / 2**20:.2f} MiB) verified")


def _full_of(reader: ShardReader, kind: str) -> dict:
    """Every full tensor of one kind (``param``, ``master``, ``exp_avg``, ...) of the reader's checkpoint."""
    return reader.read_full({t.name for t in reader.manifest.tensors if t.name.startswith(kind + "/")})


def _export_name(name: str, index: tuple[int, ...]) -> str:
    key = name.split("/", 1)[1]
    if index and key.startswith("decoder.layers."):
        return f"decoder.layers.{index[0]}.{key[len('decoder.layers.'):]}"
    return key


def _export_tensors(full: dict) -> dict:
    """Full tensors by exported name: a layer's tensor under ``decoder.layers.L.KEY`` (a gated fc1 as Megatron's
    ``[gate; up]``); an expert tensor (Megatron-core's ``experts.experts.`` keys, its last index the expert) as its
    layer's one global expert tensor, the experts stacked along a leading axis ``(E, ...)``, every expert present."""
    import torch

    out, experts = {}, {}
    for (name, index), t in full.items():
        t = to_megatron(t) if is_gated(name, tuple(t.shape)) else t
        if ".experts.experts." in name:
            experts.setdefault(_export_name(name, index[:-1]), {})[index[-1]] = t
        else:
            out[_export_name(name, index)] = t
    for name, by_expert in experts.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise CheckpointError(f"{name}: the checkpoint holds experts {sorted(by_expert)}; a global expert "
                                  "tensor needs every expert 0..E-1")
        out[name] = torch.stack([by_expert[e] for e in range(len(by_expert))])
    return out


def run(args: argparse.Namespace, formats: Sequence[ForeignCheckpoints] = ()) -> tuple[list[str], str | None]:
    """The lines to print, and an error (one line) when the command found a bad checkpoint after printing.
    A directory one of ``formats`` recognises is read by that format (DeepSpeed ZeRO: no offline step either)."""
    foreign = recognising(formats, args.path) if Path(args.path).is_dir() else None
    if foreign is not None:
        return foreign.cli_lines(args.command, args.path, getattr(args, "output", None),
                                 getattr(args, "kind", "param"), getattr(args, "to", "safetensors")), None
    if args.command == "import-hf":
        return import_hf(args.path, args.output), None
    if args.command == "verify" and args.all:
        lines, bad = _verify_all(args.path)
        error = f"{len(bad)} of {len(lines)} checkpoint(s) failed verification ({', '.join(bad)})" if bad else None
        return lines, error
    storage, iteration = _locate(args.path)
    manifest = read_manifest(storage, iteration)
    reader = ShardReader(storage, manifest)
    if args.command == "inspect":
        problems = _size_problems(reader)
        lines = _describe(manifest) + [f"BAD: {p}" for p in problems]
        return lines, (f"iteration {iteration}: {len(problems)} shard file(s) do not match the manifest; "
                       f"'verify' checks every checksum") if problems else None
    if args.command == "verify":
        return [_ok(manifest, reader.verify())], None
    if args.to == "hf":  # the architecture the model is: a gated MLP is the Llama family's, else GPT-2's
        gated = manifest.state.get("hf_config") or manifest.config.get("swiglu")
        args.to = "hf-llama" if gated else "hf-gpt2"
    if args.to == "torch_dist":
        from .torch_dist import export

        count = export(reader.read_full(), args.output, iteration=iteration,
                       optimizer_step=manifest.state.get("optimizer_step"))
        return [f"wrote a dist_checkpointing checkpoint ({count} tensors, iteration {iteration}) to "
                f"{args.output}"], None
    if args.to in ("hf-gpt2", "hf-llama") and manifest.config.get("apply_layernorm_1p"):
        raise CheckpointError(f"{args.path}: trained with --apply-layernorm-1p (norm weights stored as gamma - 1, "
                              "Megatron's layout); converting it to Hugging Face is not built: convert --to "
                              "torch_dist or safetensors keeps Megatron's layout")
    if args.to == "hf-gpt2":
        from .hf import write_gpt2

        heads = manifest.config.get("num_attention_heads")
        if not heads:
            raise CheckpointError(f"{args.path}: the manifest records no num_attention_heads; it was not saved "
                                  "by pretrain_gpt.py, so the GPT-2 layout is unknown")
        params = _full_of(reader, "param")
        count = write_gpt2(args.output, params, num_attention_heads=int(heads))
        return [f"wrote a GPT-2 model ({count} tensors, iteration {iteration}) to {args.output}"], None
    if args.to == "hf-llama":
        from .hf_llama import hf_config_of, spec_from_hf, to_hf, write_hf

        config = manifest.state.get("hf_config")  # imported with import-hf: its own config, kept
        if not config:  # trained from scratch: the config of the model its flags describe
            from hetu_ext.config.spec import recorded_model_spec

            try:
                config = hf_config_of(recorded_model_spec(manifest.config, f"{args.path}'s manifest"))
            except ValueError as exc:
                raise CheckpointError(f"{args.path}: {exc}") from None
        params = _full_of(reader, "param")
        count = write_hf(args.output, to_hf(params, spec_from_hf(config), config["architectures"][0]), config)
        return [f"wrote a {config['architectures'][0]} model ({count} tensors, iteration {iteration}) to "
                f"{args.output}"], None
    kinds = sorted({t.name.split("/", 1)[0] for t in manifest.tensors})
    if args.kind not in kinds:
        raise CheckpointError(f"--kind {args.kind}: the checkpoint holds {kinds}; pick one of them")
    from safetensors.torch import save_file

    tensors = _export_tensors(_full_of(reader, args.kind))
    save_file(tensors, args.output, metadata={"iteration": str(iteration), "kind": args.kind})
    return [f"wrote {len(tensors)} tensors ({args.kind}, iteration {iteration}) to {args.output}"], None


def import_hf(hf_dir: str, output: str) -> list[str]:
    """Write the Hugging Face model in ``hf_dir`` as a hetu checkpoint (iteration 0, weights only) in ``output``,
    from one process; the manifest keeps the model's settings as flags and its Hugging Face config."""
    import os
    import tempfile

    import torch.distributed as dist

    from hetu_ext.plan import plan_to_dict, uniform_plan
    from hetu_ext.runtime.reshard import Piece

    from .hf_llama import from_hf, read_config, read_state, spec_from_hf
    from .writer import Checkpointer, SaveConfig

    config = read_config(hf_dir)
    spec = spec_from_hf(config)
    full = from_hf(read_state(hf_dir), spec, config["architectures"][0])
    pieces = [Piece(name, index, tuple((0, d) for d in t.shape), t) for (name, index), t in full.items()]
    flags = {"num_layers": spec.num_layers, "hidden_size": spec.hidden_size,
             "num_attention_heads": spec.num_attention_heads, "ffn_hidden_size": spec.ffn_hidden_size,
             "max_position_embeddings": spec.max_position_embeddings, "seq_length": spec.seq_length,
             "untie_embeddings_and_output_weights": spec.untie_embeddings_and_output_weights, "swiglu": True,
             "normalization": "RMSNorm", "position_embedding_type": "rope", "group_query_attention": True,
             "num_query_groups": spec.num_query_groups, "kv_channels": spec.kv_channels,
             "disable_bias_linear": True, "add_qkv_bias": spec.add_qkv_bias, "norm_epsilon": spec.norm_epsilon,
             "rotary_base": spec.rotary_base, "use_rope_scaling": spec.rope_scaling,
             "rope_scaling_factor": spec.rope_scaling_factor}
    own_group = not dist.is_initialized()
    if own_group:  # the writer is collective: a group of this one process
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="hetu_import_"), "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        Path(output).mkdir(parents=True, exist_ok=True)
        plan = uniform_plan(world_size=1, tp=1, pp=1, num_layers=spec.num_layers)
        Checkpointer(LocalStorage(output), SaveConfig(keep=1)).save(
            iteration=0, pieces=pieces, rng={}, blocking=True,
            info={"consumed_samples": 0, "plan": plan_to_dict(plan), "config": flags,
                  "state": {"hf_config": config, "vocab_size": spec.vocab_size}})
    finally:
        if own_group:
            dist.destroy_process_group()
    return [f"imported {config['architectures'][0]} ({len(pieces)} tensors, {spec.num_layers} layers, "
            f"{spec.num_query_groups} query groups) from {hf_dir} into {output}"]


def main(argv: list[str] | None = None, formats: Sequence[ForeignCheckpoints] = ()) -> int:
    """Run the CLI on ``argv`` (default: ``sys.argv[1:]``), reading the foreign ``formats`` too; the exit code.
    ``python -m hetu_ext.checkpoint`` passes DeepSpeed's (hetu_ext/checkpoint/__main__.py)."""
    parser = argparse.ArgumentParser(prog="python -m hetu_ext.checkpoint", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("inspect", help="print what a checkpoint holds").add_argument("path")
    verify = sub.add_parser("verify", help="check every checksum of a checkpoint")
    verify.add_argument("path")
    verify.add_argument("--all", action="store_true", help="every committed checkpoint under the directory")
    convert = sub.add_parser("convert", help="export full tensors to one plain safetensors file")
    convert.add_argument("path")
    convert.add_argument("output")
    convert.add_argument("--kind", default="param", help="param (default), master, exp_avg or exp_avg_sq")
    convert.add_argument("--to", choices=["safetensors", "torch_dist", "hf", "hf-gpt2", "hf-llama"],
                         default="safetensors",
                         help="safetensors: one file of full tensors; torch_dist: Megatron's dist_checkpointing; "
                              "hf-gpt2: a Hugging Face GPT-2 directory; hf-llama: a Hugging Face Llama-family "
                              "directory (an import-hf model keeps its architecture: Llama, Mistral, Qwen2; one "
                              "trained here becomes LlamaForCausalLM, Qwen2ForCausalLM with --add-qkv-bias); hf: "
                              "whichever of the two the model is")
    imp = sub.add_parser("import-hf", help="a Hugging Face Llama / Mistral / Qwen2 directory as a hetu checkpoint "
                                           "(weights only; --load, --pretrained-checkpoint and the reshard engine "
                                           "take it into any plan)")
    imp.add_argument("path", help="the Hugging Face model directory (config.json, *.safetensors)")
    imp.add_argument("output", help="the hetu checkpoint directory to write")
    args = parser.parse_args(argv)
    from hetu_ext.hostlog import quiet_host_frameworks

    quiet_host_frameworks()  # DeepSpeed folders import DeepSpeed (and through it Apex / Transformer Engine probes)
    try:
        lines, error = run(args, formats)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines), flush=True)
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0

"""``python -m hetu_ext.checkpoint inspect|verify|convert``: look into, check and export hetu checkpoints.

* ``inspect PATH``: iteration, data position, the saving plan, files and tensors (shape, dtype, shard count).
* ``verify PATH [--all]``: the manifest's checksum, every file's size and header, every shard's CRC-32; with
  ``--all`` every committed checkpoint under the directory. Prints one ``OK`` line per checkpoint.
* ``convert PATH OUT.safetensors [--kind param]``: one plain safetensors file of full tensors (one kind:
  ``param``, ``master``, ``exp_avg``, ``exp_avg_sq``), per-layer names ``decoder.layers.3.mlp...``.
* ``convert PATH OUTDIR --to torch_dist``: a Megatron-core dist_checkpointing checkpoint (``OUTDIR/iter_N``).
* ``convert PATH OUTDIR --to hf-gpt2``: a Hugging Face GPT-2 directory (config.json, model.safetensors) that
  ``GPT2LMHeadModel.from_pretrained`` loads.

PATH is a ``--save`` directory (its latest checkpoint) or one ``iter_NNNNNNN`` directory in it, or a DeepSpeed
ZeRO-1/2/3 ``save_checkpoint`` directory (or one of its tags): ``inspect`` and ``convert`` (safetensors, torch_dist)
read it directly. Bad input
(missing path, corrupt checkpoint, unknown kind) ends with one ``error:`` line and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .manifest import CheckpointError, Manifest
from .reader import ShardReader, candidates, read_manifest
from .storage import LocalStorage
from .writer import _ITER, complete_iterations


def _locate(path: str) -> tuple[LocalStorage, int]:
    """(storage of the save directory, iteration) for a save directory or one of its iter_ directories."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"{path}: no such directory; give a --save directory or one of its iter_NNNNNNN")
    m = _ITER.match(p.name)
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
        lines.append(f"{t.name:<60} {','.join(map(str, t.index)):<6} {'x'.join(map(str, t.shape)):<16} "
                     f"{t.dtype:<5} {len(t.shards)}")
    return lines


def _export_name(name: str, index: tuple[int, ...]) -> str:
    key = name.split("/", 1)[1]
    if index and key.startswith("decoder.layers."):
        return f"decoder.layers.{index[0]}.{key[len('decoder.layers.'):]}"
    return key


def run(args: argparse.Namespace) -> list[str]:
    from .deepspeed_zero import cli_lines, is_deepspeed

    if Path(args.path).is_dir() and is_deepspeed(args.path):  # DeepSpeed ZeRO: no offline step either
        return cli_lines(args.command, args.path, getattr(args, "output", None), getattr(args, "kind", "param"),
                         getattr(args, "to", "safetensors"))
    if args.command == "verify" and args.all:
        storage = LocalStorage(args.path)
        iterations = complete_iterations(storage)
        if not iterations:
            raise CheckpointError(f"{args.path}: holds no committed hetu checkpoint")
    else:
        storage, iteration = _locate(args.path)
        iterations = [iteration]
    out = []
    for iteration in iterations:
        manifest = read_manifest(storage, iteration)
        reader = ShardReader(storage, manifest)
        if args.command == "inspect":
            out += _describe(manifest)
        elif args.command == "verify":
            checked = reader.verify()
            out.append(f"OK: iteration {iteration}: manifest, {len(manifest.files)} file(s) and "
                       f"{sum(len(t.shards) for t in manifest.tensors)} shard(s) ({checked / 2**20:.2f} MiB) verified")
        elif args.to == "torch_dist":
            from .torch_dist import export

            count = export(reader.read_full(), args.output, iteration=iteration,
                           optimizer_step=manifest.state.get("optimizer_step"))
            out.append(f"wrote a dist_checkpointing checkpoint ({count} tensors, iteration {iteration}) to "
                       f"{args.output}")
        elif args.to == "hf-gpt2":
            from .hf import write_gpt2

            heads = manifest.config.get("num_attention_heads")
            if not heads:
                raise CheckpointError(f"{args.path}: the manifest records no num_attention_heads; it was not saved "
                                      "by pretrain_gpt.py, so the GPT-2 layout is unknown")
            params = reader.read_full({t.name for t in manifest.tensors if t.name.startswith("param/")})
            count = write_gpt2(args.output, params, num_attention_heads=int(heads))
            out.append(f"wrote a GPT-2 model ({count} tensors, iteration {iteration}) to {args.output}")
        else:
            kinds = sorted({t.name.split("/", 1)[0] for t in manifest.tensors})
            if args.kind not in kinds:
                raise CheckpointError(f"--kind {args.kind}: the checkpoint holds {kinds}; pick one of them")
            from safetensors.torch import save_file

            full = reader.read_full({t.name for t in manifest.tensors if t.name.startswith(args.kind + "/")})
            tensors = {_export_name(name, index): t for (name, index), t in full.items()}
            save_file(tensors, args.output, metadata={"iteration": str(iteration), "kind": args.kind})
            out.append(f"wrote {len(tensors)} tensors ({args.kind}, iteration {iteration}) to {args.output}")
    return out


def main(argv: list[str] | None = None) -> int:
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
    convert.add_argument("--to", choices=["safetensors", "torch_dist", "hf-gpt2"], default="safetensors",
                         help="safetensors: one file of full tensors; torch_dist: Megatron's dist_checkpointing; "
                              "hf-gpt2: a Hugging Face GPT-2 directory")
    args = parser.parse_args(argv)
    try:
        lines = run(args)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0

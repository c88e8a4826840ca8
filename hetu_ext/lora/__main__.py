"""``python -m hetu_ext.lora export-peft --load DIR --out OUT [--base HF_DIR] [--tenant NAME ...]``.

Writes each tenant's adapter of the latest adapters checkpoint under ``DIR`` (what ``--save`` wrote with
``--hetu-lora-tenants``) in the PEFT format, ``OUT/<tenant>/adapter_config.json`` and
``adapter_model.safetensors`` (hetu_ext.lora.checkpoint.export_peft), for the Hugging Face GPT-2 export of the
base. One process, no Megatron. Bad input ends with one ``error:`` line and exit code 2.
"""

from __future__ import annotations

import argparse
import sys

PROG = "python -m hetu_ext.lora"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description="LobRA adapters: export from a checkpoint")
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export-peft", help="each tenant's adapter of a checkpoint in the PEFT format")
    export.add_argument("--load", required=True, help="the --save directory of a run with --hetu-lora-tenants")
    export.add_argument("--out", required=True, help="output directory: one folder per tenant")
    export.add_argument("--base", default=None,
                        help="base_model_name_or_path for adapter_config.json (the GPT-2 export of the base)")
    export.add_argument("--tenant", action="append", default=None, help="export only this tenant (repeatable)")
    args = parser.parse_args(argv)
    from .checkpoint import export_peft

    try:
        written = export_peft(args.load, args.out, base=args.base, tenants=args.tenant)
    except (ValueError, OSError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}/adapter_config.json and adapter_model.safetensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())

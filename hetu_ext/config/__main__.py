"""``python -m hetu_ext.config --markdown [-o FILE]``: the configuration reference page, from the schema."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .markdown import render_markdown


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hetu_ext.config",
                                     description="Print the configuration reference generated from the schema.")
    parser.add_argument("--markdown", action="store_true", required=True,
                        help="Markdown tables, one per section (docs/configuration.md)")
    parser.add_argument("-o", "--output", metavar="FILE", help="write here instead of standard output")
    args = parser.parse_args(argv)
    text = render_markdown()
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

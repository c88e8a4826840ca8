"""Command line and ``--hetu-config`` file -> :class:`RunConfig`, with one precedence rule.

Precedence: defaults < the ``--hetu-config`` file < flags the user typed. It is argparse's own: the file's values
become the parser's defaults (``set_defaults``) before the command line is parsed, so a typed flag wins even when
it equals the default (the previous rule, "a flag equal to its default counts as not given", let the file override
an explicit ``--hetu-runtime auto``). No extra dependency: the dataclasses of :mod:`.schema` generate the flags,
and the file is checked key by key against the same dataclasses (:func:`hetu_ext.keys.check_keys`).

The file (YAML) holds any setting, Megatron's included, one section per component::

    model: {num_layers: 4, hidden_size: 64, num_attention_heads: 4, seq_length: 128}
    training: {micro_batch_size: 2, global_batch_size: 8, train_iters: 20, lr: 1.0e-3}
    data: {mock_data: true}
    parallel: {plan: plans/hetero_2pipes.yaml}     # paths are relative to the file
    packing: {method: balanced, varlen_mock: {mode: file, path: lengths.txt.gz}}

The top-level keys ``plan``, ``runtime`` and ``cpu_patches`` of earlier files are read as ``parallel.*``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import sys
import time
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from hetu_ext.keys import check_keys, read_yaml

from .schema import SECTIONS, RunConfig, dest_of, flag_of

LEGACY_TOP_LEVEL = {"plan": "parallel", "runtime": "parallel", "cpu_patches": "parallel"}
"""Keys earlier ``--hetu-config`` files held at the top level, and the section they belong to."""


OTHER_RANKS_WAIT_S = 3.0
"""How long a rank other than 0 waits before it exits on bad input: every rank finds the same error, and torchrun
stops the whole job at the first exit, so rank 0 must have printed the line by then."""


def report_error(prog: str, message: str) -> None:
    """Print ``prog: error: message`` once per job: rank 0 of a torchrun job prints, other ranks stay silent and
    wait a moment before the caller exits (see OTHER_RANKS_WAIT_S)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    else:
        time.sleep(OTHER_RANKS_WAIT_S)


class FlagParser(argparse.ArgumentParser):
    """argparse with one-line errors: no usage block, the closest valid flag for an unknown one, rank 0 only
    (torchrun starts one parser per rank; 4 ranks printed the 54-line usage block 4 times)."""

    def parse_known_args(self, args=None, namespace=None):
        # an unknown flag first: a typo of a required flag (--num-layer) would else read "--num-layers is required"
        tokens = sys.argv[1:] if args is None else list(args)
        known = {s for a in self._actions for s in a.option_strings}
        unknown = [t for t in tokens if t.startswith("--") and t != "--" and t.split("=", 1)[0] not in known]
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}")
        return super().parse_known_args(args, namespace)

    def error(self, message: str):  # argparse's hook for every parse error
        if message.startswith("unrecognized arguments:"):
            message += self._suggestion(message.split(":", 1)[1].split())
        report_error(self.prog, message)
        sys.exit(2)

    def _suggestion(self, unknown: list[str]) -> str:
        flags = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
        for token in unknown:
            if token.startswith("--"):
                close = difflib.get_close_matches(token.split("=", 1)[0], flags, n=1, cutoff=0.6)
                if close:
                    return f"; did you mean {close[0]}? ({self.prog} --help lists every flag)"
        return f" ({self.prog} --help lists every flag)"


def _base_type(annotation: Any) -> type:
    """int / float / str / bool / tuple of a field's annotation (``X | None`` -> X)."""
    hint = annotation
    if isinstance(hint, str):
        hint = eval(hint, {"tuple": tuple, "str": str, "int": int, "float": float, "bool": bool})  # noqa: S307
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return typing.get_origin(hint) or hint


def section_flag_specs(cls: type) -> list[tuple[str, dict[str, Any]]]:
    """``(flag, argparse keywords)`` of every setting of one schema section, in field order: what
    :func:`add_section_flags` declares (bool settings ``store_true``; ``required`` settings default to None, as
    they are checked after the file is merged). Other command lines (the planners') draw their flags from it."""
    specs = []
    for f in dataclasses.fields(cls):
        meta, kind = f.metadata, _base_type(f.type)
        kwargs: dict[str, Any] = {"dest": dest_of(f), "help": meta.get("help") or None}
        if kind is bool:
            specs.append((flag_of(f), {**kwargs, "action": "store_true", "default": f.default}))
            continue
        kwargs.update(type=str if kind is tuple else kind, default=None if meta.get("required") else f.default)
        for key in ("choices", "nargs", "metavar"):
            if meta.get(key) is not None:
                kwargs[key] = meta[key]
        specs.append((flag_of(f), kwargs))
    return specs


def add_section_flags(parser: argparse.ArgumentParser, section: str, cls: type) -> None:
    """The flags of one section as one argument group (``required`` settings are checked after the file is
    merged, so argparse does not require them)."""
    group = parser.add_argument_group(section, (cls.__doc__ or "").strip().splitlines()[0])
    for flag, kwargs in section_flag_specs(cls):
        group.add_argument(flag, **kwargs)


def build_parser(prog: str = "pretrain_gpt.py", sections: dict[str, type] = SECTIONS,
                 description: str = "Train Megatron-core's GPTModel under a hetu_ext plan.") -> FlagParser:
    parser = FlagParser(prog=prog, description=description, allow_abbrev=False)
    parser.sections = dict(sections)
    config = parser.add_argument_group("configuration file")
    config.add_argument("--hetu-config", default=None, metavar="YAML",
                        help="settings of any section (model, training, parallel, ...) in one YAML file; flags "
                             "typed on the command line win over it")
    config.add_argument("--hetu-print-config", action="store_true",
                        help="print every setting of this run as a --hetu-config YAML file and exit")
    for name, cls in sections.items():
        add_section_flags(parser, name, cls)
    return parser


def _flag_table(sections: dict[str, type]) -> dict[str, dict[str, dataclasses.Field]]:
    return {name: {f.name: f for f in dataclasses.fields(cls)} for name, cls in sections.items()}


def load_config_file(path: str, sections: dict[str, type] = SECTIONS) -> dict[str, Any]:
    """A ``--hetu-config`` file as argparse destinations -> values; paths made relative to the file; every key,
    type and choice checked (ValueError naming the key, the value and the fix)."""
    file = Path(path)
    data = read_yaml(path, "--hetu-config")
    data = check_keys(data or {}, set(sections) | set(LEGACY_TOP_LEVEL), f"--hetu-config {path!r}")
    for key, section in LEGACY_TOP_LEVEL.items():
        if key in data:
            merged = dict(data.get(section) or {})
            merged.setdefault(key, data.pop(key))
            data[section] = merged
    table = _flag_table(sections)
    values: dict[str, Any] = {}
    for section, entries in data.items():
        entries = check_keys(entries or {}, table[section], f"{section} in --hetu-config {path!r}",
                             preposition="under")
        for key, value in entries.items():
            f = table[section][key]
            values[dest_of(f)] = _file_value(f, value, file, f"{section}.{key} in --hetu-config {path!r}")
    return values


def _file_value(f: dataclasses.Field, value: Any, file: Path, where: str) -> Any:
    kind, meta = _base_type(f.type), f.metadata
    if value is None:
        return None
    if f.name == "varlen_mock" and isinstance(value, dict):  # a mapping is the JSON form; its path is a path
        mock = dict(value)
        if mock.get("mode") == "file" and "path" in mock:
            mock["path"] = _relative_to(file, mock["path"])
        return json.dumps(mock)
    ok = {bool: isinstance(value, bool), int: isinstance(value, int) and not isinstance(value, bool),
          float: isinstance(value, (int, float)) and not isinstance(value, bool),
          str: isinstance(value, (str, int, float)) and not isinstance(value, bool),
          tuple: isinstance(value, (list, str))}[kind]
    if not ok:
        raise ValueError(f"{where}: expected {kind.__name__}, got {value!r}; write it as the flag "
                         f"{flag_of(f)} would take it")
    if kind is float:
        value = float(value)
    if kind is str:
        value = str(value)
    if kind is tuple:
        value = [str(v) for v in ([value] if isinstance(value, str) else value)]
    if meta.get("choices") and value not in meta["choices"]:
        raise ValueError(f"{where} must be one of {list(meta['choices'])}, got {value!r}")
    if meta.get("path"):
        value = [_relative_to(file, v) for v in value] if kind is tuple else _relative_to(file, value)
    return value


def _relative_to(file: Path, value: Any) -> str:
    path = Path(str(value))
    return str(path if path.is_absolute() else file.parent / path)


def parse_namespace(argv: list[str] | None, parser: FlagParser) -> argparse.Namespace:
    """Parse ``argv`` over the ``--hetu-config`` file's values (typed flags win); exits 2 on bad flags, raises
    ValueError for a bad file or a required setting given by neither."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--hetu-config", default=None)
    known, _ = pre.parse_known_args(argv)
    parser.parse_known_args(argv)  # unknown flags and bad values first, before the file is read
    if known.hetu_config:
        parser.set_defaults(**load_config_file(known.hetu_config, _sections_of(parser)))
    args = parser.parse_args(argv)
    for section, cls in _sections_of(parser).items():
        for f in dataclasses.fields(cls):
            if f.metadata.get("required") and getattr(args, dest_of(f)) is None:
                raise ValueError(f"{flag_of(f)} is required: give the flag, or {section}.{f.name} in --hetu-config")
    return args


def _sections_of(parser: argparse.ArgumentParser) -> dict[str, type]:
    return getattr(parser, "sections", SECTIONS)


def from_namespace(args: argparse.Namespace, cls: type = RunConfig) -> RunConfig:
    """The typed configuration of a parsed command line."""
    parts = {}
    for name, section in SECTIONS.items():
        values = {}
        for f in dataclasses.fields(section):
            value = getattr(args, dest_of(f))
            values[f.name] = tuple(value) if isinstance(value, list) else value
        parts[name] = section(**values)
    return cls(**parts)


def to_yaml(config: RunConfig) -> str:
    """Every setting as a ``--hetu-config`` file (reproduces the run)."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False)

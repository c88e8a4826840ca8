"""What the benchmark scripts share: the headline metric, the human table and the final JSON line.

Every script runs from the repository root as a module of this package, ``python -m benchmarks.hotspa ...``, so
scripts import each other (``from benchmarks.hotspa import candidates``) and hetu_ext (from the working tree when
it is not installed) with no edit of ``sys.path``.

The headline metric of a planner benchmark is the share of the ceiling's gain it reaches. For a baseline time
``base`` (the best static or homogeneous strategy), the planner's time ``got`` and a certified lower bound
``bound`` on every plan of the planner's kind: the gain is ``base / got``, the ceiling ``base / bound`` (no plan of
that kind can gain more) and the share ``(gain - 1) / (ceiling - 1)``: 1 when the planner reaches the bound, 0 when
it gains nothing, negative when it loses.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
"""The repository root (launch/, configs/ and the shared data beside the checkout are found from it)."""

TOLERANCE = 1e-12
"""Relative slack under which a ceiling counts as no gain at all (float sums of the same times differ by this)."""


def share_of_ceiling(base: float, got: float, bound: float) -> float:
    """The share of the ceiling's gain a planner reaches: ``(base / got - 1) / (base / bound - 1)``; when the
    ceiling allows no gain, 1 if the planner loses none and 0 otherwise. Any unit, the same for all three (seconds,
    GPU-seconds)."""
    if base / bound - 1 <= TOLERANCE:
        return 1.0 if got <= base * (1 + TOLERANCE) else 0.0
    return (base / got - 1) / (base / bound - 1)


def ceiling_fields(base: float, got: float, bound: float) -> dict[str, float]:
    """A row's ``gain``, ``ceiling`` and ``share_of_ceiling`` (see the module docstring)."""
    return {"gain": base / got, "ceiling": base / bound, "share_of_ceiling": share_of_ceiling(base, got, bound)}


_SPEC = re.compile(r"^(?:.?(?P<align>[<>^=]))?[+\- ]?(?P<width>\d+)")


@dataclass(frozen=True)
class Column:
    """One column of a :class:`Table`: its title and the format spec of its cells (``">9.3f"``, ``"<42"``,
    ``">6.1%"``), with an optional suffix after each cell (``"x"`` after a ratio). The title is aligned as the
    cells are (right when the spec names no alignment), over the cell's width plus the suffix's."""

    title: str
    spec: str
    suffix: str = ""

    def __post_init__(self) -> None:
        if _SPEC.match(self.spec) is None:
            raise ValueError(f"column {self.title!r}: format spec {self.spec!r} names no width; give one, e.g. "
                             "'>9.3f'")

    @property
    def width(self) -> int:
        return int(_SPEC.match(self.spec)["width"]) + len(self.suffix)

    @property
    def align(self) -> str:
        align = _SPEC.match(self.spec)["align"]
        return "<" if align == "<" else "^" if align == "^" else ">"

    def head(self) -> str:
        return f"{self.title:{self.align}{self.width}}"

    def cell(self, value: Any) -> str:
        return f"{value:{self.spec}}{self.suffix}"


@dataclass(frozen=True)
class Table:
    """A benchmark's human table: fixed-width columns separated by ``sep``, then free text after two spaces
    (``tail``: what a row used, e.g. the strategies chosen), an optional rule of dashes under the header. Rows
    print as they are computed (flushed), so a long run shows its progress."""

    columns: tuple[Column, ...]
    tail: str = ""
    sep: str = " "
    rule: bool = False

    def header(self) -> str:
        line = self.sep.join(c.head() for c in self.columns) + (f"  {self.tail}" if self.tail else "")
        return line + ("\n" + "-" * len(line) if self.rule else "")

    def row(self, values: Sequence[Any], tail: str = "") -> str:
        """One row: a value per column (or per leading column, for a summary row, which has no tail)."""
        if not 0 < len(values) <= len(self.columns):
            raise ValueError(f"a row of {len(values)} values for a table of {len(self.columns)} columns "
                             f"({', '.join(c.title for c in self.columns)})")
        line = self.sep.join(c.cell(v) for c, v in zip(self.columns, values))
        full = len(values) == len(self.columns)
        if tail and not full:
            raise ValueError(f"a summary row of {len(values)} of {len(self.columns)} columns has no tail: {tail!r}")
        return line + (f"  {tail}" if full and (self.tail or tail) else "")

    @classmethod
    def of(cls, *columns: tuple[str, str] | tuple[str, str, str], tail: str = "", sep: str = " ",
           rule: bool = False) -> Table:
        """``Table.of(("gpus", ">5"), ("gain", ">5.2f", "x"), ...)``: columns as (title, spec[, suffix])."""
        return cls(tuple(Column(*c) for c in columns), tail=tail, sep=sep, rule=rule)

    def print_header(self) -> None:
        print(self.header(), flush=True)

    def print_row(self, values: Sequence[Any], tail: str = "") -> None:
        print(self.row(values, tail), flush=True)


def result_line(result: dict[str, Any]) -> str:
    """The final line of every benchmark: its results as one JSON object (what tests and kept reports read)."""
    return json.dumps(result)


def print_result(result: dict[str, Any]) -> None:
    """Print :func:`result_line`, the benchmark's last output."""
    print(result_line(result), flush=True)

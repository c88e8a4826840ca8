"""benchmarks/: the shared helpers (benchmarks/common.py) and the package rule (pure, a few seconds).

The headline metric is defined once, and the tables keep the columns the kept reports in benchmarks/results/
were printed with (a title as wide as its cells). Every script imports as ``benchmarks.NAME`` from the repository
root, the way ``python -m benchmarks.NAME`` runs it: a script that edits ``sys.path`` or loads another by its file
path would import a second copy of a module (two ``share_of_ceiling``, two dataclasses of one name) and breaks
as soon as it runs from elsewhere.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from benchmarks.common import Table, ceiling_fields, share_of_ceiling

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if p.name != "__init__.py")


def test_share_of_ceiling_is_the_share_of_the_gain_the_bound_allows():
    assert share_of_ceiling(10.0, 8.0, 8.0) == 1.0  # reaches the bound
    assert share_of_ceiling(10.0, 10.0, 8.0) == 0.0  # gains nothing
    assert share_of_ceiling(10.0, 9.0, 8.0) == pytest.approx((10 / 9 - 1) / (10 / 8 - 1))
    assert share_of_ceiling(10.0, 11.0, 8.0) < 0  # loses against the baseline
    # no gain possible: full marks for losing nothing, none for losing
    assert share_of_ceiling(10.0, 10.0, 10.0) == 1.0
    assert share_of_ceiling(10.0, 10.5, 10.0) == 0.0
    fields = ceiling_fields(10.0, 9.0, 8.0)
    assert fields == {"gain": 10 / 9, "ceiling": 1.25, "share_of_ceiling": share_of_ceiling(10.0, 9.0, 8.0)}


def test_table_titles_are_as_wide_as_their_cells():
    table = Table.of(("gpus", ">5"), ("name", "<8"), ("gain", ">5.2f", "x"), ("error", ">+7.1%"), tail="used",
                     rule=True)
    header, rule = table.header().split("\n")
    assert header == " gpus name       gain   error  used"
    assert rule == "-" * len(header)
    row = table.row([8, "tp2", 1.234, 0.05], "tp1, tp2")
    assert row == "    8 tp2       1.23x   +5.0%  tp1, tp2"
    assert len(row.split("  tp1")[0]) == len(header.split("  used")[0])
    assert table.row([8, "mean"]) == "    8 mean    "  # a summary row: leading columns, no tail
    with pytest.raises(ValueError, match="5 values for a table of 4 columns"):
        table.row([1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="names no width"):
        Table.of(("x", ".2f"))


def _scripts_calls(path: Path) -> list[str]:
    """``sys.path`` edits and loads of a file as a module in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name) \
                and node.value.id == "sys":
            found.append(f"{path.name}:{node.lineno}: sys.path")
        if isinstance(node, ast.Attribute) and node.attr in ("spec_from_file_location", "run_path"):
            found.append(f"{path.name}:{node.lineno}: {node.attr}")
    return found


def test_no_script_edits_sys_path_or_loads_another_by_path():
    found = [f for p in SCRIPTS for f in _scripts_calls(p)]
    assert not found, "import benchmarks.NAME instead (scripts run as python -m benchmarks.NAME):\n" + "\n".join(found)


def test_share_of_ceiling_is_defined_once():
    defined = [p.name for p in SCRIPTS for node in ast.walk(ast.parse(p.read_text()))
               if isinstance(node, ast.FunctionDef) and node.name == "share_of_ceiling"]
    assert defined == ["common.py"]


@pytest.mark.parametrize("script", [p.stem for p in SCRIPTS])
def test_every_script_imports_as_a_module_of_the_package(script):
    module = importlib.import_module(f"benchmarks.{script}")
    assert callable(getattr(module, "main", None)) or script == "common", f"benchmarks/{script}.py has no main()"

"""Size limits of the package's source (pure: an AST walk, no import executed, well under a second).

No module of hetu_ext/ (patches/ included: it is installed as hetu_ext.patches) over ``MODULE_LINES`` lines, no
function or method over ``FUNCTION_LINES`` (from its ``def``, or its first decorator, to its last line; nested
functions count on their own too). A module past the limit holds more than one job and reads as a list of them;
a function past it does several steps that deserve names. The failure lists every offender as ``path:line``
with its length, so one run says everything there is to split.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = (ROOT / "hetu_ext", ROOT / "patches")
MODULE_LINES = 500
FUNCTION_LINES = 80


def _sizes(path: Path) -> tuple[int, list[tuple[int, str, int]]]:
    """(lines of the module, [(line, qualified name, lines) of every function and method in it])."""
    source = path.read_text()
    functions = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([child.lineno] + [d.lineno for d in child.decorator_list])
                functions.append((child.lineno, prefix + child.name, child.end_lineno - start + 1))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source, str(path)), "")
    return len(source.splitlines()), functions


def _offenders() -> list[str]:
    found = []
    for root in SOURCES:
        for path in sorted(root.rglob("*.py")):
            where = path.relative_to(ROOT)
            lines, functions = _sizes(path)
            if lines > MODULE_LINES:
                found.append(f"{where}: module of {lines} lines (limit {MODULE_LINES})")
            found += [f"{where}:{line} {name}: function of {length} lines (limit {FUNCTION_LINES})"
                      for line, name, length in functions if length > FUNCTION_LINES]
    return found


def test_no_module_over_500_lines_and_no_function_over_80():
    found = _offenders()
    assert not found, f"{len(found)} over the size limits; split them by job:\n" + "\n".join(found)


def test_sizes_are_measured_as_stated(tmp_path):
    """The measure itself (a walk that missed methods or nested functions would pass vacuously): a decorated
    method counts from its decorator, a nested function on its own, a module by its lines."""
    body = "\n".join(f"        x{i} = {i}" for i in range(FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"class A:\n    @staticmethod\n    def f():\n{body}\n\n\ndef g():\n"
                                   "    def h():\n        return 1\n    return h\n")
    lines, functions = _sizes(tmp_path / "m.py")
    assert lines == FUNCTION_LINES + 9
    g = FUNCTION_LINES + 6
    assert functions == [(3, "A.f", FUNCTION_LINES + 2), (g, "g", 4), (g + 1, "g.h", 2)]
    assert all(root.is_dir() for root in SOURCES)

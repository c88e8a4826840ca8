"""The import rules the README promises, checked on the source (AST scan, no import executed):

* ``model/`` (the model's settings and inventory) is the base of the pure packages: it imports no torch and no
  other hetu_ext package, so every package can read the inventory without an import circle;
* ``plan/`` and ``data/`` (the pure planners and packers) import neither torch.distributed nor a host framework;
* ``checkpoint/`` imports neither Megatron nor DeepSpeed (host-specific converters live in ``megatron/`` and
  ``deepspeed/``); ``config``, ``keys`` and ``metrics`` are pure too;
* no module imports a private name (``_x``) of another hetu_ext module;
* an entry point (``python -m PACKAGE``'s ``__main__.py``) is an application, the launch layer put where ``-m``
  finds it: it may compose hetu_ext's adapter packages (``python -m hetu_ext.checkpoint`` hands DeepSpeed's
  format from hetu_ext.deepspeed to the host-free CLI) but imports no host framework its package may not, and no
  hetu_ext module imports an entry point (so the exception cannot carry a dependency into a package).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hetu_ext"
HOSTS = ("megatron", "deepspeed", "diffusers", "transformers", "transformer_engine", "apex")
RULES = {
    "model": HOSTS + ("torch", "hetu_ext.plan", "hetu_ext.data", "hetu_ext.megatron", "hetu_ext.deepspeed",
                      "hetu_ext.runtime", "hetu_ext.checkpoint", "hetu_ext.diffusion", "hetu_ext.lora"),
    "plan": HOSTS + ("torch.distributed", "hetu_ext.megatron", "hetu_ext.deepspeed", "hetu_ext.runtime",
                     "hetu_ext.checkpoint", "hetu_ext.diffusion"),
    "data": HOSTS + ("torch.distributed", "hetu_ext.plan", "hetu_ext.megatron", "hetu_ext.deepspeed",
                     "hetu_ext.runtime", "hetu_ext.checkpoint", "hetu_ext.diffusion"),
    "checkpoint": ("megatron", "deepspeed", "hetu_ext.megatron", "hetu_ext.deepspeed"),
    "megatron": ("deepspeed", "hetu_ext.train", "hetu_ext.cli", "hetu_ext.lora", "hetu_ext.deepspeed",
                 "hetu_ext.elastic", "hetu_ext.testing"),
    "config": HOSTS + ("torch", "hetu_ext.megatron", "hetu_ext.deepspeed", "hetu_ext.runtime"),
    "keys.py": HOSTS + ("torch",),
    "metrics.py": HOSTS + ("torch.distributed", "hetu_ext.megatron", "hetu_ext.deepspeed"),
}
"""Top-level package (or module) -> module prefixes it must not import."""
ENTRY_POINT = "__main__.py"
"""The file name of an entry point: RULES' hetu_ext.* prefixes do not apply to it (see the module docstring)."""


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, imported names) of every import in a file (relative imports resolved)."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            module = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            out.append((node.lineno, module, [alias.name for alias in node.names]))
    return out


def _files(scope: str) -> list[Path]:
    target = PACKAGE / scope
    return [target] if target.suffix == ".py" else sorted(target.rglob("*.py"))


def _matches(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _forbidden(scope: str, path: Path) -> tuple[str, ...]:
    if path.name == ENTRY_POINT:
        return tuple(prefix for prefix in RULES[scope] if not _matches(prefix, "hetu_ext"))
    return RULES[scope]


@pytest.mark.parametrize("scope", sorted(RULES))
def test_layering_import_rules(scope):
    bad = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
           for path in _files(scope) for line, module, _ in _imports(path)
           if any(_matches(module, prefix) for prefix in _forbidden(scope, path))]
    assert not bad, "\n".join(bad)


def test_layering_nothing_imports_an_entry_point():
    """An entry point may import adapters its package may not; importing it would smuggle them in."""
    bad = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
           for path in sorted(PACKAGE.rglob("*.py")) for line, module, names in _imports(path)
           if module.split(".")[-1] == "__main__" or "__main__" in names]
    assert not bad, "\n".join(bad)


def test_layering_no_private_names_across_modules():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        this = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        for line, module, names in _imports(path):
            if module.startswith("hetu_ext") and module != this:
                bad += [f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}.{name}"
                        for name in names if name.startswith("_") and not name.startswith("__")]
    assert not bad, "\n".join(bad)


def test_layering_scan_sees_imports():
    """The scan itself: a file known to import torch.distributed is seen doing so (a broken scan passes all)."""
    found = {module for _, module, _ in _imports(PACKAGE / "runtime" / "reshard.py")}
    assert "torch.distributed" in found or "torch" in found


def test_layering_entry_point_keeps_host_rules():
    """The entry-point exception drops only hetu_ext's own adapter packages: a host framework stays forbidden
    (checkpoint/__main__.py may import hetu_ext.deepspeed, never deepspeed itself)."""
    main = PACKAGE / "checkpoint" / ENTRY_POINT
    assert _forbidden("checkpoint", main) == ("megatron", "deepspeed")
    assert "hetu_ext.deepspeed" in _forbidden("checkpoint", PACKAGE / "checkpoint" / "cli.py")


def _package_graph() -> dict[str, set[str]]:
    """Top-level package (or module) of hetu_ext -> the others its files import (entry points left out)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == ENTRY_POINT or path.parent == PACKAGE and path.name == "__init__.py":
            continue
        source = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        for _, module, _ in _imports(path):
            parts = module.split(".")
            if parts[0] == "hetu_ext" and len(parts) > 1 and parts[1] != source:
                graph.setdefault(source, set()).add(parts[1])
    return graph


def test_layering_no_import_circle_between_packages():
    """Packages import each other one way only (issue 31: data/ and plan/ imported each other, megatron/ imported
    the LoRA plug-in, DeepSpeed's reader and the test harness): the graph of hetu_ext's top-level packages has no
    cycle. The planners (plan/) read the packing algorithms and length costs (data/), which know replicas only;
    the command lines (cli/) compose the host adapter (megatron/), the loop (train/) and the plug-ins."""
    graph = _package_graph()
    assert "data" in graph.get("plan", set())  # the scan sees package edges (a broken scan passes vacuously)
    state: dict[str, int] = {}

    def cycle_from(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state and (found := cycle_from(nxt, path + [node])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := cycle_from(start, [])):
            pytest.fail("import circle: " + " -> ".join(found))

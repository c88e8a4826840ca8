"""The import rules the README promises, checked on the source (AST scan, no import executed) of hetu_ext/ and of
the top-level patches/ folder (installed as ``hetu_ext.patches``):

* a host framework is imported only by the packages named for it in ``HOST_IMPORTERS`` (docs/architecture.md
  gives the list and the reason for each), and each of them does import it (the list is exact, not a
  permission nobody uses); ``patches/`` imports none by an import statement: a patch names its target as text
  and imports it when it is applied;
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
PATCHES = PACKAGE.parent / "patches"
"""Installed as ``hetu_ext.patches`` (setup.py's package_dir): scanned as that package."""
HOSTS = ("megatron", "deepspeed", "diffusers", "transformers", "peft", "transformer_engine", "apex")
HOST_IMPORTERS: dict[str, tuple[str, ...]] = {
    "megatron": ("cli", "deepspeed", "lora", "megatron", "megatron_lm", "train"),
    "deepspeed": ("deepspeed",),
    "diffusers": ("diffusion",),
    "transformers": ("diffusion", "megatron"),
    "peft": (),
    "transformer_engine": ("megatron",),
    "apex": (),
}
"""Host framework -> the top-level packages of hetu_ext whose files may import it (docs/architecture.md, "Host
frameworks"). Megatron-core beyond its adapter: the loop (train/: its LR scheduler, layer classes, RNG tracker),
LoRA (lora/: adapters on its parallel linear layers), DeepSpeed's path (deepspeed/: the Megatron-core model it
trains, the layer spec that names ZeRO files' parameters), Megatron-LM's loop (megatron_lm/) and the layer timer
(cli/calibrate.py). Transformer Engine: megatron/layer_spec.py tries its import before building Megatron-core's TE
spec (--transformer-impl transformer_engine). peft is never imported: the PEFT export writes its files
(lora/peft.py)."""
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
    "patches": HOSTS + ("hetu_ext.train", "hetu_ext.cli", "hetu_ext.lora", "hetu_ext.deepspeed", "hetu_ext.megatron_lm",
                        "hetu_ext.elastic", "hetu_ext.testing", "hetu_ext.runtime", "hetu_ext.checkpoint",
                        "hetu_ext.diffusion", "hetu_ext.plan", "hetu_ext.data", "hetu_ext.config"),
}
"""Top-level package (or module) -> module prefixes it must not import."""
ENTRY_POINT = "__main__.py"
"""The file name of an entry point: RULES' hetu_ext.* prefixes do not apply to it (see the module docstring)."""


def _dotted(path: Path) -> tuple[str, ...]:
    """The module's name as parts (``hetu_ext.patches.base`` for patches/base.py)."""
    if path.is_relative_to(PATCHES):
        return ("hetu_ext", "patches") + path.relative_to(PATCHES).with_suffix("").parts
    return path.relative_to(PACKAGE.parent).with_suffix("").parts


def _all_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py")) + sorted(PATCHES.rglob("*.py"))


def _top(path: Path) -> str:
    """The top-level package (or module, without .py) of hetu_ext a file belongs to."""
    return _dotted(path)[1]


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, imported names) of every import in a file (relative imports resolved)."""
    package = ".".join(_dotted(path)[:-1])
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
    target = PATCHES if scope == "patches" else PACKAGE / scope
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


def _host_importers() -> dict[str, dict[str, list[str]]]:
    """Host framework -> top-level package -> the ``file:line`` of each import of it."""
    found: dict[str, dict[str, list[str]]] = {host: {} for host in HOST_IMPORTERS}
    for path in _all_files():
        for line, module, _ in _imports(path):
            host = module.split(".")[0]
            if host in found:
                where = path.relative_to(PACKAGE.parent)
                found[host].setdefault(_top(path), []).append(f"{where}:{line}")
    return found


def test_layering_host_frameworks_only_where_named():
    """A host framework imported outside the packages named for it in HOST_IMPORTERS fails, with the line."""
    bad = [f"{where} imports {host} (allowed in: {', '.join(HOST_IMPORTERS[host]) or 'no package'})"
           for host, by_package in _host_importers().items() for package, lines in by_package.items()
           if package not in HOST_IMPORTERS[host] for where in lines]
    assert not bad, "\n".join(bad)


def test_layering_host_importers_list_is_exact():
    """Each package named for a host does import it: when the last import leaves, the name leaves the list (and
    docs/architecture.md), so the list always says where each host framework is used."""
    found = _host_importers()
    unused = [f"{package} is allowed {host} but imports none" for host, packages in HOST_IMPORTERS.items()
              for package in packages if package not in found[host]]
    assert not unused, "\n".join(unused)
    assert set(HOST_IMPORTERS) == set(HOSTS)


def test_layering_patches_are_scanned():
    """patches/ is part of the scan (a scan that missed it would pass vacuously): its files are seen as
    hetu_ext.patches, and its import of hetu_ext.errors is found."""
    files = [p for p in _all_files() if p.is_relative_to(PATCHES)]
    assert files and all(_top(p) == "patches" for p in files)
    assert "hetu_ext.errors" in {module for _, module, _ in _imports(PATCHES / "base.py")}


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
    for path in _all_files():
        if path.name == ENTRY_POINT or path.parent == PACKAGE and path.name == "__init__.py":
            continue
        source = _top(path)
        for _, module, _ in _imports(path):
            parts = module.split(".")
            if parts[0] == "hetu_ext" and len(parts) > 1 and parts[1] != source:
                graph.setdefault(source, set()).add(parts[1])
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of the graph as a path (first node repeated at the end), or None."""
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
            return found
    return None


def test_layering_no_import_circle_between_packages():
    """Packages import each other one way only (issue 31: data/ and plan/ imported each other, megatron/ imported
    the LoRA plug-in, DeepSpeed's reader and the test harness): the graph of hetu_ext's top-level packages has no
    cycle. The planners (plan/) read the packing algorithms and length costs (data/), which know replicas only;
    the command lines (cli/) compose the host adapter (megatron/), the loop (train/) and the plug-ins."""
    graph = _package_graph()
    assert "data" in graph.get("plan", set())  # the scan sees package edges (a broken scan passes vacuously)
    found = _find_cycle(graph)
    assert found is None, "import circle: " + " -> ".join(found or [])


def test_layering_plan_packages_one_way():
    """plan/'s packages (core, cost and one per system) import each other one way only, as docs/architecture.md
    draws them: core and cost at the bottom, hydraulis reading hotspa's and lobra's pricing. The command line
    (plan/__main__.py, plan/cli.py), which reads them all, is left out of the graph."""
    plan = PACKAGE / "plan"
    graph: dict[str, set[str]] = {}
    for path in sorted(plan.rglob("*.py")):
        parts = path.relative_to(plan).parts
        if len(parts) == 1:  # plan/__init__.py, __main__.py, cli.py: the package's face and its command line
            continue
        for _, module, _ in _imports(path):
            target = module.split(".")
            if target[:2] == ["hetu_ext", "plan"] and len(target) > 2 and target[2] != parts[0]:
                graph.setdefault(parts[0], set()).add(target[2])
    graph = {source: targets - {"cli", "__main__"} for source, targets in graph.items()}
    assert "core" in graph.get("malleus", set())  # the scan sees edges
    found = _find_cycle(graph)
    assert found is None, "import circle inside plan/: " + " -> ".join(found or [])

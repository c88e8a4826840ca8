"""Named, probed, removable patches of a host framework.

A :class:`Patch` replaces one attribute of one module (or class). Before it replaces anything it probes the
target: the module must import, the attribute must exist and must still be the original object (not a
replacement of ours). It keeps the original so that :meth:`Patch.remove` restores the host exactly, and applying
it twice is an error, as is a second patch of the same target.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from hetu_ext.errors import HetuExtError


class PatchError(HetuExtError):
    """A patch could not be applied or removed because the host is not what it expects."""


_MARK = "__hetu_patch__"


@dataclass(kw_only=True)
class Patch:
    """Replace ``target`` (``"pkg.module:attr"`` or ``"pkg.module:Class.attr"``) with ``make(original)``."""

    name: str
    """Short identifier, shown in logs and errors."""
    target: str
    """Where the patched attribute lives: ``module:attr`` or ``module:Class.attr``."""
    make: Callable[[Any], Any]
    """Builds the replacement from the original object."""
    reason: str
    """Why the host needs it (what fails without it)."""
    _owner: Any = field(default=None, init=False, repr=False)
    _original: Any = field(default=None, init=False, repr=False)

    @property
    def applied(self) -> bool:
        return self._owner is not None

    def _resolve(self) -> tuple[Any, str]:
        module_name, _, path = self.target.partition(":")
        try:
            owner: Any = importlib.import_module(module_name)
        except ImportError as exc:
            raise PatchError(f"patch {self.name!r}: cannot import {module_name!r} ({exc}); "
                             "the host framework changed or is not installed") from exc
        *parents, attr = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent, None)
            if owner is None:
                raise PatchError(f"patch {self.name!r}: {module_name}.{parent} not found; the host changed, "
                                 "update patches/ for this version")
        if not hasattr(owner, attr):
            raise PatchError(f"patch {self.name!r}: {self.target} not found; the host changed, "
                             "update patches/ for this version")
        return owner, attr

    def probe(self) -> None:
        """Raise :class:`PatchError` unless the target exists and is unpatched."""
        owner, attr = self._resolve()
        current = owner.__dict__.get(attr, getattr(owner, attr))
        if getattr(current, _MARK, None) is not None:
            raise PatchError(f"patch {self.name!r}: {self.target} is already patched by "
                             f"{getattr(current, _MARK)!r}; two patches of one target are not allowed")

    def apply(self) -> None:
        if self.applied:
            raise PatchError(f"patch {self.name!r} is already applied")
        self.probe()
        owner, attr = self._resolve()
        original = owner.__dict__.get(attr, getattr(owner, attr))
        replacement = self.make(original)
        try:
            setattr(replacement, _MARK, self.name)
        except (AttributeError, TypeError):  # e.g. bound builtins; the registry still guards double patching
            pass
        setattr(owner, attr, replacement)
        self._owner, self._original = owner, original

    def remove(self) -> None:
        if not self.applied:
            return
        _, attr = self._resolve()
        setattr(self._owner, attr, self._original)
        self._owner = self._original = None


@dataclass
class PatchSet:
    """An ordered group of patches applied and removed together (all or nothing)."""

    name: str
    patches: list[Patch]

    def __post_init__(self) -> None:
        targets = [p.target for p in self.patches]
        dupes = sorted({t for t in targets if targets.count(t) > 1})
        if dupes:
            raise PatchError(f"patch set {self.name!r} patches {dupes} more than once; merge those patches")

    @property
    def applied(self) -> bool:
        return any(p.applied for p in self.patches)

    def apply(self) -> None:
        done: list[Patch] = []
        try:
            for patch in self.patches:
                patch.apply()
                done.append(patch)
        except Exception:
            for patch in reversed(done):
                patch.remove()
            raise

    def remove(self) -> None:
        for patch in reversed(self.patches):
            patch.remove()

    def describe(self) -> list[tuple[str, str, str]]:
        return [(p.name, p.target, p.reason) for p in self.patches]

"""One strict-key check for every file hetu_ext reads (plans, cost tables, length specs, run configs).

An unknown key is named with the closest valid one: ``unknown key 'methd' under packing; did you mean 'method'?``
Pure: no torch, no host framework.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml


def check_keys(obj: Any, allowed: Iterable[str], where: str, *, preposition: str = "in",
               required: Iterable[str] = (), error: type[Exception] = ValueError,
               type_error: type[Exception] | None = None) -> dict:
    """``obj`` as a dict whose keys are all in ``allowed`` (and include ``required``); else ``error`` naming the
    first unknown key, ``where`` it is (``"unknown key 'k' {preposition} {where}"``), and the closest allowed key
    (or the allowed keys). A non-mapping raises ``type_error`` (default: ``error``)."""
    allowed = sorted(map(str, allowed))
    if not isinstance(obj, Mapping):
        raise (type_error or error)(f"{where}: expected a mapping with keys {allowed}, got {type(obj).__name__} "
                                    f"{obj!r}")
    unknown = sorted(str(k) for k in obj if str(k) not in allowed)
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}?" if close else f"the keys are {allowed}"
        more = f" (and {len(unknown) - 1} more: {unknown[1:]})" if len(unknown) > 1 else ""
        raise error(f"unknown key {key!r} {preposition} {where}{more}; {hint}")
    missing = sorted(set(required) - set(obj))
    if missing:
        raise error(f"{where}: missing key(s) {missing}; the keys are {allowed}")
    return dict(obj)


def read_yaml(path: str | Path, what: str, *, error: type[Exception] = ValueError, fix: str = "check the path"
              ) -> Any:
    """A YAML file's content; one-line ``error`` naming ``what`` and the file when it cannot be read (with ``fix``)
    or does not parse."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise error(f"{what} {str(path)!r} cannot be read: {exc.strerror}; {fix}") from exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise error(f"{what} {str(path)!r} is not valid YAML: {exc}".replace("\n", " ")) from exc

"""A rank's training state as typed parts: what a checkpoint saves and a load restores, one part per owner.

A part (:class:`Checkpointable`) is one owner of state: the progress (iteration, losses), the data position, the
LR schedule, the model, the optimizer, the loss scaler, the RNG, the straggler monitor's assumptions, a plug-in's
own (LoRA's adapters). It gives its state out and takes it back in two forms: tensors as pieces with global
offsets (the reshard engine's unit: :meth:`~Checkpointable.pieces` to save, :meth:`~Checkpointable.destinations`
to fill on a load) and JSON-able values under the keys of the checkpoint's state record that it owns
(:meth:`~Checkpointable.state_dict`, :meth:`~Checkpointable.load_state_dict`). The trainer holds a list of parts
(hetu_ext/train/parts.py), a plug-in adds or replaces some (hetu_ext/lora/plugin.py), and a format
(hetu_ext/megatron/checkpointing.py) writes and reads the union of their pieces and values: each part's save and
restore is written once, for every format.

The record is flat, as a manifest's ``state`` (and a torch_dist save's ``hetu_common.pt``) always held it, so the
files on disk did not change when the parts came: each key has one owner, and a key claimed by two parts, or
given by a part that does not declare it, is an error. One key is per rank: :data:`PER_RANK` (``rng``), which a
hetu checkpoint keeps in the manifest's per-rank section instead of the shared record.

Parts are restored in list order, after every tensor is loaded; a part that refuses the checkpoint (the data
position under other data settings) comes first, so a refusal changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

from hetu_ext.errors import HetuExtError
from hetu_ext.runtime.reshard import Piece

PER_RANK = "rng"
"""The key of the record that differs per rank (each rank's RNG states): saved per rank, restored only under the
plan that saved it (another plan's ranks have no counterpart)."""


@runtime_checkable
class Checkpointable(Protocol):
    """One part of a rank's training state: pieces in, pieces out; its own keys of the state record in and out."""

    name: str
    """What the part is, for errors (``"LR schedule"``, ``"LoRA adapters"``)."""
    keys: tuple[str, ...]
    """The keys of the checkpoint's state record this part owns (empty: tensors only)."""

    def state_dict(self) -> dict[str, Any]:
        """The part's values to save, JSON-able, under its :attr:`keys` only."""
        ...

    def load_state_dict(self, saved: dict[str, Any], where: str) -> None:
        """Restore from a loaded record (the whole record: a key the checkpoint lacks is absent or None) after
        every tensor is loaded, on every rank (idle ones too); ``where`` names the checkpoint in errors."""
        ...

    def pieces(self) -> list[Piece]:
        """This rank's tensors to save (empty on an idle rank, or for a part without tensors)."""
        ...

    def destinations(self, saved: dict[str, Any], names: set[str]) -> list[Piece]:
        """This rank's tensors to fill from a checkpoint whose record is ``saved`` and which holds tensors of the
        kinds ``names`` (``param``, ``exp_avg``, ...): the pieces a load writes into (state they need, such as an
        optimizer's moments, is created here)."""
        ...


class Part:
    """A part with neither tensors nor values: subclasses override what they have."""

    name = "part"
    keys: tuple[str, ...] = ()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, saved: dict[str, Any], where: str) -> None:
        return None

    def pieces(self) -> list[Piece]:
        return []

    def destinations(self, saved: dict[str, Any], names: set[str]) -> list[Piece]:
        return []


def check_parts(parts: Iterable[Checkpointable]) -> None:
    """Each key owned by one part (raises :class:`HetuExtError` naming the key and both parts)."""
    owner: dict[str, str] = {}
    for part in parts:
        for key in part.keys:
            if key in owner:
                raise HetuExtError(f"checkpoint key {key!r} is claimed by two parts, {owner[key]!r} and "
                                   f"{part.name!r}; a key has one owner")
            owner[key] = part.name


def state_record(parts: Iterable[Checkpointable]) -> dict[str, Any]:
    """The union of the parts' values: the checkpoint's state record (with :data:`PER_RANK`, if a part owns it)."""
    parts = list(parts)
    check_parts(parts)
    record: dict[str, Any] = {}
    for part in parts:
        values = part.state_dict()
        foreign = sorted(set(values) - set(part.keys))
        if foreign:
            raise HetuExtError(f"part {part.name!r} gave {foreign}, which it does not declare in its keys "
                               f"{list(part.keys)}")
        record.update(values)
    return record


def saved_pieces(parts: Iterable[Checkpointable]) -> list[Piece]:
    """Every part's tensors to save, in the parts' order."""
    return [piece for part in parts for piece in part.pieces()]


def load_destinations(parts: Iterable[Checkpointable], saved: dict[str, Any], names: set[str]) -> list[Piece]:
    """Every part's tensors to fill from a checkpoint (record ``saved``, tensor kinds ``names``)."""
    return [piece for part in parts for piece in part.destinations(saved, names)]


def restore_parts(parts: Iterable[Checkpointable], saved: dict[str, Any], where: str) -> None:
    """Every part's values from the loaded record, in the parts' order."""
    parts = list(parts)
    check_parts(parts)
    for part in parts:
        part.load_state_dict(saved, where)


def tensor_kinds(names: Iterable[str]) -> set[str]:
    """The kinds of a checkpoint's tensor names: ``exp_avg/decoder.layers.0...`` -> ``exp_avg``."""
    return {name.split("/", 1)[0] for name in names}

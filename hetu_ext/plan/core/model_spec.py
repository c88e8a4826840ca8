"""Where ModelSpec used to live: it is the model inventory's input now (:mod:`hetu_ext.model.spec`)."""

from hetu_ext.model.spec import ModelSpec

__all__ = ["ModelSpec"]

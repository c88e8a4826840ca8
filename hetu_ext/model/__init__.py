"""The model as data (pure: no torch.distributed, no host framework): its settings (:class:`ModelSpec`) and the
inventory of its parameters, FLOPs and bytes (:mod:`.inventory`)."""

from .spec import ModelSpec

__all__ = ["ModelSpec"]

"""Elastor-style layout-agnostic checkpoints: safetensors shards with global offsets and a manifest.

Saving writes each unique element once, spread over the ranks that hold it, through a short snapshot and a
background persist with an atomic commit (writer.py); loading reads each shard once and reshards it into any
plan (load.py). Pure parts (manifest, shard selection, reading) need no process group. Importing this package
does not import Megatron or DeepSpeed.
"""

from .manifest import CheckpointError, Manifest, ShardRecord, TensorRecord
from .storage import LocalStorage, Storage

__all__ = ["CheckpointError", "LocalStorage", "Manifest", "ShardRecord", "Storage", "TensorRecord"]

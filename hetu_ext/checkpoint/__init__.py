"""Elastor-style layout-agnostic checkpoints: safetensors shards with global offsets and a manifest.

Saving writes each unique element once, spread over the ranks that hold it, through a short snapshot and a
background persist with an atomic commit (writer.py); loading reads and checks each shard once (per job or per
host) and reshards it into any plan (load.py). Megatron's dist_checkpointing checkpoints load the same way and
can be exported to (torch_dist.py), and so do DeepSpeed ZeRO-1/2/3 checkpoints (read in hetu_ext/deepspeed/
zero_checkpoint.py, no ds_to_universal step; the CLI reaches it through formats.py); full tensors export to a
Hugging Face GPT-2 directory (hf.py);
``python -m hetu_ext.checkpoint inspect|verify|convert`` (cli.py). Whose checkpoints a directory holds (a run
identity per checkpoint; retention and saving respect other runs') is ownership.py; how a saved LR schedule meets
the flags on resume (Megatron-LM's rule) is schedule.py. Pure parts (manifest, shard selection, reading,
ownership, schedule) need no process group. Importing this package imports torch and safetensors, not Megatron or DeepSpeed.
"""

from .manifest import CheckpointError, Manifest, ShardRecord, TensorRecord
from .storage import LocalStorage, Storage

__all__ = ["CheckpointError", "LocalStorage", "Manifest", "ShardRecord", "Storage", "TensorRecord"]

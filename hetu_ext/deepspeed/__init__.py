"""DeepSpeed as a training path for Megatron-core's GPTModel (engine.py): it produces real DeepSpeed ZeRO-1/2/3
checkpoints of the same model hetu_ext trains, which zero_checkpoint.py loads into any plan (``--load``, resume.py)
and reads for ``python -m hetu_ext.checkpoint``.

Importing this package imports nothing heavy; ``engine`` imports DeepSpeed (and sets ``DS_ACCELERATOR=cpu`` when
no CUDA device is present, before DeepSpeed picks its accelerator).
"""

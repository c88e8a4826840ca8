"""DeepSpeed as a training path for Megatron-core's GPTModel (engine.py): it produces real DeepSpeed ZeRO-1/2/3
checkpoints of the same model hetu_ext trains, which hetu_ext/checkpoint/deepspeed_zero.py loads into any plan.

Importing this package imports nothing heavy; ``engine`` imports DeepSpeed (and sets ``DS_ACCELERATOR=cpu`` when
no CUDA device is present, before DeepSpeed picks its accelerator).
"""

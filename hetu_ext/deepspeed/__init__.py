"""DeepSpeed as a host of hetu_ext's model (the only package that imports DeepSpeed).

* config.py: the flags beyond Megatron-LM's (``--zero-stage``, ``--deepspeed-config``, ``--hetu-microbatches``) and
  the DeepSpeed config made from them (pure).
* engine.py: Megatron-core's GPTModel in DeepSpeed's ZeRO-0/1/2/3 engine, trained on the Megatron path's data (plain,
  straggler-weighted or packed) with its loss normalisation, Adam and LR schedule; DeepSpeed checkpoints.
* weighting.py: per-rank microbatch counts that follow measured speeds (ZeRO-0/1, unmanaged gradient accumulation).
* engine_state.py: the engine's ZeRO partitions as reshard pieces; engine_load.py: ``--load`` of DeepSpeed or hetu
  checkpoints saved on any number of ranks, in process; engine_save.py: ``--hetu-ckpt-format hetu`` from the engine.
* zero_checkpoint.py: DeepSpeed ZeRO-0/1/2/3 checkpoints as a reshard source (DeepSpeed's own reconstruction), for the
  engine, for hetu_ext's trainer (resume.py) and for ``python -m hetu_ext.checkpoint``.

Importing this package imports nothing heavy; ``engine`` imports DeepSpeed (and sets ``DS_ACCELERATOR=cpu`` when
no CUDA device is present, before DeepSpeed picks its accelerator).
"""

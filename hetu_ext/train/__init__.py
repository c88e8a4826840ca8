"""The training loop of hetu_ext's trainer: one step (``step.py``: ``run_step`` and its step kinds, of which a
plug-in may add its own) and the loop around it (``trainer.py``: ``Trainer``, ``build_trainer``); what a plug-in
may change (``plugin.py``: ``TrainerPlugin``'s hooks) and what a checkpoint holds (``parts.py``: the parts). Runs on
the host adapter (``hetu_ext/megatron``: placements, stage models, checkpoints, migration), which never imports it."""

"""LobRA on Megatron-core: many tenants' LoRA adapters trained jointly over one frozen base model.

* the tenants file (``--hetu-lora-tenants``: data, per-step share, LoRA settings) is configuration, read by the
  planner too: :mod:`hetu_ext.config.tenants` (pure).
* ``layers.py``: per-token multi-tenant LoRA on Megatron-core's Column/RowParallelLinear (TP-aware).
* ``install.py``: the probed layer-spec patch that puts adapters into the stage models and freezes the base.
* ``adapters.py``: adapters' global identity (keys, boxes), layout-independent init, gathering.
* ``data.py``: every tenant's sequences of a step packed together, tokens tagged with their tenant.
* ``sync.py``: adapters' gradient reduction under any plan, per-tenant clipping, absent tenants not stepped
  (fp32 or ``--bf16`` masters; ``--use-distributed-optimizer``: Adam state on each box's owner).
* ``loss.py``: each token's loss weighted by 1 / its tenant's tokens in the global batch; the forward step.
* ``switched.py``: tenants under HotSPa's / Hydraulis' switching layer (adapters switched with the base).
* ``plugin.py``: the tenants as a plug-in of hetu_ext's one trainer (its placements, step kind, migration pieces
  and checkpoint parts: the adapters instead of the frozen base); ``train.py``: the tenants' step kind and
  ``build_lora_trainer`` (``pretrain_gpt.py --hetu-lora-tenants FILE``).
* ``peft.py``: export of each tenant's adapter in the PEFT format (extra ``lora``).
* ``checkpoint.py``: ``--save``/``--load`` with tenants: adapters and per-tenant Adam state in the hetu checkpoint
  format (the frozen base is not saved), resumed or resharded into any plan; PEFT export of a checkpoint
  (``python -m hetu_ext.lora export-peft``, ``__main__.py``).
* ``pretrained.py``: ``--pretrained-checkpoint DIR``: the frozen base's weights from a pretraining run's hetu
  checkpoint (any layout, resharded), before ``--load`` resumes the adapters; the adapters record their base.

The deployment planner is pure and lives in ``hetu_ext/plan/lobra/`` (``python -m hetu_ext.plan lobra``).
This package is an adapter on Megatron-core (like ``deepspeed/`` on DeepSpeed) and composes hetu_ext's trainer
(hetu_ext.train) and ``hetu_ext.megatron``'s plan runtime; ``hetu_ext.cli.train.build_run`` reaches it through one
lazy import when ``--hetu-lora-tenants`` is given.
"""

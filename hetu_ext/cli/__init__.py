"""The command line of hetu_ext's trainer (``launch/pretrain_gpt.py``): flags and their checks (``args.py``) and
the run they build (``train.py``: ``main``, ``build_run``). This is where plug-ins are chosen (LoRA's tenants from
``--hetu-lora-tenants``), so the host adapter (``hetu_ext/megatron``) never imports a plug-in."""

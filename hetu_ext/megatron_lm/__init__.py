"""Megatron-LM's own ``pretrain_gpt.py`` with ``--hetu-*`` flags, nothing forked.

    torchrun --nproc-per-node 2 -m hetu_ext.megatron_lm PATH/TO/Megatron-LM/pretrain_gpt.py <its flags> --hetu-...

:mod:`.flags` splits the ``--hetu-*`` flags off the command line and checks them (with the Megatron-LM flags they
depend on); :mod:`.run` appends the checkout to the end of ``sys.path`` (pip's megatron-core stays the one
imported), applies the CPU patches when there is no CUDA (``hetu_ext.patches.megatron_lm``), checks Megatron-LM's
patch points against the tested tag, installs the hooks the flags ask for and runs the script as ``__main__``.
The hooks, each a set of named, probed, removable patches of Megatron-LM's patch points: :mod:`.checkpoint`
(``--hetu-ckpt-format hetu``), :mod:`.weighting` (``--hetu-straggler-interval``), :mod:`.packing`
(``--hetu-packing``). What Megatron-LM's grid cannot hold goes to hetu_ext's trainer (:mod:`.handoff`).
"""

"""Megatron-LM's own ``pretrain_gpt.py`` with ``--hetu-*`` flags, nothing forked.

    torchrun --nproc-per-node 2 -m hetu_ext.megatron_lm PATH/TO/Megatron-LM/pretrain_gpt.py <its flags> --hetu-...

:mod:`.flags` splits the ``--hetu-*`` flags off the command line and checks them (with the Megatron-LM flags they
depend on); :mod:`.run` appends the checkout to the end of ``sys.path`` (pip's megatron-core stays the one
imported), applies the CPU patches when there is no CUDA (``hetu_ext.patches.megatron_lm``), installs the hooks the
flags ask for on Megatron-LM's patch points (:mod:`.hooks`) and runs the script as ``__main__``.
"""

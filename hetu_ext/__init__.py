"""hetu_ext: heterogeneous-parallel training systems (Malleus, Hydraulis, HotSPa, LobRA, Elastor) and FISEdit
as a plugin for Megatron-core and DeepSpeed.

Importing this package is cheap: Megatron-core, DeepSpeed and diffusers are imported only by their adapters
(``hetu_ext.megatron``, ``hetu_ext.deepspeed``, ``hetu_ext.diffusion``).
"""

__version__ = "0.1.0"

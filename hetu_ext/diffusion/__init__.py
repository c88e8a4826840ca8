"""FISEdit on diffusers: cache-enabled sparse inference for text-guided image editing (the only place in hetu_ext
that imports diffusers). `FISEditEngine` attaches to a `UNet2DConditionModel`; `FISEditPipeline` wraps a local
`StableDiffusionPipeline`."""

from hetu_ext.diffusion.config import FISEditConfig
from hetu_ext.diffusion.engine import FISEditEngine

__all__ = ["FISEditConfig", "FISEditEngine"]

"""Forward hooks that run a diffusers `Transformer2DModel`'s blocks on the active tokens only.

Everything inside a `BasicTransformerBlock` is per token except self-attention, so its own forward runs unchanged
on the gathered active tokens (B, n, C): LayerNorms, feed-forward, cross-attention and the projections cost n/N of
dense. Self-attention then sees keys/values of the active tokens only (FISEdit's default) or, with
`key_values="cached"`, of every token: fresh for active tokens, the generation's cached ones elsewhere. A block
built with diffusers' ``only_cross_attention`` has no self-attention (its first attention reads the text too), so
it is per token throughout and its sparse run is the dense one's on the active tokens.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hetu_ext.diffusion.mask import ActiveSet
from hetu_ext.diffusion.state import RunState


class _Current:
    """The active set the running Transformer2DModel call uses (None = dense)."""

    active: ActiveSet | None = None


def _attends_to_image(block: nn.Module) -> bool:
    """The block's first attention is self-attention (not diffusers' ``only_cross_attention``)."""
    return not getattr(block, "only_cross_attention", False)


def _per_token_macs(module: nn.Module) -> int:
    """MACs per image token of the blocks' linear layers; the text's key/value projections (per text token, not
    per image token) are left out."""
    total = 0
    for block in module.transformer_blocks:
        text_kv = ("attn2.to_k", "attn2.to_v") + (() if _attends_to_image(block) else ("attn1.to_k", "attn1.to_v"))
        total += sum(m.in_features * m.out_features for n, m in block.named_modules()
                     if isinstance(m, nn.Linear) and not n.endswith(text_kv))
    return total


def attach_transformer(name: str, module: nn.Module, st: RunState) -> list[RemovableHandle]:
    """Hook one Transformer2DModel (continuous input); returns the handles to remove on detach."""
    if not getattr(module, "is_input_continuous", False) or not len(module.transformer_blocks):
        return []
    cur = _Current()
    linear_tokens = int(_per_token_macs(module))
    blocks = module.transformer_blocks

    def on_call(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        batch, channels, height, width = hidden.shape
        cur.active = st.active(name, height, width)
        if st.phase == "record":
            tokens = height * width
            text = kwargs.get("encoder_hidden_states")
            text_len = text.shape[1] if text is not None else 0
            attention = sum(2 * tokens * channels * (tokens + text_len if _attends_to_image(block) else 2 * text_len)
                            for block in blocks)
            st.note_macs(name, batch * (tokens * linear_tokens + attention))

    def gather_args(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if cur.active is None:
            return None
        if args:
            return (args[0][:, cur.active.tokens], *args[1:]), kwargs
        kwargs = dict(kwargs, hidden_states=kwargs["hidden_states"][:, cur.active.tokens])
        return args, kwargs

    def scatter_tokens(mod: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        """Back to (B, N, C) for proj_out, which reads the active tokens only: the rest is left uninitialised."""
        if cur.active is None:
            return None
        full = output.new_empty(output.shape[0], cur.active.height * cur.active.width, output.shape[2])
        return full.index_copy_(1, cur.active.tokens, output)

    def scatter_cached(key: str) -> Any:
        def hook(mod: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
            if st.phase == "record":
                st.record(name, key, output, 0)
                return None
            if cur.active is None:
                return None
            full = st.cached(key, output.device).to(dtype=output.dtype, copy=True)
            return full.index_copy_(1, cur.active.tokens, output)
        return hook

    handles = [module.register_forward_pre_hook(on_call, with_kwargs=True)]
    if module.use_linear_projection:
        handles.append(module.proj_in.register_forward_pre_hook(gather_args, with_kwargs=True))
        handles.append(module.proj_out.register_forward_hook(scatter_cached(f"{name}#out")))
    else:  # conv projections are SparseConv2d wrappers: proj_in fills active tokens only, proj_out fills from the cache
        handles.append(blocks[0].register_forward_pre_hook(gather_args, with_kwargs=True))
        handles.append(blocks[-1].register_forward_hook(scatter_tokens))
    if st.config.key_values == "cached":
        for i, block in enumerate(blocks):
            if not _attends_to_image(block):
                continue
            handles.append(block.attn1.to_k.register_forward_hook(scatter_cached(f"{name}#k{i}")))
            handles.append(block.attn1.to_v.register_forward_hook(scatter_cached(f"{name}#v{i}")))
    return handles

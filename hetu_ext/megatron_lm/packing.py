"""Length-aware packing on Megatron-LM's own loop (``--hetu-packing METHOD``, data-parallel grids): Hydraulis's
packed THD microbatches from the train data iterator, hetu_ext's packed attention in the layer spec, a variable
number of microbatches per step.

Each step every rank computes the same assignment of the global batch's sequences (``--global-batch-size``
sequences, or ``--hetu-global-batch-tokens`` tokens) to the data-parallel ranks' microbatches
(:class:`hetu_ext.megatron.packed_data.PackedSteps`, the packer hetu_ext's trainer uses; ``balanced`` is Hydraulis's
two-stage length-aware one) and serves its own packs in Megatron-LM's batch format: ``tokens``, ``labels``,
``loss_mask``, ``position_ids`` of shape ``(1, t)``, ``cu_seqlens`` ``(1, documents + 1)`` and ``max_seqlen``, which
``pretrain_gpt.py``'s own ``get_batch`` turns into THD ``PackedSeqParams``. The local layer spec's core attention
becomes hetu_ext's PackedDotProductAttention (each document attends causally to itself only), so a pack computes exactly
what its documents would alone; with ``--calculate-per-token-loss`` (required, added by the entry point) the loss is
the reference's (``--hetu-packing unpacked``: one sequence per microbatch) up to summation order.

Documents: ``--mock-data --hetu-varlen-mock JSON`` (lengths drawn as hetu_ext's trainer draws them) or one indexed
dataset ``--data-path PREFIX``.

Patch points: ``gpt_builders._get_transformer_layer_spec`` (the script's spec builder), and in
``megatron.training.training``: ``build_pretraining_data_loader`` (the train loader) and
``get_forward_backward_func`` (this step's microbatch count).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hetu_ext.config import PackingConfig
from hetu_ext.megatron.attention import PackedDotProductAttention
from hetu_ext.patches.base import Patch
from hetu_ext.plan import ModelSpec, uniform_plan

TRAINING = "megatron.training.training"


class PackedLoader:
    """The train loader: ``begin_step()`` (from the schedule's wrapper) plans the next step and returns its
    microbatch count; iterating yields that step's packs."""

    def __init__(self, steps, start_step: int, *, report: bool = False) -> None:
        self.steps, self.step, self.report = steps, start_step, report
        self._queue: list[dict] = []

    def begin_step(self) -> int:
        data = self.steps.step(self.step)
        self.step += 1
        self._queue = [self._megatron_batch(mb) for mb in data.microbatches]
        if self.report:
            print(f"hetu_ext packing: step {self.step} | {data.sequences} sequences, {data.tokens} tokens | "
                  f"{len(self._queue)} packs on data-parallel rank 0", flush=True)
        return len(self._queue)

    @staticmethod
    def _megatron_batch(mb: dict) -> dict:
        batch = {k: mb[k] for k in ("tokens", "labels", "loss_mask", "position_ids")}
        packed = mb.get("packed_seq_params")
        if packed is not None:
            batch["cu_seqlens"] = packed.cu_seqlens_q.to(torch.int32).reshape(1, -1)
            batch["max_seqlen"] = torch.tensor([packed.max_seqlen_q], dtype=torch.int32)
        return batch

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if not self._queue:
            raise RuntimeError("the schedule asked for more microbatches than this step's packs")
        return self._queue.pop(0)


@dataclasses.dataclass
class MegatronLMPacking:
    """The packing hooks, one object per process."""

    config: PackingConfig
    loader: PackedLoader | None = None
    _train_loader_built: bool = False

    def _build(self, dataset: Any) -> PackedLoader:
        from megatron.core import parallel_state as ps
        from megatron.training import get_args

        from hetu_ext.megatron.packed_data import IndexedDocuments, build_packed_steps, varlen_mock_documents

        args = get_args()
        spec = ModelSpec(num_layers=args.num_layers, hidden_size=args.hidden_size,
                         num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
                         vocab_size=args.padded_vocab_size, seq_length=args.seq_length,
                         max_position_embeddings=args.max_position_embeddings,
                         untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights)
        if args.mock_data:
            documents = varlen_mock_documents(self.config.varlen_mock, vocab_size=args.padded_vocab_size,
                                              seed=args.seed, count=self.config.mock_documents)
        else:
            documents = IndexedDocuments(args.data_path[-1])
        plan = uniform_plan(world_size=ps.get_data_parallel_world_size(), num_layers=args.num_layers)
        steps = build_packed_steps(self.config, spec, plan, ps.get_data_parallel_rank(), documents,
                                   torch.device("cpu"), seed=args.seed, global_batch_size=args.global_batch_size)
        return PackedLoader(steps, start_step=args.iteration, report=torch.distributed.get_rank() == 0)

    def build_loader(self, original, dataset, consumed_samples, *args, **kwargs):
        if self._train_loader_built:
            return original(dataset, consumed_samples, *args, **kwargs)
        self._train_loader_built = True
        self.loader = self._build(dataset)
        return self.loader

    def patches(self) -> list[Patch]:
        def make_spec(original):
            def _get_transformer_layer_spec(*args, **kwargs):
                spec = original(*args, **kwargs)
                attention = getattr(getattr(spec.submodules, "self_attention", None), "submodules", None)
                core = getattr(attention, "core_attention", None)
                from megatron.core.transformer.dot_product_attention import DotProductAttention

                if isinstance(core, type) and issubclass(core, DotProductAttention):
                    attention.core_attention = PackedDotProductAttention  # the local spec; TE's takes THD itself
                return spec

            return _get_transformer_layer_spec

        def make_loader(original):
            def build_pretraining_data_loader(dataset, consumed_samples, *args, **kwargs):
                return self.build_loader(original, dataset, consumed_samples, *args, **kwargs)

            return build_pretraining_data_loader

        def make_fb(original):
            def get_forward_backward_func(*args, **kwargs):
                schedule = original(*args, **kwargs)

                def forward_backward(*f_args, **f_kwargs):
                    if not f_kwargs.get("forward_only") and self.loader is not None:
                        f_kwargs["num_microbatches"] = self.loader.begin_step()
                    return schedule(*f_args, **f_kwargs)

                return forward_backward

            return get_forward_backward_func

        def make_thd(original):
            def get_thd_batch_on_this_cp_rank(batch, cu_seqlens, *args, **kwargs):
                if cu_seqlens is not None and cu_seqlens.dim() > 1:  # Megatron-LM's (1, n): one pack per row
                    cu_seqlens = cu_seqlens.reshape(-1)
                return original(batch, cu_seqlens, *args, **kwargs)

            return get_thd_batch_on_this_cp_rank

        return [
            Patch(name="packing:get_thd_batch_on_this_cp_rank",
                  target="megatron.core.utils:get_thd_batch_on_this_cp_rank", make=make_thd, reason="pretrain_gpt.py hands the batch's (1, n) cu_seqlens on as they are; "
                                        "Megatron-core's THD RoPE and attention take (n,)"),
            Patch(name="packing:_get_transformer_layer_spec", target="gpt_builders:_get_transformer_layer_spec",
                  make=make_spec, reason="the local spec's core attention takes THD packs"),
            Patch(name="packing:build_pretraining_data_loader", target=f"{TRAINING}:build_pretraining_data_loader",
                  make=make_loader, reason="the train loader serves this rank's packs of each step"),
            Patch(name="packing:get_forward_backward_func", target=f"{TRAINING}:get_forward_backward_func",
                  make=make_fb, reason="a step runs as many microbatches as its packs"),
        ]

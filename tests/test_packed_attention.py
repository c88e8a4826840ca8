"""Packed (THD) core attention: a pack of documents through Megatron-core's GPTModel gives, token for token, the
output of each document run on its own (the property that makes packing invisible to training).

Tolerance: the packed path computes each document's attention with torch's SDPA, the reference with Megatron's
baddbmm + softmax; both are fp32 and differ only in summation order, ~1e-7 relative. 2e-6 absolute on per-token
losses of ~5.6 (and 1e-5 relative on gradients) leaves room for that and nothing else: attending across a document
boundary changes losses by >1e-2.
"""

from __future__ import annotations

import torch

from hetu_ext.testing.multiproc import run_ranks

LENGTHS = [5, 11, 1, 7]


def _body(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.packed_seq_params import PackedSeqParams

    from hetu_ext.megatron import host
    from hetu_ext.megatron.model import TrainingNumerics, build_gpt_stage, transformer_config
    from hetu_ext.megatron.plan_runtime import _pg_collection
    from hetu_ext.megatron.weights import init_weights
    from hetu_ext.plan import ModelSpec, uniform_plan
    from hetu_ext.runtime.groups import build_groups

    host.init_distributed(force_cpu=True)
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()
    tensor_parallel.model_parallel_cuda_manual_seed(3, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)
    spec = ModelSpec(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=64,
                     seq_length=32, max_position_embeddings=32)
    numerics = TrainingNumerics(hidden_dropout=0.0, attention_dropout=0.0)
    config = transformer_config(spec, numerics, tp=1, pp=1, on_cpu=True)
    groups = build_groups(uniform_plan(world_size=1, num_layers=2))
    model = build_gpt_stage(spec, config, pre_process=True, post_process=True, pg_collection=_pg_collection(groups))
    init_weights(model, seed=3, std=0.02, num_layers=2, metadata={"dp_cp_group": groups.single})
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 64, (n + 1,), generator=gen) for n in LENGTHS]

    def run(tokens, labels, positions, packed=None):
        model.zero_grad()
        loss = model(tokens, positions, None, labels=labels, packed_seq_params=packed)  # (1, s) per token
        loss.sum().backward()
        grad = model.decoder.layers[0].self_attention.linear_qkv.weight.grad.clone()
        return loss.detach().view(-1), grad

    separate = [run(d[None, :-1], d[None, 1:], torch.arange(len(d) - 1)[None]) for d in docs]
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(LENGTHS),
                             max_seqlen_kv=max(LENGTHS))
    pack_loss, pack_grad = run(torch.cat([d[:-1] for d in docs])[None], torch.cat([d[1:] for d in docs])[None],
                               torch.cat([torch.arange(len(d) - 1) for d in docs])[None], packed)
    # the same pack without document boundaries: must differ (the test can fail)
    whole = torch.tensor([0, sum(LENGTHS)], dtype=torch.int32)
    crossed, _ = run(torch.cat([d[:-1] for d in docs])[None], torch.cat([d[1:] for d in docs])[None],
                     torch.cat([torch.arange(len(d) - 1) for d in docs])[None],
                     PackedSeqParams(qkv_format="thd", cu_seqlens_q=whole, cu_seqlens_kv=whole,
                                     max_seqlen_q=sum(LENGTHS), max_seqlen_kv=sum(LENGTHS)))
    dist.barrier()
    host.shutdown()
    return {"separate_loss": torch.cat([s[0] for s in separate]),
            "separate_grad": sum(s[1] for s in separate), "pack_loss": pack_loss, "pack_grad": pack_grad,
            "crossed_loss": crossed}


def test_pack_equals_documents_run_separately():
    out = run_ranks(_body, 1, timeout=120)[0]
    torch.testing.assert_close(out["pack_loss"], out["separate_loss"], rtol=0, atol=2e-6)
    torch.testing.assert_close(out["pack_grad"], out["separate_grad"], rtol=1e-5, atol=1e-7)
    assert (out["crossed_loss"] - out["separate_loss"]).abs().max() > 1e-2

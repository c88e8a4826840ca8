"""Nothing of a model is skipped by hetu checkpoints: every entry Megatron-core's ``sharded_state_dict()`` returns
is saved or refused by name, and every save and load checks that its pieces cover every parameter element.

The bug these catch: ``local_shards`` used to ``continue`` past every entry that was not a ``ShardedTensor``, so a
SwiGLU model's gated ``linear_fc1`` (a ``ShardedTensorFactory``) was in no checkpoint and a resume silently
restarted it from its initialisation. The model options are the ones ``-m hetu_ext.megatron_lm`` accepts with
``--hetu-ckpt-format hetu`` (flags.HETU_CKPT_UNCOVERED lists the refused ones); TP 2 on 2 gloo ranks, so the
gated factory splits each rank's ``[gate_r; up_r]``. Comparisons are exact: nothing is computed, only moved.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from hetu_ext.testing.multiproc import RankError, run_ranks

OPTIONS = {
    "gpt": {},
    "swiglu": {"gated_linear_unit": True, "activation": "silu"},
    "quick_geglu": {"gated_linear_unit": True, "activation": "quick_gelu", "add_bias_linear": True},
    "rmsnorm": {"normalization": "RMSNorm"},
    "gqa": {"num_query_groups": 2},
    "qk_layernorm": {"qk_layernorm": True},
    "no_bias_qkv_bias": {"add_bias_linear": False, "add_qkv_bias": True},
    "untied_rope": {"untie": True, "rope": True},
    "llama": {"gated_linear_unit": True, "activation": "silu", "normalization": "RMSNorm", "num_query_groups": 2,
              "add_bias_linear": False, "untie": True, "rope": True},
}


def _model(rank: int, option: dict, *, tp: int = 2):
    """Megatron-core's GPTModel with the local layer spec (what Megatron-LM's gpt_builders builds with
    --transformer-impl local), TP ``tp``."""
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from hetu_ext.megatron.host import enable_cpu_support

    enable_cpu_support(True)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(1234)
    o = dict(option)
    act = {"silu": F.silu, "quick_gelu": quick_gelu}.get(o.pop("activation", None), F.gelu)
    untie, rope = o.pop("untie", False), o.pop("rope", False)
    norm = o.get("normalization", "LayerNorm")
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                               activation_func=act, use_cpu_initialization=True, pipeline_dtype=torch.float32,
                               **o)
    spec = get_gpt_layer_local_spec(normalization=norm, qk_layernorm=o.get("qk_layernorm", False))
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=128, max_sequence_length=16,
                    share_embeddings_and_output_weights=not untie,
                    position_embedding_type="rope" if rope else "learned_absolute")


def _inventory_body(rank: int, world: int):
    import torch

    from hetu_ext.megatron.weights import gather_weights, local_shards

    out = {}
    for name, option in OPTIONS.items():
        model = _model(rank, option)
        shards = local_shards(model)  # raises on an entry without a rule, or a parameter not covered
        full = gather_weights(model)  # every global element held by some rank, copies identical
        held = sum(p.numel() for p in model.parameters())
        gated = [s for s in shards if s.gated]
        # the gated weight: global (2, F, h) = (gate, up); this rank's rows of each half are its param's halves
        for s in gated:
            f = s.param.shape[0] // 2
            rows = s.slices[1]
            assert torch.equal(full[s.key][s.index][0][rows], s.param[:f])
            assert torch.equal(full[s.key][s.index][1][rows], s.param[f:])
        out[name] = {"held": held, "saved": sum(s.data.numel() for s in shards), "gated": len(gated),
                     "types": sorted({type(s.data).__name__ for s in shards})}
    return out


def test_every_model_option_is_saved_whole():
    """Each option of OPTIONS: the pieces cover exactly the parameters (element counts equal, checked in
    local_shards too) and the gated weights (SwiGLU, quick-GeGLU: fc1's weight and bias) hold gate and up in place."""
    results = run_ranks(_inventory_body, 2, timeout=240)
    for rank, result in enumerate(results):
        for name, r in result.items():
            assert r["saved"] == r["held"], (rank, name, r)
            option = OPTIONS[name]
            per_layer = (1 + option.get("add_bias_linear", True)) if option.get("gated_linear_unit") else 0
            assert r["gated"] == 2 * per_layer, (rank, name, r)  # 2 layers: fc1's weight (and bias) each


def _save_body(rank: int, world: int, directory: str, out: str):
    """Save a TP-2 Llama-style model through the hetu writer, convert it (safetensors on rank 0; torch_dist, which
    Megatron-core's dist_checkpointing and hetu_ext's torch_dist reader both load back exactly), and return what
    the module holds."""
    import torch
    import torch.distributed as dist

    from hetu_ext.checkpoint import LocalStorage
    from hetu_ext.checkpoint.cli import main as cli
    from hetu_ext.checkpoint.writer import Checkpointer, SaveConfig
    from hetu_ext.megatron.state import state_pieces
    from hetu_ext.megatron_lm.checkpoint import GridPlacement

    model = _model(rank, OPTIONS["llama"])
    ckpt = Checkpointer(LocalStorage(directory), SaveConfig(keep=1))
    ckpt.save(iteration=1, pieces=state_pieces(GridPlacement(model=model, optimizer=None)), rng={},
              info={"consumed_samples": 0, "plan": None, "config": {}, "state": {}}, blocking=True)
    fc1 = [model.decoder.layers[i].mlp.linear_fc1.weight.detach().clone() for i in range(2)]
    everyone: list = [None] * world
    dist.all_gather_object(everyone, fc1)
    dist.barrier()
    if rank == 0:
        assert cli(["convert", directory, out]) == 0
        assert cli(["convert", directory, f"{out}.torch_dist", "--to", "torch_dist"]) == 0
    dist.barrier()
    # the torch_dist export read back by Megatron-core's own loader and by hetu_ext's, into zeroed models
    from megatron.core import dist_checkpointing

    from hetu_ext.checkpoint.torch_dist import load_resharded

    megatron_side, hetu_side = _model(rank, OPTIONS["llama"]), _model(rank, OPTIONS["llama"])
    with torch.no_grad():
        for p in (*megatron_side.parameters(), *hetu_side.parameters()):
            p.zero_()
    wanted = {k: v for k, v in megatron_side.sharded_state_dict().items() if not k.endswith("_extra_state")}
    loaded = dist_checkpointing.load(wanted, f"{out}.torch_dist/iter_0000001")
    megatron_side.load_state_dict(loaded, strict=False)
    load_resharded(f"{out}.torch_dist/iter_0000001", state_pieces(GridPlacement(model=hetu_side, optimizer=None)))
    for (name, p), q, r in zip(model.named_parameters(), megatron_side.parameters(), hetu_side.parameters()):
        assert torch.equal(p, q) and torch.equal(p, r), name
    return [torch.stack(layer) for layer in zip(*everyone)]  # (tp, 2f, h) per layer


def test_gated_fc1_inspect_and_convert(tmp_path, capsys):
    """inspect marks the gated weight; convert writes Megatron's [gate; up] (2F x h), equal to the module's
    TP shards regrouped: [gate_0; gate_1; up_0; up_1] (a plain concatenation would give [g0; u0; g1; u1])."""
    from safetensors.torch import load_file

    from hetu_ext.checkpoint.cli import main as cli

    directory, out = str(tmp_path / "ckpt"), str(tmp_path / "full.safetensors")
    per_layer = run_ranks(_save_body, 2, directory, out, timeout=240)[0]
    saved = load_file(out)
    for layer, shards in enumerate(per_layer):
        f = shards.shape[1] // 2
        want = torch.cat([*(s[:f] for s in shards), *(s[f:] for s in shards)])
        got = saved[f"decoder.layers.{layer}.mlp.linear_fc1.weight"]
        assert got.shape == (4 * f, shards.shape[2]) and bool((got == want).all()), layer
    assert cli(["inspect", directory]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "mlp.linear_fc1.weight" in ln]
    assert len(lines) == 2 and all("2x48x32" in ln and "gated: [gate; up]" in ln for ln in lines), lines


def _unknown_body(rank: int, world: int, directory: str, kind: str):
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from hetu_ext.checkpoint import LocalStorage
    from hetu_ext.checkpoint.writer import Checkpointer, SaveConfig
    from hetu_ext.megatron.state import state_pieces
    from hetu_ext.megatron_lm.checkpoint import GridPlacement

    class Blob(torch.nn.Module):
        """A module whose state Megatron would carry as an object (unknown to hetu_ext), or not at all."""

        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(6))

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            if kind == "object":
                return {"blob": ShardedObject(f"{prefix}blob", self.w.data, (1,), (0,), replica_id=0)}
            return {}

    model = _model(rank, OPTIONS["swiglu"])
    model.blob = Blob()
    ckpt = Checkpointer(LocalStorage(directory), SaveConfig(keep=1))
    ckpt.save(iteration=1, pieces=state_pieces(GridPlacement(model=model, optimizer=None)), rng={},
              info={"consumed_samples": 0, "plan": None, "config": {}, "state": {}}, blocking=True)


@pytest.mark.parametrize("kind, message", [
    ("object", "blob.blob: sharded_state_dict() returned a ShardedObject that hetu_ext has no rule for"),
    ("missing", "the sharded state dict does not cover 1 parameter(s): blob.w (0 of 6 elements)"),
])
def test_unknown_or_missing_state_refuses_the_save(tmp_path, kind, message):
    """A model holding state hetu_ext cannot place (an unknown sharded object; a parameter absent from the sharded
    state dict) is refused with one line naming it, and nothing is written."""
    directory = tmp_path / "ckpt"
    with pytest.raises(RankError) as err:
        run_ranks(_unknown_body, 2, str(directory), kind, timeout=240)
    assert message in str(err.value), str(err.value)[-2000:]
    assert not any(directory.glob("iter_*")), list(directory.iterdir())


def test_uncovered_megatron_lm_option_refused_up_front(tmp_path):
    """--hetu-ckpt-format hetu with an option whose state has no rule (an MoE option outside the inventory's
    experts) exits 2 before any launch."""
    proc = subprocess.run([sys.executable, "-m", "hetu_ext.megatron_lm", __file__, "--num-experts", "4",
                           "--moe-latent-size", "4", "--hetu-ckpt-format", "hetu"], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert errors == ["hetu_ext.megatron_lm: error: --hetu-ckpt-format hetu has no rule for the MoE option "
                      "--moe-latent-size (its state, or its effect on the experts' tensors, is not in hetu_ext's "
                      "inventory); use Megatron-LM's own checkpoints (--hetu-ckpt-format auto) or drop "
                      "--moe-latent-size"], errors


def test_checkpoint_parts_own_their_keys_and_keep_the_record():
    """The trainer's checkpoint parts (hetu_ext.checkpoint.parts) write the record hetu checkpoints always held: the
    plain run's keys and LoRA's adapters checkpoint's, each owned by one part (a key claimed twice, or given by a
    part that does not declare it, is refused by name). Catches a part that would drop or rename a key of the
    on-disk format, so that old checkpoints stop loading or a value is silently not restored. Pure: the parts'
    keys are class attributes, no trainer is built."""
    from hetu_ext.checkpoint.parts import Part, restore_parts, state_record
    from hetu_ext.errors import HetuExtError
    from hetu_ext.lora.plugin import LoRAPlugin
    from hetu_ext.train.parts import training_parts

    plain = [key for part in training_parts(None) for key in part.keys]
    assert sorted(plain) == sorted(["data", "iteration", "losses", "scheduler", "optimizer_step", "grad_scaler",
                                    "rng", "assumed"])
    lora = [key for part in LoRAPlugin.parts(LoRAPlugin.__new__(LoRAPlugin), None) for key in part.keys]
    assert sorted(lora) == sorted(["iteration", "losses", "scheduler", "tenant_losses", "tenant_steps", "lora",
                                   "rng"])

    class Values(Part):
        def __init__(self, name, keys, values):
            self.name, self.keys, self.values, self.restored = name, keys, values, None

        def state_dict(self):
            return dict(self.values)

        def load_state_dict(self, saved, where):
            self.restored = {k: saved.get(k) for k in self.keys}

    a, b = Values("a", ("x",), {"x": 1}), Values("b", ("y", "z"), {"y": 2, "z": 3})
    assert state_record([a, b]) == {"x": 1, "y": 2, "z": 3}
    restore_parts([a, b], {"x": 10, "y": 20}, "here")
    assert a.restored == {"x": 10} and b.restored == {"y": 20, "z": None}
    with pytest.raises(HetuExtError, match="'x' is claimed by two parts, 'a' and 'c'"):
        state_record([a, Values("c", ("x",), {"x": 4})])
    with pytest.raises(HetuExtError, match=r"part 'd' gave \['w'\], which it does not declare"):
        state_record([Values("d", ("v",), {"w": 5})])

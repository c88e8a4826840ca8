"""The layer spec of ``--transformer-impl`` (hetu_ext/megatron/layer_spec.py) and its refusal where Transformer
Engine cannot run.

Transformer Engine cannot be installed on the project's CPU machines, so the Transformer Engine spec is never
built here: these tests check the decisions (which core attention, which norms, what is refused), the norm
parameters' names against Megatron-core's own key map, the launcher's one-line refusal, and that Megatron-LM's
recipes handed to the trainer on CPU still run the local spec (the rehearsal's rewrite). What stays untested until a
machine with Transformer Engine exists is listed in docs/training.md ("Attention and kernels").
"""

from __future__ import annotations

import importlib.util

import pytest

from hetu_ext.megatron.layer_spec import (
    LayerSpecChoice,
    check_transformer_impl,
    choose_layer_spec,
    te_norm_parameter,
    transformer_engine_missing,
)


@pytest.mark.parametrize("sp, zero, local_norms", [(False, False, False), (True, False, True), (False, True, True)])
def test_local_spec_keeps_hetu_attention_and_its_norms(sp, zero, local_norms):
    for attention in ("sdpa", "megatron"):
        assert choose_layer_spec("local", attention, sequence_parallel=sp, zero_centered_gamma=zero) == \
            LayerSpecChoice(impl="local", core_attention=attention, local_norms=local_norms, mark_te_norms=False)


@pytest.mark.parametrize("sp, zero", [(False, False), (True, False), (False, True), (True, True)])
def test_te_spec_keeps_its_attention_and_norms_and_marks_them(sp, zero):
    """Under TE the spec's fused attention and fused norms stay (no LocalNorm block, no hetu attention class); the
    norms' parameters are marked when sequence parallelism or zero-centred gamma needs the marks."""
    got = choose_layer_spec("transformer_engine", "sdpa", sequence_parallel=sp, zero_centered_gamma=zero)
    assert got == LayerSpecChoice(impl="transformer_engine", core_attention="transformer_engine", local_norms=False,
                                  mark_te_norms=sp or zero)


@pytest.mark.parametrize("impl, attention, lora, needle", [
    ("transformer_engine", "megatron", False, "--hetu-attention megatron picks the local spec's"),
    ("transformer_engine", "sdpa", True, "--hetu-lora-tenants adapts the local spec's linear layers"),
    ("inference_optimized", "sdpa", False, "--transformer-impl inference_optimized"),
])
def test_combinations_not_built_are_refused_in_one_line(impl, attention, lora, needle):
    with pytest.raises(ValueError, match=needle) as err:
        choose_layer_spec(impl, attention, sequence_parallel=False, zero_centered_gamma=False, lora=lora)
    assert "\n" not in str(err.value) and "give" in str(err.value)


def test_te_refused_where_it_cannot_run_and_accepted_where_it_can():
    """The launcher's check names the reason and both fixes; with Transformer Engine present (``missing`` answers
    None) the same flags pass. On this machine the package is absent, and the real lookup says so."""
    with pytest.raises(ValueError) as err:
        check_transformer_impl("transformer_engine", "sdpa", lora=False, missing=lambda: "no CUDA device")
    text = str(err.value)
    assert "\n" not in text and "no CUDA device" in text and "--transformer-impl local" in text
    check_transformer_impl("transformer_engine", "sdpa", lora=False, missing=lambda: None)
    check_transformer_impl("local", "megatron", lora=True, missing=lambda: "never asked")
    if importlib.util.find_spec("transformer_engine") is None:
        assert "not installed" in transformer_engine_missing()


def test_te_norm_names_are_megatrons_mapped_names():
    """The norms the TE spec fuses into its linears carry the names Megatron-core's local spec maps its
    standalone norms to (``sharded_state_dict_keys_map``), so both specs save the same checkpoint keys; linear
    weights, embeddings and the output layer are not norms."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    keys_map = get_gpt_layer_local_spec().submodules.sharded_state_dict_keys_map
    assert set(keys_map) == {"input_layernorm.", "pre_mlp_layernorm."}
    for prefix in keys_map.values():
        for suffix in ("weight", "bias"):
            assert te_norm_parameter(f"decoder.layers.0.{prefix}{suffix}")
    for name in ("decoder.final_layernorm.weight", "decoder.layers.3.self_attention.q_layernorm.weight",
                 "decoder.layers.3.self_attention.k_layernorm.bias"):
        assert te_norm_parameter(name), name
    for name in ("decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.0.mlp.linear_fc1.weight",
                 "decoder.layers.0.input_layernorm.weight", "embedding.word_embeddings.weight",
                 "output_layer.weight", "decoder.layers.0.mlp.linear_fc2.bias"):
        assert not te_norm_parameter(name), name


LAUNCH = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
          "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "1", "--lr", "1e-3", "--mock-data"]


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="TE installed")
@pytest.mark.parametrize("extra, needle", [
    (["--transformer-impl", "transformer_engine"], "--transformer-impl transformer_engine needs Transformer Engine"),
    (["--hetu-loss-chunk-tokens", "-1"], "--hetu-loss-chunk-tokens must be auto or a token count >= 0"),
])
def test_launcher_refuses_in_one_line_before_any_rank(capsys, extra, needle):
    """launch/pretrain_gpt.py's main: exit code 2 and one ``error:`` line, from the flag checks (no process group,
    no rank started)."""
    from hetu_ext.cli.train import main

    assert main(LAUNCH + extra) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "error:" in err[0] and needle in err[0], err


def test_recipe_handed_off_on_cpu_runs_the_local_spec(tmp_path, monkeypatch):
    """``-m hetu_ext.megatron_lm pretrain_gpt.py <Llama 3 recipe> --hetu-plan`` on CPU: the recipe's
    ``--transformer-impl transformer_engine`` becomes ``local`` with the rehearsal's one notice (as on Megatron-LM's
    own loop), so the trainer does not refuse it; with ``--hetu-cpu-patches off`` (a CUDA machine) it is passed on
    as given, and the trainer's check decides."""
    from hetu_ext.megatron_lm.flags import parse_invocation
    from hetu_ext.megatron_lm.rehearsal import handoff_rewrite

    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    plan = tmp_path / "plan.yaml"
    plan.write_text("pipelines: []\n")
    argv = [str(script), "--num-layers", "2", "--transformer-impl", "transformer_engine", "--hetu-plan", str(plan)]
    inv = parse_invocation(argv + ["--hetu-cpu-patches", "on"])
    assert inv.mode == "handoff" and inv.megatron_argv[2:4] == ["--transformer-impl", "local"]
    assert inv.notes == ["CPU rehearsal (no CUDA device): --transformer-impl transformer_engine -> "
                         "--transformer-impl local (CPU)"]
    inv = parse_invocation(argv + ["--hetu-cpu-patches", "off"])
    assert "transformer_engine" in inv.megatron_argv and inv.notes == []
    assert handoff_rewrite(["--transformer-impl=transformer_engine", "--x"]).argv == \
        ["--transformer-impl", "local", "--x"]
    assert handoff_rewrite(["--transformer-impl", "local"]).notice() is None

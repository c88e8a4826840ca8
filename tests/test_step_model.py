"""The step-time and memory model (issue 35): recomputation and sequence parallelism in the per-stage cost the
planners share, the device profiles, ``python -m hetu_ext.plan predict`` and its fit to published GPU throughput.
Pure and fast: no torch, no process group."""

from __future__ import annotations

import pytest

from hetu_ext.model import inventory as inv
from hetu_ext.model.spec import ModelSpec
from hetu_ext.plan.cost.stage import CostModel, stage_cost

GPT = ModelSpec(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=2048, vocab_size=51200)
LLAMA = ModelSpec(num_layers=4, hidden_size=1024, num_attention_heads=16, num_query_groups=4, ffn_hidden_size=2816,
                  swiglu=True, normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=False,
                  seq_length=2048, vocab_size=32000)
STAGE = dict(num_layers=4, slowdown=1.0, micro_batch=2, first=False, last=False, in_flight=3)


@pytest.mark.parametrize("spec", [GPT, LLAMA], ids=["gpt", "llama"])
def test_sequence_parallel_divides_every_activation_by_tp(spec):
    """Korthikanti et al. Table 2: with SP the 10 h TP left whole is split too, so a layer keeps
    (10 h + 24 h + 5 a s) / t; catches an SP that divides only part of it."""
    s = spec.seq_length
    for tp in (2, 4):
        whole = inv.activation_bytes_per_token(spec, tp=1, seq_length=s)
        assert inv.activation_bytes_per_token(spec, tp=tp, seq_length=s, sequence_parallel=True) == pytest.approx(
            whole / tp)
        assert inv.activation_bytes_per_token(spec, tp=tp, seq_length=s) > whole / tp


def test_recompute_keeps_what_korthikanti_counts():
    """GPT, Table 2 of Korthikanti et al.: selective keeps h (10 + 24/t) (34 h / t with SP); full keeps the
    layer input 2 h (2 h / t with SP)."""
    h, s = GPT.hidden_size, GPT.seq_length
    for tp in (1, 2, 8):
        sel = inv.activation_bytes_per_token(GPT, tp=tp, seq_length=s, recompute="selective")
        assert sel == pytest.approx(h * (10 + 24 / tp))
        assert inv.activation_bytes_per_token(GPT, tp=tp, seq_length=s, recompute="selective",
                                              sequence_parallel=True) == pytest.approx(34 * h / tp)
        assert inv.activation_bytes_per_token(GPT, tp=tp, seq_length=s, recompute="full") == 2 * h
        assert inv.activation_bytes_per_token(GPT, tp=tp, seq_length=s, recompute="full",
                                              sequence_parallel=True) == pytest.approx(2 * h / tp)
    with pytest.raises(ValueError, match="recompute must be one of none, selective, full, got 'ful'"):
        inv.activation_bytes_per_token(GPT, recompute="ful")


@pytest.mark.parametrize("spec", [GPT, LLAMA], ids=["gpt", "llama"])
def test_stage_cost_prices_recompute_and_sp(spec):
    """Defaults unchanged; full recompute adds one forward (FLOPs and all-reduces) to the backward and keeps less;
    selective adds the attention core; SP keeps the time and divides the activations."""
    cost = CostModel()
    base = stage_cost(spec, cost, tp=2, **STAGE)
    assert stage_cost(spec, cost, tp=2, recompute="none", sequence_parallel=False, **STAGE) == base
    full = stage_cost(spec, cost, tp=2, recompute="full", **STAGE)
    assert full.forward_s == base.forward_s
    assert full.backward_s == pytest.approx(base.backward_s + base.forward_s)
    assert full.memory_bytes < base.memory_bytes
    sel = stage_cost(spec, cost, tp=2, recompute="selective", **STAGE)
    tokens, sum_sq = 2 * spec.seq_length, 2 * spec.seq_length ** 2
    attention_s = 4 * sum_sq * inv.attention_flops_per_square_token(spec) / (cost.flops_per_s * 2 * 0.95)
    assert sel.backward_s == pytest.approx(base.backward_s + attention_s)
    assert inv.layer_recompute_flops(spec, tokens=tokens, sum_sq=sum_sq, recompute="full") == \
        inv.layer_forward_flops(spec, tokens=tokens, sum_sq=sum_sq)
    sp = stage_cost(spec, cost, tp=2, sequence_parallel=True, **STAGE)
    assert (sp.forward_s, sp.backward_s) == (base.forward_s, base.backward_s)
    static = stage_cost(spec, cost, tp=2, **{**STAGE, "in_flight": 0}).memory_bytes
    assert sp.memory_bytes - static == pytest.approx(
        2 * spec.seq_length * 4 * 3 * inv.activation_bytes_per_token(spec, tp=1, seq_length=spec.seq_length) / 2)


# ------------------------------------------------------------------------------ the step model and its CLI

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from hetu_ext.plan.cost import predict as cli  # noqa: E402
from hetu_ext.plan.cost import step_model as sm  # noqa: E402
from hetu_ext.plan.cost.devices import load_device, shipped_devices  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "benchmarks" / "published" / "narayanan2021.csv"
A100 = load_device("a100-80gb-sxm")


def _table_rows():
    return [cli.row_run(row, f"line {i}") for i, row in enumerate(cli.read_table(TABLE), start=2)]


def test_narayanan_table_1_within_15_percent_with_one_parameter_set():
    """Issue 35, acceptance 1: every row of Narayanan et al. SC'21 Table 1 (GPT 1.7B..1T on A100-80GB) predicted
    within 15% of the published TFLOP/s per GPU, with the one shipped A100 profile and the module's constants
    (nothing per row). The 15% is the issue's bar; today's largest error is about 5%, so a change to a shared
    formula that moves any row by 10% fails here."""
    rows = _table_rows()
    assert len(rows) == 10
    for row, (spec, _, _, _) in zip(cli.read_table(TABLE), rows):  # the shapes are Table 1's: 1.7B .. 1008.0B
        assert f"{inv.param_count(spec) / 1e9:.1f}B" == row["model"].split()[-1]
    for spec, par, device, published in rows:
        assert device == "a100-80gb-sxm"
        predicted = sm.predict(spec, par, A100).tflops_per_gpu
        assert abs(predicted / published - 1) <= 0.15, (spec.num_layers, spec.hidden_size, predicted, published)


def test_narayanan_rows_fit_the_device_and_an_oversized_run_does_not():
    """Acceptance 2: the runs Megatron-LM reports (they ran) are predicted to fit 80 GiB; and the memory model is
    not vacuous: GPT-3 175B on one node (TP 8, no pipeline) needs ~18 bytes x 175e9 / 8 of state alone."""
    for spec, par, _, _ in _table_rows():
        assert sm.predict(spec, par, A100).memory_bytes <= A100.memory_bytes
    gpt3 = ModelSpec(num_layers=96, hidden_size=12288, num_attention_heads=96, seq_length=2048, vocab_size=51200)
    one_node = sm.Parallel(tp=8, pp=1, dp=1, micro_batch_size=1, global_batch_size=8, recompute="full")
    assert sm.predict(gpt3, one_node, A100).memory_bytes > 4 * A100.memory_bytes


def test_flops_are_megatrons_formula_and_the_inventorys():
    """TFLOP/s are counted as Narayanan et al. do: 96 B s l h^2 (1 + s/6h + V/16lh) per step with full
    recomputation (72 ... V/12lh without); the step model takes them from the inventory, so both must agree."""
    for spec, par, _, _ in _table_rows():
        b, s, ll, h, v = par.global_batch_size, spec.seq_length, spec.num_layers, spec.hidden_size, \
            spec.padded_vocab_size
        assert sm.step_flops(spec, par) == pytest.approx(96 * b * s * ll * h * h * (1 + s / (6 * h)
                                                                                    + v / (16 * ll * h)), rel=1e-12)
        assert sm.step_flops(spec, par, recompute=False) == pytest.approx(
            72 * b * s * ll * h * h * (1 + s / (6 * h) + v / (12 * ll * h)), rel=1e-12)
    for spec in (GPT, LLAMA):
        gemms = sum(2 * n * k for _, n, k, _ in inv.layer_gemms(spec))
        assert gemms == inv.layer_matmul_flops_per_token(spec)


def test_options_move_the_prediction_the_right_way():
    """Recomputation costs time and saves memory; SP saves memory and keeps the collectives' time (same bytes, one
    more latency) while splitting the norms' and dropouts' work;
    the distributed optimizer saves memory; pipeline bubbles shrink with more microbatches or interleaving."""
    spec = ModelSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, seq_length=4096, vocab_size=32000)
    base = sm.Parallel(tp=4, pp=2, dp=4, micro_batch_size=1, global_batch_size=64)
    run = {name: sm.predict(spec, sm.Parallel(**{**base.__dict__, **kw}), A100) for name, kw in {
        "base": {}, "full": {"recompute": "full"}, "selective": {"recompute": "selective"},
        "sp": {"sequence_parallel": True}, "distopt": {"distributed_optimizer": True},
        "more_mb": {"global_batch_size": 256}, "interleaved": {"virtual_stages": 2}}.items()}
    assert run["full"].step_s > run["selective"].step_s > run["base"].step_s
    assert run["full"].memory_bytes < run["selective"].memory_bytes < run["base"].memory_bytes
    assert run["sp"].memory_bytes < run["base"].memory_bytes
    assert run["sp"].parts["tp_comm"] == pytest.approx(run["base"].parts["tp_comm"], rel=0.05)  # + latencies
    assert run["sp"].step_s < run["base"].step_s  # norms and dropouts split along the sequence too
    assert run["distopt"].memory_bytes < run["base"].memory_bytes
    assert run["more_mb"].parts["bubble"] / run["more_mb"].step_s < run["base"].parts["bubble"] / run["base"].step_s
    assert run["interleaved"].parts["bubble"] < run["base"].parts["bubble"]
    assert run["full"].tflops_per_gpu * run["full"].step_s > run["base"].tflops_per_gpu * run["base"].step_s


def test_device_profiles_load_and_refuse_unknown_keys(tmp_path):
    """The three shipped profiles load; a user's profile with a typo is refused naming the key and the fix."""
    assert {"a100-80gb-sxm", "h100-sxm", "h200"} <= set(shipped_devices())
    for name in ("a100-80gb-sxm", "H100-SXM", "h200"):
        d = load_device(name)
        assert d.peak_flops > 1e14 and 0 < d.efficiency(4096) <= 1 and d.memory_bytes > 7e10
    text = (ROOT / "hetu_ext/plan/cost/devices/a100-80gb-sxm.yaml").read_text()
    bad = tmp_path / "mine.yaml"
    bad.write_text(text.replace("hbm_bytes_per_s", "hbm_bytes_per_sec"))
    with pytest.raises(ValueError, match="unknown key 'hbm_bytes_per_sec'.*did you mean 'hbm_bytes_per_s'"):
        load_device(bad)
    with pytest.raises(ValueError, match="neither a shipped profile"):
        load_device(tmp_path / "absent.yaml")


def test_predict_cli_prints_the_table_and_refuses_bad_input_in_one_line(capsys):
    """The table mode ends with the issue's JSON line; bad input exits 2 with one line naming rule, values, fix
    (once through a real subprocess: the exit code a shell sees)."""
    from hetu_ext.plan.__main__ import main

    assert main(["predict", "--table", str(TABLE)]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [sorted(r) for r in last["rows"]] == [["error", "model", "predicted", "published"]] * 10
    assert main(["predict", "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
                 "--tensor-model-parallel-size", "2", "--gpus", "5"]) == 2
    assert "must be a positive multiple of --tensor-model-parallel-size" in capsys.readouterr().err
    proc = subprocess.run([sys.executable, "-m", "hetu_ext.plan", "predict", "--num-layers", "30", "--hidden-size",
                           "1024", "--num-attention-heads", "16", "--pipeline-model-parallel-size", "4"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0
    assert "--num-layers 30 must be divisible by pipeline stages" in proc.stderr


def test_a_one_gpu_layer_table_is_extended_to_the_tp_degrees_planners_search():
    """benchmarks/gpu_calibrate.sh measures TP 1 on one GPU; the planners' benchmarks price only the degrees their
    table holds, so TP 2/4/8 are derived (hetu_ext.plan.cost.calibration): measured entries kept, attention divided by
    t, per-token time smaller than TP 1's but more than 1/t of it (the TP all-reduces, smaller GEMMs)."""
    from hetu_ext.data.cost import load_cost_table
    from hetu_ext.plan.cost.calibration import extend_by_tp

    measured = load_cost_table(ROOT / "configs" / "calibration" / "cpu.yaml")
    spec = ModelSpec(num_layers=1, hidden_size=256, num_attention_heads=8, ffn_hidden_size=1024)
    table = extend_by_tp(measured, spec, load_device("h100-sxm"))
    assert sorted(table.per_tp) == [1, 2, 4, 8]
    assert table.per_tp[2] == measured.per_tp[2]
    one, eight = table.per_tp[1], table.per_tp[8]
    assert eight.a == pytest.approx(one.a / 8, rel=1e-9)
    assert one.b / 8 < eight.b < one.b
    assert eight.memory_per_token_bytes < one.memory_per_token_bytes
    assert "derived from TP 1" in table.note


def test_the_calibration_command_writes_the_extended_table(tmp_path, capsys):
    """``python -m hetu_ext.plan.cost.calibration`` (its main lives with the planners' command lines): the table it
    writes is extend_by_tp's; a bad device is one error line and exit code 2."""
    from hetu_ext.data.cost import load_cost_table
    from hetu_ext.plan.cli import calibration_main
    from hetu_ext.plan.cost.calibration import REFERENCE_TOKENS, extend_by_tp

    src, out = ROOT / "configs" / "calibration" / "cpu.yaml", tmp_path / "tp.yaml"
    flags = ["--table", str(src), "--out", str(out), "--hidden-size", "256", "--num-attention-heads", "8",
             "--ffn-hidden-size", "1024", "--tp", "2,4"]
    assert calibration_main([*flags, "--device", "h100-sxm"]) == 0
    spec = ModelSpec(num_layers=1, hidden_size=256, num_attention_heads=8, ffn_hidden_size=1024,
                     seq_length=REFERENCE_TOKENS)
    want = extend_by_tp(load_cost_table(src), spec, load_device("h100-sxm"), (2, 4))
    assert load_cost_table(out).per_tp == want.per_tp
    assert f"wrote {out}" in capsys.readouterr().out
    assert calibration_main([*flags, "--out", str(tmp_path / "no.yaml"), "--device", "no-such-gpu"]) == 2
    assert not (tmp_path / "no.yaml").exists()
    assert capsys.readouterr().err.startswith("error: ")


def test_planners_stage_cost_prices_a_layer_as_the_step_model_does():
    """planner_cost_model hands the planners (stage_cost) the step model's per-layer compute for a device: one
    layer's forward at every TP degree equals the step model's to rounding; the TP all-reduces differ only by the
    collectives' latency (stage_cost has none)."""
    spec = ModelSpec(num_layers=8, hidden_size=4096, num_attention_heads=32, seq_length=4096, vocab_size=32000)
    cost = sm.planner_cost_model(spec, A100, micro_batch=2)
    for tp in (1, 2, 4, 8):
        st = stage_cost(spec, cost, num_layers=1, tp=tp, slowdown=1.0, micro_batch=2, first=False, last=False,
                        in_flight=1)
        ours = sm.layer_pass(spec, A100, sm.Parallel(tp=tp, micro_batch_size=2))
        assert st.forward_s == pytest.approx(ours.compute_f + ours.comm_f, rel=5e-3)  # latency: 2 x 10 us
        assert st.backward_s == pytest.approx(ours.compute_b + ours.comm_b, rel=5e-3)


def test_a_measured_layer_table_in_the_profile_replaces_the_flop_model(tmp_path):
    """A profile's ``calibrate`` table prices the layers of the shape it measured (a s^2 + b s + c per sequence,
    at the TP degrees it holds); other shapes and degrees keep the FLOP model."""
    (tmp_path / "layer.yaml").write_text(
        "device: test\nper_tp:\n  1: {a: 1.0e-9, b: 1.0e-5, c: 0.001}\n")
    text = (ROOT / "hetu_ext/plan/cost/devices/a100-80gb-sxm.yaml").read_text()
    (tmp_path / "dev.yaml").write_text(text + "calibrate: {table: layer.yaml, hidden_size: 1024, "
                                       "num_attention_heads: 16, ffn_hidden_size: 4096}\n")
    measured = load_device(tmp_path / "dev.yaml")
    par = sm.Parallel(micro_batch_size=2, global_batch_size=2)
    s = GPT.seq_length
    layer = sm.measured_layer_pass(GPT, measured, par)
    assert layer.total == pytest.approx(2 * (1e-9 * s * s + 1e-5 * s) + 0.001)
    assert sm.measured_layer_pass(GPT, measured, sm.Parallel(tp=2, micro_batch_size=2, global_batch_size=2)) is None
    assert sm.measured_layer_pass(LLAMA, measured, par) is None
    assert sm.predict(GPT, par, measured).step_s != sm.predict(GPT, par, A100).step_s


def test_gpu_calibration_script_parses_and_refuses_a_machine_without_cuda():
    """benchmarks/gpu_calibrate.sh is ready for a lent GPU: bash accepts it, and without CUDA it stops at once with
    one line and exit 2 (nothing measured, nothing written)."""
    script = ROOT / "benchmarks" / "gpu_calibrate.sh"
    assert subprocess.run(["bash", "-n", str(script)], timeout=30).returncode == 0
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine would run the calibration for real")
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**__import__("os").environ, "PYTHON": sys.executable, "OUT": "/nonexistent/x"})
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA device" in proc.stderr and proc.stderr.strip().count("\n") == 0


def test_flash_attention_keeps_no_scores_in_the_predicted_memory():
    """--use-flash-attn: the predicted memory per GPU drops by the inventory's 5 a s score bytes per token for every
    layer and microbatch the stage holds in flight (and the step time does not move by the memory model)."""
    spec = ModelSpec(num_layers=8, hidden_size=2048, num_attention_heads=16, seq_length=4096, vocab_size=32000)
    par = dict(tp=2, pp=2, dp=2, micro_batch_size=1, global_batch_size=16)
    plain = sm.predict(spec, sm.Parallel(**par), A100)
    flash = sm.predict(spec, sm.Parallel(**par, flash_attention=True), A100)
    per_token = (inv.activation_bytes_per_token(spec, tp=2, seq_length=4096)
                 - inv.activation_bytes_per_token(spec, tp=2, seq_length=4096, attention_scores=False))
    assert per_token > 0
    in_flight = 2  # 1F1B: the first of 2 stages holds 2 microbatches (the largest stage)
    assert plain.memory_bytes - flash.memory_bytes == pytest.approx(4096 * per_token * 4 * in_flight, rel=1e-9)


LLAMA3_TABLE = ROOT / "benchmarks" / "published" / "llama3_2024.csv"


def test_llama3_table_4_within_15_percent_with_narayanans_parameter_set():
    """Issue 48, acceptance 2: the three Llama 3 405B rows (Dubey et al. 2024, Table 4: H100, TP 8 x PP 16, 126
    layers with the first and last stage one layer short, CP 16 at 131K) predicted within 15% by the same
    constants and device curves that keep Narayanan's Table 1 within 15% (the test above: nothing per row). The
    published figures are model FLOPs (TFLOP/s = MFU x 989), so the row's tflops_count is ``model``: counted with
    Megatron's whole square instead, the 131K row comes out ~47% high, which this test would catch."""
    from hetu_ext.plan.cost.predict import counted_tflops, row_count

    h100 = load_device("h100-sxm")
    rows = cli.read_table(LLAMA3_TABLE)
    assert len(rows) == 3
    for i, row in enumerate(rows, start=2):
        spec, par, device, published = cli.row_run(row, f"line {i}")
        assert (device, par.tp, par.pp, spec.num_layers) == ("h100-sxm", 8, 16, 126)
        assert sm.stage_layers(spec, par) == [7] + [8] * 14 + [7]
        assert par.gpus in (8192, 16384) and par.global_batch_size * spec.seq_length == 2**24  # 16M tokens
        r = sm.predict(spec, par, h100)
        assert abs(counted_tflops(r, h100, row_count(row, "")) / published - 1) <= 0.15, (i, published)
        if par.cp > 1:
            assert r.parts["cp_comm"] > 0 and abs(r.tflops_per_gpu / published - 1) > 0.3


def test_uneven_first_and_last_stages_follow_megatrons_rules():
    """--decoder-first/last-pipeline-num-layers: 126 layers over PP 16 (refused as uneven without them) split
    7, 8 x 14, 7; the even split given explicitly predicts exactly the plain run; a split the middle stages cannot
    share evenly (or more layers than the model has) is one line naming both flags' values."""
    spec = ModelSpec(num_layers=126, hidden_size=1024, num_attention_heads=16, seq_length=1024, vocab_size=32000)
    base = dict(tp=1, pp=16, dp=1, micro_batch_size=1, global_batch_size=32)
    with pytest.raises(ValueError, match="--num-layers 126 must be divisible.*--decoder-first-pipeline-num-layers"):
        sm.check(spec, sm.Parallel(**base))
    uneven = sm.Parallel(**base, first_stage_layers=7, last_stage_layers=7)
    assert sm.stage_layers(spec, uneven) == [7] + [8] * 14 + [7]
    assert sm.stage_layers(spec, sm.Parallel(**base, first_stage_layers=6)) == [6] + [8] * 15
    for first, last in ((8, None), (7, 9), (120, 7), (None, 0)):
        with pytest.raises(ValueError, match="first|last"):
            sm.check(spec, sm.Parallel(**base, first_stage_layers=first, last_stage_layers=last))
    even = ModelSpec(**{**spec.__dict__, "num_layers": 128})
    plain = sm.predict(even, sm.Parallel(**base), A100)
    assert sm.predict(even, sm.Parallel(**base, first_stage_layers=8, last_stage_layers=8), A100) == plain
    lighter = sm.predict(spec, uneven, A100)  # the output layer no longer sits on a full stage: the slowest is lighter
    assert lighter.parts["compute"] < plain.parts["compute"] and lighter.step_s < plain.step_s


def test_tp_comm_overlap_hides_collectives_behind_gemms_and_needs_sp():
    """--tp-comm-overlap: each SP all-gather / reduce-scatter hides behind the GEMM beside it, so the exposed TP
    time falls (to zero where every GEMM is longer), never below zero, and the compute is unchanged; Megatron-LM
    refuses it without --sequence-parallel, and so does the model."""
    spec = ModelSpec(num_layers=8, hidden_size=4096, num_attention_heads=32, seq_length=4096, vocab_size=32000)
    base = dict(tp=8, pp=1, dp=1, micro_batch_size=1, global_batch_size=8, sequence_parallel=True)
    plain = sm.predict(spec, sm.Parallel(**base), A100)
    hidden = sm.predict(spec, sm.Parallel(**base, tp_comm_overlap=True), A100)
    assert 0 <= hidden.parts["tp_comm"] < plain.parts["tp_comm"]
    assert hidden.parts["compute"] == pytest.approx(plain.parts["compute"])
    slow_link = sm.predict(spec, sm.Parallel(**base, tp_comm_overlap=True), load_device("h100-sxm"))
    assert slow_link.step_s > 0
    with pytest.raises(ValueError, match="--tp-comm-overlap needs --sequence-parallel"):
        sm.check(spec, sm.Parallel(**{**base, "sequence_parallel": False}, tp_comm_overlap=True))


def test_context_parallelism_splits_work_and_memory_and_prices_the_kv_exchange():
    """CP c: each rank computes 1/c of the layer's FLOPs (attention balanced over two chunks per rank), keeps 1/c
    of the activations, and pays the K/V exchange: exposed all-gathers >= a ring overlapped with attention, and
    dearer across nodes (TP 8 x CP 2 leaves the node). The step's FLOPs do not depend on CP; a sequence that does
    not split into 2 c chunks is refused."""
    spec = ModelSpec(num_layers=8, hidden_size=4096, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=14336,
                     swiglu=True, seq_length=32768, vocab_size=32000)
    base = dict(tp=4, pp=1, micro_batch_size=1, global_batch_size=8, sequence_parallel=True, flash_attention=True)
    one, two = sm.Parallel(**base, dp=2), sm.Parallel(**base, dp=1, cp=2, cp_comm_type="all_gather")
    assert sm.step_flops(spec, one) == sm.step_flops(spec, two)
    l1, l2 = sm.layer_pass(spec, A100, one), sm.layer_pass(spec, A100, two)
    assert 0.45 < l2.compute_f / l1.compute_f < 0.6  # half the work, at a slightly lower GEMM efficiency
    assert l1.cp_f == 0 < l2.cp_f
    ring = sm.layer_pass(spec, A100, sm.Parallel(**base, dp=1, cp=2, cp_comm_type="p2p"))
    gather = sm.layer_pass(spec, A100, sm.Parallel(**base, dp=1, cp=2, cp_comm_type="all_gather"))
    assert ring.cp_f <= gather.cp_f and ring.cp_b <= gather.cp_b  # here the ring hides behind the attention
    short = ModelSpec(**{**spec.__dict__, "seq_length": 4096})  # little attention to hide the ring behind
    assert sm.layer_pass(short, A100, sm.Parallel(**{**base, "tp": 8}, dp=1, cp=4)).cp_f > 0
    across = sm.layer_pass(spec, A100, sm.Parallel(**{**base, "tp": 8}, dp=1, cp=2, cp_comm_type="all_gather"))
    assert across.cp_f > gather.cp_f
    p1, p2 = sm.predict(spec, one, A100), sm.predict(spec, two, A100)
    assert p2.memory_bytes < p1.memory_bytes and p2.parts["cp_comm"] > 0 == p1.parts["cp_comm"]
    cost = CostModel()
    st1 = stage_cost(spec, cost, tp=4, **{**STAGE, "micro_batch": 1})
    st2 = stage_cost(spec, cost, tp=4, cp=2, **{**STAGE, "micro_batch": 1})
    assert st2.forward_s < st1.forward_s and st2.memory_bytes < st1.memory_bytes
    with pytest.raises(ValueError, match="divisible by 2 x --context-parallel-size"):
        sm.check(ModelSpec(**{**spec.__dict__, "seq_length": 32766}), two)

"""Typed configuration and metrics records (issue 13): the precedence rule, one strict-key check for every file,
a YAML file of every setting reproducing a CLI run bit for bit, and the metrics file / TensorBoard events a run
writes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import yaml
from helpers import MODEL, ROOT, assert_one_error_line, run
from helpers import gpt_argv

from hetu_ext.config import build_parser, from_namespace, parse_namespace
from hetu_ext.metrics import format_log_line, read_records
from hetu_ext.testing.multiproc import run_ranks
from hetu_ext.cli.runs import train

BASE = MODEL + ["--train-iters", "2", "--mock-data"]


def _config(argv: list[str]):
    return from_namespace(parse_namespace(argv, build_parser()))


def test_precedence_default_file_typed_flag(tmp_path):
    """defaults < file < typed flags; a typed flag equal to its default still wins (the old rule let the file
    override an explicit --hetu-runtime auto, because a flag at its default counted as not given)."""
    path = tmp_path / "run.yaml"
    path.write_text("parallel: {runtime: plan}\ntraining: {lr: 0.5, seed: 9}\nmodel: {hidden_dropout: 0.0}\n")
    assert _config(BASE).parallel.runtime == "auto"  # default
    config = _config(BASE + ["--hetu-config", str(path)])
    assert (config.parallel.runtime, config.training.seed, config.model.hidden_dropout) == ("plan", 9, 0.0)  # file
    assert config.training.lr == 1e-3  # typed --lr 1e-3 beats the file's 0.5
    typed = _config(BASE + ["--hetu-config", str(path), "--hetu-runtime", "auto", "--seed", "1234"])
    assert (typed.parallel.runtime, typed.training.seed) == ("auto", 1234)  # typed, equal to the defaults
    order = _config(["--hetu-config", str(path)] + BASE + ["--hetu-runtime=auto"])  # either spelling, any order
    assert order.parallel.runtime == "auto"


def test_required_settings_may_come_from_the_file(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text("model: {num_layers: 4, hidden_size: 32, num_attention_heads: 4, seq_length: 32}\n")
    config = _config(["--hetu-config", str(path), "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters",
                      "2", "--mock-data"])
    assert (config.model.num_layers, config.model.seq_length) == (4, 32)
    with pytest.raises(ValueError, match="--num-layers is required: give the flag, or model.num_layers in"):
        _config(["--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "2", "--mock-data"])


def _write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("where", ["config", "config_section", "plan", "packing", "cost_model", "length_mock"])
def test_unknown_key_anywhere_is_one_line_with_a_suggestion(tmp_path, where):
    """Every file the project reads goes through one strict-key check (hetu_ext/keys.py): exit 2, one line
    naming the key and the closest valid one."""
    packing = ["--micro-batch-size", "1", "--global-batch-size", "2", "--hetu-packing", "balanced"]
    argv, needle = {
        "config": (["--hetu-config", _write(tmp_path, "c.yaml", "trainng: {lr: 1.0}\n")],
                   "unknown key 'trainng' in --hetu-config"),
        "config_section": (["--hetu-config", _write(tmp_path, "c2.yaml", "training: {lrr: 1.0}\n")],
                           "unknown key 'lrr' under training in --hetu-config"),
        "plan": (["--hetu-plan", _write(tmp_path, "p.yaml", "pipelines: [{stages: [{ranks: [0], layer: [0, 4]}]}]")],
                 "unknown key 'layer' in pipeline 0 stage 0"),
        "packing": (["--hetu-config", _write(tmp_path, "c3.yaml", "packing: {methd: balanced}\n")],
                    "unknown key 'methd' under packing in --hetu-config"),
        "cost_model": (packing + ["--hetu-varlen-mock", '{"mode": "file", "path": "hetu_ext/data/samples/'
                                  'wikipedia_lengths_20k.txt.gz"}', "--hetu-cost-model",
                                  _write(tmp_path, "cost.yaml", "device: cpu\nper_tpp: {1: {a: 1.0, b: 1.0}}\n")],
                       "unknown key 'per_tpp' in cost table file"),
        "length_mock": (packing + ["--hetu-varlen-mock", '{"mode": "file", "pth": "x.txt"}'],
                        "unknown key 'pth' in the length spec (mode 'file')"),
    }[where]
    proc = run(BASE + argv)
    assert_one_error_line(proc, needle)
    hint = {"config": "did you mean 'training'?", "config_section": "did you mean 'lr'?",
            "plan": "did you mean 'layers'?", "packing": "did you mean 'method'?",
            "cost_model": "did you mean 'per_tp'?", "length_mock": "did you mean 'path'?"}[where]
    assert hint in proc.stderr, proc.stderr


def test_a_yaml_of_every_setting_reproduces_the_cli_run_bit_for_bit(sample_prefix, tmp_path):
    """Acceptance 3: --hetu-print-config writes every setting of a command line; training from that file alone
    gives the same losses and weights, bit for bit (TP 2, so layout settings travel too)."""
    argv = gpt_argv(2, 1, sample_prefix, ("--lr-decay-style", "linear", "--lr-warmup-iters", "1"))
    printed = subprocess.run([sys.executable, str(ROOT / "launch" / "pretrain_gpt.py"), *argv, "--hetu-print-config"],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert printed.returncode == 0, printed.stderr
    settings = yaml.safe_load(printed.stdout)
    assert settings["parallel"]["tensor_model_parallel_size"] == 2 and settings["data"]["data_path"] == [
        sample_prefix]
    config = tmp_path / "every_setting.yaml"
    config.write_text(printed.stdout)
    cli = next(r for r in run_ranks(train, 2, argv, timeout=180) if r is not None)
    from_file = next(r for r in run_ranks(train, 2, ["--hetu-config", str(config)], timeout=180) if r is not None)
    assert cli["losses"] == from_file["losses"]
    assert cli["weights"].keys() == from_file["weights"].keys()
    assert all(torch.equal(cli["weights"][k], from_file["weights"][k]) for k in cli["weights"])


def test_metrics_records_log_lines_and_tensorboard(sample_prefix, tmp_path):
    """Acceptance 4: every step appends one record; the Megatron-LM line is formatted from it; TensorBoard gets
    the same scalars (read back with tensorboard's own reader)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics, board = tmp_path / "metrics.jsonl", tmp_path / "tb"
    argv = gpt_argv(1, 2, sample_prefix, ("--hetu-metrics-file", str(metrics), "--tensorboard-dir", str(board)))
    result = next(r for r in run_ranks(train, 2, argv, timeout=180) if r is not None)
    steps = read_records(metrics, kind="step")
    assert [r["iteration"] for r in steps] == [1, 2, 3]
    assert [r["loss"] for r in steps] == result["losses"]
    for record in steps:
        assert record["samples"] == 8 and record["tokens"] == 8 * 32 and record["ranks"] == 2
        assert record["step_ms"] > 0 and record["tokens_per_s"] > 0 and record["tflops_per_rank"] > 0
        assert record["mfu"] is None  # no known peak on a CPU
        assert record["grad_norm"] > 0 and record["lr"] == 1e-3 and len(record["plan_id"]) == 10
    lines = [line for line in result["log_lines"] if "iteration" in line]
    assert [line.split("|")[1:] for line in lines] == [format_log_line(r).split("|")[1:] for r in steps]
    events = EventAccumulator(str(board))
    events.Reload()
    losses = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert losses == [(r["iteration"], pytest.approx(r["loss"], rel=1e-6)) for r in steps]
    assert {"train/tokens_per_s", "train/grad_norm", "train/lr"} <= set(events.Tags()["scalars"])
    assert json.loads(metrics.read_text().splitlines()[0])["kind"] == "step"


def test_checkpoint_events_and_one_restore_for_every_format(sample_prefix, tmp_path):
    """Acceptance of the training state: a save and a resume write checkpoint_save / checkpoint_load events; the
    resumed run's state (iteration, losses, schedule) came through the one restore path, whose data-settings check
    refuses a changed global batch for the hetu format as for the others."""
    from hetu_ext.testing.multiproc import RankError

    save, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    first = gpt_argv(1, 1, sample_prefix, ("--train-iters", "2", "--lr-decay-iters", "4", "--save", str(save),
                                        "--save-interval", "1", "--hetu-metrics-file", str(metrics)))
    run_ranks(train, 2, first, False, timeout=180)
    saves = read_records(metrics, event="checkpoint_save")
    assert [(r["iteration"], r["format"]) for r in saves] == [(1, "hetu"), (2, "hetu")]
    assert saves[0]["blocking_s"] > 0 and saves[0]["total_s"] is None  # persisted in the background
    assert saves[1]["total_s"] == saves[1]["blocking_s"]  # the last save of a run blocks until committed
    resumed = gpt_argv(1, 1, sample_prefix, ("--train-iters", "4", "--lr-decay-iters", "4", "--load", str(save),
                                          "--save", str(save), "--hetu-metrics-file", str(metrics)))
    result = next(r for r in run_ranks(train, 2, resumed, False, timeout=180) if r is not None)
    loads = read_records(metrics, event="checkpoint_load")
    assert len(loads) == 1 and loads[0]["iteration"] == 2 and loads[0]["blocking_s"] > 0
    assert len(result["losses"]) == 4  # the two saved losses and two more
    changed = [a if a != "8" else "16" for a in resumed]  # another global batch: samples would repeat
    with pytest.raises(RankError, match=r"other data settings \(saved, now\): \{'global_batch_size': \(8, 16\)\}"):
        run_ranks(train, 2, changed, False, timeout=180)

"""launch/elastic.py rewrites pretrain_gpt.py's flags for a restart as argparse reads them (pure).

The rewrite went token by token and matched only ``--load DIR``: ``--load=OLD`` (argparse's other spelling)
stayed in the argv beside the appended ``--load DIR``, ``--hetu-plan=OLD`` likewise (argparse keeps the last of
each, so which one won depended on order), and ``--save=DIR`` was not seen at all, so a run with checkpoints was
refused a restart ("need --save DIR"). Each spelling is checked here, and the rewritten argv is parsed back by
pretrain_gpt.py's own parser: the new plan, --save's directory, no TP/PP left over.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from hetu_ext.config import build_parser, from_namespace, parse_namespace

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("elastic", ROOT / "launch" / "elastic.py")
elastic = importlib.util.module_from_spec(spec)
spec.loader.exec_module(elastic)

MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4", "--lr", "1e-3", "--mock-data"]


def _parsed(argv: list[str]):
    return from_namespace(parse_namespace(argv, build_parser()))


@pytest.mark.parametrize("spelling", ["space", "equals"])
def test_restart_replaces_plan_load_and_layout_in_either_spelling(spelling):
    def flag(name: str, value: str) -> list[str]:
        return [name, value] if spelling == "space" else [f"{name}={value}"]

    argv = [*MODEL[:4], *flag("--save", "ckpt"), *flag("--load", "old_ckpt"), *MODEL[4:],
            *flag("--hetu-plan", "old.yaml"), *flag("--tensor-model-parallel-size", "2"),
            *flag("--pipeline-model-parallel-size", "2"), *flag("--save-interval", "2")]
    again = elastic.restart_argv(argv, plan_path="ckpt/elastic_plan_3.yaml")
    kept = [*MODEL[:4], *flag("--save", "ckpt"), *MODEL[4:], *flag("--save-interval", "2")]
    assert again == kept + ["--hetu-plan", "ckpt/elastic_plan_3.yaml", "--load", "ckpt"]
    config = _parsed(again)
    assert (config.parallel.plan, config.checkpoint.load, config.checkpoint.save) == \
        ("ckpt/elastic_plan_3.yaml", "ckpt", "ckpt")
    assert (config.parallel.tensor_model_parallel_size, config.parallel.pipeline_model_parallel_size) == (1, 1)
    assert config.checkpoint.save_interval == 2


def test_restart_loads_the_save_pretrain_gpt_uses():
    """The last --save typed (argparse's rule), whatever its spelling; --save-interval alone is not --save
    (no abbreviations: pretrain_gpt.py's parser has allow_abbrev=False)."""
    again = elastic.restart_argv([*MODEL, "--save", "first", "--save=second"], plan_path="p.yaml")
    assert again[-2:] == ["--load", "second"] and _parsed(again).checkpoint.save == "second"
    with pytest.raises(ValueError, match="need --save DIR"):
        elastic.restart_argv([*MODEL, "--save-interval", "2"], plan_path="p.yaml")


def test_restart_loads_a_save_given_in_the_config_file(tmp_path):
    """--save in the --hetu-config file (no flag typed): the restart loads it, resolved as the file's paths are."""
    config = tmp_path / "run.yaml"
    config.write_text("checkpoint: {save: ckpt, save_interval: 2}\nparallel: {tensor_model_parallel_size: 1}\n")
    argv = [*MODEL, "--hetu-config", str(config)]
    again = elastic.restart_argv(argv, plan_path="p.yaml")
    assert again[:-4] == argv and again[-1] == _parsed(argv).checkpoint.save
    assert Path(again[-1]).name == "ckpt"


DS = ["--zero-stage", "2", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
      "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "12", "--train-iters", "4",
      "--lr", "1e-3", "--mock-data"]


def test_deepspeed_round_loads_the_save_once_it_holds_a_checkpoint(tmp_path):
    """``--launcher deepspeed``: a round's flags are the job's own until ``--save`` holds a checkpoint (the first
    round keeps the user's --load, in either spelling), then --load that directory, whichever --load was typed;
    no --hetu-plan is added (the DeepSpeed path refuses it: the world size is its layout)."""
    from hetu_ext.elastic.entries import ENTRIES

    entry = ENTRIES["deepspeed"]
    save, old = tmp_path / "ckpt", tmp_path / "old"
    old.mkdir()
    argv = [*DS, f"--load={old}", "--save", str(save), "--save-interval", "2"]
    assert entry.round_argv(argv, "plan.yaml") == argv  # no --save directory yet
    save.mkdir()
    assert entry.round_argv(argv, "plan.yaml") == argv  # an empty one: still the first round
    (save / "global_step2").mkdir()
    (save / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    (save / "latest").write_text("global_step2")
    again = entry.round_argv(argv, "plan.yaml")
    assert again == [*DS, "--save", str(save), "--save-interval", "2", "--load", str(save)]
    entry.check_round(again, 3)  # 12 microbatches over 3 ranks
    with pytest.raises(ValueError, match="multiple of --micro-batch-size 1 x world size 5"):
        entry.check_round(again, 5)


def test_deepspeed_flags_an_elastic_job_cannot_keep_are_refused_before_any_rank_starts():
    """Fixed per-rank counts (--hetu-microbatches) would fail the first restart on another number of ranks, and a
    job without --save has nothing to resume from: both refused with the fix, before launch."""
    from hetu_ext.elastic.entries import ENTRIES

    entry = ENTRIES["deepspeed"]
    assert entry.check_flags([*DS, "--save", "ckpt", "--save-interval", "2"]) == ("ckpt", 0.0)
    with pytest.raises(ValueError, match="need --save DIR"):
        entry.check_flags(DS)
    with pytest.raises(ValueError, match="--hetu-microbatches 3,1 fixes the counts of 2 ranks"):
        entry.check_flags([*DS[2:], "--zero-stage", "1", "--hetu-microbatches", "3,1", "--save", "ckpt"])

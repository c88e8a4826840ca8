"""launch/elastic.py's decisions (pure; the restart itself is covered by test_ckpt_recovery.py): the restart
flags replace any plan and TP/PP flags with the new plan and load the --save directory; the plan for the GPUs
left is a valid Malleus plan of the same model and global batch; a run without --save is refused."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from helpers import gpt_argv

from hetu_ext.plan import plan_from_dict

spec = importlib.util.spec_from_file_location("elastic", Path(__file__).resolve().parents[1] / "launch" / "elastic.py")
elastic = importlib.util.module_from_spec(spec)
spec.loader.exec_module(elastic)


def test_restart_flags_and_plan():
    import yaml

    argv = gpt_argv(2, 2, "data/x", ("--save", "ckpt", "--save-interval", "2", "--hetu-plan", "old.yaml"))
    again = elastic.restart_argv(argv, plan_path="ckpt/elastic_plan_5.yaml")
    assert again[-4:] == ["--hetu-plan", "ckpt/elastic_plan_5.yaml", "--load", "ckpt"]
    assert "old.yaml" not in again and "--tensor-model-parallel-size" not in again
    plan = plan_from_dict(yaml.safe_load(elastic.plan_for(argv, 5, gpus_per_node=3)))
    assert plan.world_size == 5 and plan.num_microbatches == 4  # global batch 8 of microbatches of 2
    plan.validate(world_size=5)
    with pytest.raises(ValueError, match="need --save DIR"):
        elastic.restart_argv(gpt_argv(1, 1, "data/x"), plan_path="p.yaml")

"""The Plan: construction, validation of bad plans (rule, values, fix in one message), YAML, the show command."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hetu_ext.plan import (
    ModelSpec,
    Pipeline,
    Plan,
    PlanError,
    Stage,
    dump_plan,
    format_plan,
    load_plan,
    plan_from_dict,
    uniform_plan,
    uniform_shape,
)
from hetu_ext.plan.__main__ import main as plan_main

MODEL = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=257)


def stage(ranks, start, stop, first, last):
    return Stage(ranks=tuple(ranks), layer_start=start, layer_stop=stop, has_embedding=first, has_output=last)


HETERO = Plan(pipelines=(
    Pipeline(stages=(stage([0, 1], 0, 3, True, False), stage([2], 3, 4, False, True)), num_microbatches=3),
    Pipeline(stages=(stage([3], 0, 4, True, True),), num_microbatches=1),
), unused_ranks=(4,))


def test_uniform_plan_uses_megatron_rank_order():
    plan = uniform_plan(world_size=8, tp=2, pp=2, num_layers=4, num_microbatches=2)
    # Megatron's default order tp-cp-ep-dp-pp: rank = t + tp * (d + dp * p)
    assert [s.ranks for s in plan.pipelines[0].stages] == [(0, 1), (4, 5)]
    assert [s.ranks for s in plan.pipelines[1].stages] == [(2, 3), (6, 7)]
    assert [s.layers for s in plan.pipelines[0].stages] == [range(0, 2), range(2, 4)]
    assert plan.num_microbatches == 4
    assert uniform_shape(plan.validate(MODEL, 8)) == (2, 2, 2)


def test_heterogeneous_plan_is_valid_but_not_uniform():
    HETERO.validate(MODEL, world_size=5)
    assert uniform_shape(HETERO) is None
    assert HETERO.stage_of(2) == (0, 1) and HETERO.stage_of(4) is None
    assert HETERO.layers_of(3) == range(0, 4) and HETERO.layers_of(4) == range(0)


@pytest.mark.parametrize("plan,world,needles", [
    (Plan(pipelines=(Pipeline(stages=(stage([0], 0, 3, True, True),), num_microbatches=1),)), 1,
     ["hold 3 layers", "num_layers=4", "stop at layer 4"]),
    (Plan(pipelines=(Pipeline(stages=(stage([0], 0, 2, True, False), stage([0], 2, 4, False, True)),
                              num_microbatches=1),)), 1,
     ["rank 0 is already in pipeline 0 stage 0", "remove it"]),
    (Plan(pipelines=(Pipeline(stages=(stage([0, 1, 2], 0, 4, True, True),), num_microbatches=1),)), 3,
     ["TP degree 3 must divide num_attention_heads (4)", "use a TP degree among"]),
    (Plan(pipelines=(Pipeline(stages=(stage([0], 0, 4, True, True),), num_microbatches=0),)), 1,
     ["num_microbatches must be an integer >= 1, got 0"]),
    (Plan(pipelines=(Pipeline(stages=(stage([0], 0, 2, True, False), stage([1], 3, 4, False, True)),
                              num_microbatches=1),)), 2,
     ["contiguous", "start at layer 2", "[3, 4)"]),
    (Plan(pipelines=(Pipeline(stages=(stage([0], 0, 4, True, True),), num_microbatches=1),
                     Pipeline(stages=(stage([1], 0, 2, True, True),), num_microbatches=1))), 2,
     ["pipeline 1", "every pipeline must hold every layer once"]),
    (Plan(pipelines=(Pipeline(stages=(stage([0], 0, 2, True, True), stage([1], 2, 4, False, True)),
                              num_microbatches=1),)), 2,
     ["has_output=True", "last stage"]),
    (Plan(pipelines=(Pipeline(stages=(stage([0], 0, 4, True, True),), num_microbatches=1),)), 2,
     ["not placed: [1]", "unused_ranks"]),
    (Plan(pipelines=(Pipeline(stages=(stage([0], 0, 4, True, True),), num_microbatches=1),), unused_ranks=(0,)), 1,
     ["rank 0 is already in unused_ranks"]),
])
def test_bad_plans_are_refused_with_rule_values_and_fix(plan, world, needles):
    with pytest.raises(PlanError) as err:
        plan.validate(MODEL, world)
    message = str(err.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


def test_tp_must_divide_ffn_and_padded_vocab():
    model = ModelSpec(num_layers=1, hidden_size=48, num_attention_heads=6, ffn_hidden_size=100, vocab_size=257)
    plan = Plan(pipelines=(Pipeline(stages=(stage(range(6), 0, 1, True, True),), num_microbatches=1),))
    with pytest.raises(PlanError, match=r"TP degree 6 must divide ffn_hidden_size \(100\)"):
        plan.validate(model)
    model = ModelSpec(num_layers=1, hidden_size=40, num_attention_heads=5, ffn_hidden_size=100, vocab_size=257)
    plan = Plan(pipelines=(Pipeline(stages=(stage(range(5), 0, 1, True, True),), num_microbatches=1),))
    with pytest.raises(PlanError, match=r"TP degree 5 must divide padded vocab size \(384\)"):
        plan.validate(model)


def test_uniform_plan_refuses_indivisible_sizes():
    with pytest.raises(PlanError, match="world size 6 is not divisible by tensor x pipeline parallel size 2x2"):
        uniform_plan(world_size=6, tp=2, pp=2, num_layers=4)
    with pytest.raises(PlanError, match="--num-layers 5 is not divisible by --pipeline-model-parallel-size 2"):
        uniform_plan(world_size=2, pp=2, num_layers=5)


def test_model_spec_checks():
    assert ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4).ffn_hidden_size == 256
    assert ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=50257).padded_vocab_size == 50304
    with pytest.raises(ValueError, match="num_attention_heads must divide hidden_size"):
        ModelSpec(num_layers=2, hidden_size=66, num_attention_heads=4)
    with pytest.raises(ValueError, match="num_layers must be a positive integer, got 0"):
        ModelSpec(num_layers=0, hidden_size=64, num_attention_heads=4)


def test_yaml_round_trip_and_defaults(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(dump_plan(HETERO))
    assert load_plan(path) == HETERO
    # has_embedding / has_output default to the first / last stage
    minimal = {"pipelines": [{"num_microbatches": 2, "stages": [{"ranks": [0], "layers": [0, 2]},
                                                                 {"ranks": [1], "layers": [2, 4]}]}]}
    plan = plan_from_dict(minimal)
    assert [(s.has_embedding, s.has_output) for s in plan.pipelines[0].stages] == [(True, False), (False, True)]


@pytest.mark.parametrize("text,needle", [
    ("pipelines: [{stages: [{ranks: [0], layers: [0, 4], tp: 2}]}]", "unknown key 'tp' in pipeline 0 stage 0"),
    ("pipelines: [{stages: [{ranks: [0]}]}]", "missing required key 'layers'"),
    ("pipelines: [{stages: [{ranks: [0], layers: [0]}]}]", "layers must be [start, stop)"),
    ("pipelines: [{stages: [{ranks: [a], layers: [0, 4]}]}]", "expected a list of integers"),
    ("pipelines: [\n  - stages: [", "is not valid YAML"),
    ("pipes: []", "unknown key 'pipes' in plan; did you mean 'pipelines'?"),
])
def test_malformed_plan_files(tmp_path, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(PlanError) as err:
        load_plan(path)
    assert needle in str(err.value) and str(path) in str(err.value)


def test_format_plan_lists_stages_and_rank_layers():
    text = format_plan(HETERO)
    assert "0         1      2      1   3-3                yes" in text
    assert "3     1         0      0        0-3 +embedding +output" in text
    assert "4     -         -      -        unused" in text


def test_show_command(tmp_path, capsys):
    path = tmp_path / "plan.yaml"
    path.write_text(dump_plan(HETERO))
    assert plan_main(["show", str(path), "--num-layers", "4", "--num-attention-heads", "4",
                      "--hidden-size", "64", "--world-size", "5"]) == 0
    assert "2 pipeline(s), 4 microbatches per global batch" in capsys.readouterr().out
    assert plan_main(["show", str(path), "--world-size", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "out of range: [4]" in err


def test_show_command_as_module_exits_2_without_traceback(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("pipelines: [{stages: [{ranks: [0, 0], layers: [0, 4]}]}]")
    proc = subprocess.run([sys.executable, "-m", "hetu_ext.plan", "show", str(path)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "rank 0 is already in" in proc.stderr


def test_show_checks_a_tp2_plan_against_layers_and_the_training_vocabulary(tmp_path, capsys):
    """``show FILE --num-layers N`` refused every plan with TP > 1: the heads defaulted to 1, which TP 2 does not
    divide. Now only the given sizes are checked, and the vocabulary is padded as training pads it (tokenizer,
    --vocab-size, --make-vocab-size-divisible-by)."""
    path = tmp_path / "plan.yaml"
    path.write_text(dump_plan(HETERO))  # pipeline 0 stage 0 is TP 2
    assert plan_main(["show", str(path), "--num-layers", "4"]) == 0
    out = capsys.readouterr().out
    assert "checked against the model: 4 layers, padded vocabulary 384" in out  # ByteLevel 257 -> 384
    assert plan_main(["show", str(path), "--num-layers", "3"]) == 2
    assert "the model has num_layers=3" in capsys.readouterr().err
    # training's padding: 257 tokens padded to a multiple of 1 is 257, which TP 2 does not divide
    assert plan_main(["show", str(path), "--num-layers", "4", "--make-vocab-size-divisible-by", "1"]) == 2
    assert "TP degree 2 must divide padded vocab size (257)" in capsys.readouterr().err
    assert plan_main(["show", str(path), "--num-layers", "4", "--make-vocab-size-divisible-by", "1",
                      "--tokenizer-type", "NullTokenizer", "--vocab-size", "127"]) == 0  # 127 ids + EOD = 128
    assert "padded vocabulary 128" in capsys.readouterr().out
    assert plan_main(["show", str(path), "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads",
                      "6"]) == 2  # 6 heads do not divide 64
    assert capsys.readouterr().err.count("\n") == 1
    assert plan_main(["show", str(path), "--num-layers", "4", "--hidden-size", "64"]) == 2
    assert "give --hidden-size and --num-attention-heads together" in capsys.readouterr().err


def test_malleus_writes_the_plan_before_printing(tmp_path):
    """``plan malleus ... -o FILE | head`` lost the file: the table was printed first, the reader had gone, and
    the BrokenPipeError ended the command before the write. Here the reader is gone before the command writes
    anything: the file must exist and be the whole plan, and no traceback."""
    path = tmp_path / "malleus.yaml"
    argv = ["malleus", "--world-size", "4", "--gpus-per-node", "4", "--slowdown", "1=3", "--num-layers", "4",
            "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
            "--global-batch-size", "8", "--vocab-size", "257", "-o", str(path)]
    read, write = os.pipe()
    os.close(read)  # the pipe's reader stopped (as head does after 10 lines)
    proc = subprocess.run([sys.executable, "-m", "hetu_ext.plan", *argv], stdout=write, stderr=subprocess.PIPE,
                          text=True, timeout=60)
    os.close(write)
    assert path.exists(), proc.stderr
    plan = load_plan(path)
    plan.validate(ModelSpec(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=257), 4)
    assert "Traceback" not in proc.stderr and proc.returncode == 0, proc.stderr


def test_planner_model_flags_are_the_schemas():
    """The planners' model, layout and batch flags are training's (generated from hetu_ext.config.schema): the same
    destination, type and choices as the training command line's, and its help where the planner has none of its
    own (a planner's own default or requirement aside)."""
    import argparse

    from hetu_ext.config import build_parser
    from hetu_ext.plan.cli import build_parser as plan_parser, calibration_parser

    training = {a.option_strings[0]: a for a in build_parser()._actions if a.option_strings}
    sub = next(a for a in plan_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parsers = dict(sub.choices, calibration=calibration_parser())
    shared = ("--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size", "--seq-length",
              "--swiglu", "--normalization", "--kv-channels", "--sequence-parallel", "--micro-batch-size",
              "--make-vocab-size-divisible-by", "--tensor-model-parallel-size", "--recompute-granularity")
    own_help = {("show", "--num-layers"), ("show", "--hidden-size"), ("hydraulis", "--seq-length"),
                ("hydraulis", "--sequence-parallel")}
    checked = set()
    for name, parser in parsers.items():
        for action in parser._actions:
            flag = (action.option_strings or [None])[0]
            if flag not in shared or (name, flag) == ("hydraulis", "--recompute-granularity"):  # none/auto: its own
                continue
            theirs = training[flag]
            assert (action.dest, action.type, action.choices, action.nargs) == \
                (theirs.dest, theirs.type, theirs.choices, theirs.nargs), (name, flag)
            if (name, flag) not in own_help:
                assert action.help == theirs.help, (name, flag, action.help, theirs.help)
            checked.add((name, flag))
    assert {("show", "--num-layers"), ("malleus", "--micro-batch-size"), ("lobra", "--hidden-size"),
            ("hydraulis", "--num-attention-heads"), ("predict", "--swiglu"),
            ("predict", "--tensor-model-parallel-size"), ("calibration", "--ffn-hidden-size")} <= checked, sorted(checked)

"""DeepSpeed ZeRO checkpoints load into any plan with no offline step (no ds_to_universal).

DeepSpeed's own engine (ZeRO-1/2/3, CPU accelerator, gloo) trains Megatron-core's GPTModel with hetu_ext's
layout-agnostic initial weights on the shipped sample for 2 steps at world size 2 and calls
``engine.save_checkpoint``. Before saving, each rank records DeepSpeed's own view of the full state through its
public API (``safe_get_full_fp32_param``, ``safe_get_full_optimizer_state``): that view, not our parser, is the
truth the loads are compared with.

* State (bit-exact): rebuilding full tensors from DeepSpeed's flat partitions and resharding them only moves
  bytes, so gathered weights, Adam moments and step must equal DeepSpeed's bit for bit.
* Continuation (tolerance): the DeepSpeed path uses torch's AdamW (the class Megatron-core runs without
  Apex/TE, as a DeepSpeed client optimizer) with Megatron's parameter groups and LR schedule, so no Adam
  implementation differs; what differs is the order of floating-point sums (DeepSpeed averages gradients over
  its 2 ranks and scales the loss per microbatch; its clip divides by (norm + 1e-6) / clip where Megatron
  multiplies by clip / (norm + 1e-6)). So the losses of steps 1-4 (2 under DeepSpeed, 2 under the loaded plan)
  and the final weights must match the uninterrupted single-process Megatron run within
  test_uniform_equivalence's tolerances (1e-6 relative, 2e-6 absolute). A dropped moment or step, a restarted
  LR schedule or a shifted data position moves step-3 losses by > 1e-3 (test_checkpointing.py).
"""

from __future__ import annotations

import pytest
import torch
from test_ckpt_resume import (
    BF16_LOSS_RTOL,
    SCHEDULE,
    _assert_restored,
    _continuation_diffs,
    _plan_argv,
    _run,
)
from helpers import LOSS_RTOL, WEIGHT_ATOL, gpt_argv

from hetu_ext.testing.multiproc import run_ranks


def deepspeed_save_body(rank: int, world: int, argv: list[str], stage: int, directory: str) -> dict | None:
    """Train with DeepSpeed, record DeepSpeed's own full view of the state, save; rank 0 returns it."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from hetu_ext.config import from_namespace
    from hetu_ext.deepspeed.engine import ZeroConfig, add_deepspeed_args, build
    from hetu_ext.deepspeed.zero_checkpoint import hetu_name
    from hetu_ext.cli.args import build_parser, validate_args

    args = add_deepspeed_args(build_parser()).parse_args(argv)
    validate_args(args)
    run = build(from_namespace(args), ZeroConfig(stage=stage))
    losses = run.train()
    optimizer = run.engine.optimizer
    if stage <= 2:
        # DeepSpeed 0.19.8 links each parameter to its Adam state fragments after the first optimizer.step() of
        # parameter group 0, before torch's AdamW has created group 1's state: group 1's links stay empty and
        # safe_get_full_optimizer_state raises "exp_avg not found". Link again now that every state exists.
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()
    state = {}
    for name, p in run.engine.module.named_parameters():
        state[hetu_name("master", name)] = safe_get_full_fp32_param(p).detach().clone()
        for kind in ("exp_avg", "exp_avg_sq"):
            state[hetu_name(kind, name)] = safe_get_full_optimizer_state(p, kind).detach().clone()
        if stage <= 2:  # ZeRO-3 keeps placeholders only
            state[hetu_name("param", name)] = p.detach().clone()
    steps = {float(s["step"]) for s in optimizer.optimizer.state.values() if "step" in s}
    scheduler = run.scheduler.state_dict()
    run.save(directory)
    return {"state": state, "losses": losses, "steps": steps, "scheduler": scheduler} if rank == 0 else None


def _deepspeed(stage: int, sample_prefix: str, directory, extra: tuple[str, ...] = ()) -> dict:
    argv = gpt_argv(1, 1, sample_prefix, SCHEDULE + ("--train-iters", "2") + extra)
    return run_ranks(deepspeed_save_body, 2, argv, stage, str(directory), timeout=180)[0]


@pytest.fixture(scope="module")
def zero2(sample_prefix, tmp_path_factory):
    directory = tmp_path_factory.mktemp("zero2") / "ckpt"
    saved = _deepspeed(2, sample_prefix, directory)
    reference = _run(1, gpt_argv(1, 1, sample_prefix, SCHEDULE + ("--train-iters", "4")))["final"]
    saved["megatron_step2"] = _run(1, gpt_argv(1, 1, sample_prefix, SCHEDULE + ("--train-iters", "2")))["final"]
    return directory, saved, reference


def test_deepspeed_path_trains_like_megatron(zero2):
    """The DeepSpeed run is the same training as hetu_ext's (else the continuation checks below mean nothing):
    its 2 losses, weights and Adam moments match the single-process Megatron run within
    test_uniform_equivalence's tolerances; Adam's moments within 1e-5 of each tensor's largest value (gradients
    summed in another order differ by a few ulps of their largest element, which moments of small elements
    carry; measured 2.0e-6, on exp_avg); and its fp32 masters equal its module weights. Weight decay on biases and norms (Megatron's groups
    exempt them) moves the weights by 1.8e-5 here and fails; the 2 losses alone would not catch it (1.8e-7)."""
    directory, saved, reference = zero2
    assert (directory / "latest").read_text().strip() == "global_step2"
    loss = max(abs(a - b) / abs(b) for a, b in zip(saved["losses"], reference["losses"][:2]))
    megatron = saved["megatron_step2"]["tensors"]
    assert megatron.keys() == {k for k in saved["state"] if not k[0].startswith("master/")}
    weight = max(float((megatron[k] - v).abs().max()) for k, v in saved["state"].items() if k[0].startswith("param/"))
    moments = {k: float((megatron[k] - v).abs().max() / v.abs().max()) for k, v in saved["state"].items()
               if k[0].startswith("exp_avg")}
    moment = max(moments.values())
    print(f"DeepSpeed ZeRO-2 vs Megatron, steps 1-2: loss rel diff {loss:.2e}, weight abs diff {weight:.2e}, "
          f"moment rel diff {moment:.2e} ({max(moments, key=moments.get)[0]})")
    assert len(saved["losses"]) == 2 and loss <= LOSS_RTOL and weight <= WEIGHT_ATOL and moment <= 1e-5
    params = {k: v for k, v in saved["state"].items() if k[0].startswith("param/")}
    assert params and all(torch.equal(v, saved["state"][("master/" + k[0][6:], k[1])]) for k, v in params.items())


@pytest.mark.parametrize("plan", ["one", "h3"])
def test_zero2_world2_into_another_plan(plan, zero2, sample_prefix, tmp_path):
    """ZeRO-2 at world size 2 into 1 rank and into a heterogeneous plan of 3 ranks (TP2 pipeline + TP1 one)."""
    directory, saved, reference = zero2
    world, argv = _plan_argv(plan, sample_prefix, tmp_path, ("--train-iters", "4", "--load", str(directory)))
    result = _run(world, argv)
    loaded = result["loaded"]
    want = {k: v for k, v in saved["state"].items() if not k[0].startswith("master/")}  # fp32 model: no masters
    assert any(k[0].startswith("exp_avg_sq/") for k in want)
    _assert_restored(loaded, want, saved)
    final = result["final"]
    assert final["iteration"] == 4 and final["losses"][:2] == saved["losses"]
    loss, weight = _continuation_diffs(final, reference)
    print(f"DeepSpeed ZeRO-2 (2 ranks) -> {plan}: loss rel diff {loss:.2e}, weight abs diff {weight:.2e}")
    assert len(final["losses"]) == 4 and loss <= LOSS_RTOL and weight <= WEIGHT_ATOL


@pytest.mark.parametrize("stage,plan", [(1, "one"), (3, "h3")])
def test_zero1_and_zero3_state_reads_bit_exact(stage, plan, sample_prefix, tmp_path):
    """ZeRO-1 (optimizer state partitioned) and ZeRO-3 (parameters too, one partition per parameter): every
    tensor rebuilt from the files equals DeepSpeed's in-engine full view bit for bit, and Adam's step is 2; then
    ``--load`` into a plan (1 rank; the heterogeneous 3-rank plan) gathers the same bytes again."""
    from hetu_ext.deepspeed.zero_checkpoint import read_full, read_info

    saved = _deepspeed(stage, sample_prefix, tmp_path / "ckpt")
    info = read_info(str(tmp_path / "ckpt"))
    assert (info.zero_stage, info.world_size, info.global_steps, info.optimizer_step) == (stage, 2, 2, 2.0)
    full = read_full(str(tmp_path / "ckpt"))
    for key, value in saved["state"].items():
        assert torch.equal(full[key], value), key
    if stage == 3:  # ZeRO-3 keeps no module weights: param is the fp32 master (fp32 model: the same bytes)
        masters = {k for k in full if k[0].startswith("master/")}
        assert all(torch.equal(full[("param/" + k[0][7:], k[1])], full[k]) for k in masters)
    assert saved["steps"] == {2.0}
    world, argv = _plan_argv(plan, sample_prefix, tmp_path, ("--train-iters", "2", "--load", str(tmp_path / "ckpt")))
    loaded = _run(world, argv)["loaded"]
    assert loaded["tensors"].keys() == {k for k in full if not k[0].startswith("master/")}
    assert all(torch.equal(v, full[k]) for k, v in loaded["tensors"].items())
    assert loaded["steps"] == {2.0} and loaded["iteration"] == 2 and loaded["losses"] == saved["losses"]


def test_bad_directory_is_one_clear_error(zero2, tmp_path):
    """A 'latest' naming no tag, and a tag missing one rank's optimizer file, each end in one error naming
    the path and what is missing (never a silent start from scratch or a partial load)."""
    import shutil

    from hetu_ext.checkpoint import CheckpointError
    from hetu_ext.deepspeed.zero_checkpoint import is_deepspeed, read_full, read_info

    partial = tmp_path / "partial"
    shutil.copytree(zero2[0], partial)
    (partial / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match="1 \\*_optim_states.pt files for a ZeRO world size of 2"):
        read_full(str(partial), ("exp_avg",))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert not is_deepspeed(str(empty))
    (empty / "latest").write_text("global_step9")
    assert is_deepspeed(str(empty))  # --load takes the DeepSpeed route and fails there, not "from scratch"
    with pytest.raises(CheckpointError, match="global_step9.*holds no \\*_optim_states.pt"):
        read_info(str(empty))


def test_cli_inspects_and_converts_a_deepspeed_checkpoint(zero2, sample_prefix, tmp_path, capsys):
    """``python -m hetu_ext.checkpoint`` reads a DeepSpeed directory directly: ``inspect`` names stage, world
    size and steps; ``convert --kind exp_avg`` writes DeepSpeed's moments bit for bit; ``convert --to torch_dist``
    writes a Megatron dist_checkpointing checkpoint that loads into a heterogeneous plan with the same bytes."""
    from safetensors.torch import load_file

    from hetu_ext.checkpoint.__main__ import main

    directory, saved, _ = zero2
    assert main(["inspect", str(directory)]) == 0
    out = capsys.readouterr().out
    assert "ZeRO-2" in out and "saved by 2 rank(s), global step 2, Adam step 2.0" in out
    assert main(["convert", str(directory), str(tmp_path / "m.safetensors"), "--kind", "exp_avg"]) == 0
    exported = load_file(str(tmp_path / "m.safetensors"))
    moments = {k: v for k, v in saved["state"].items() if k[0].startswith("exp_avg/")}
    assert len(exported) == len(moments)
    for (name, index), value in moments.items():
        key = name[len("exp_avg/"):]
        key = f"decoder.layers.{index[0]}.{key[len('decoder.layers.'):]}" if index else key
        assert torch.equal(exported[key], value), key
    assert main(["verify", str(directory)]) == 2
    assert "carries no checksums" in capsys.readouterr().err
    assert main(["convert", str(directory), str(tmp_path / "td"), "--to", "torch_dist"]) == 0
    world, argv = _plan_argv("h3", sample_prefix, tmp_path, ("--train-iters", "2", "--load", str(tmp_path / "td")))
    loaded = _run(world, argv)["loaded"]
    want = {k: v for k, v in saved["state"].items() if not k[0].startswith("master/")}
    assert loaded["tensors"].keys() == want.keys()
    assert all(torch.equal(loaded["tensors"][k], v) for k, v in want.items()) and loaded["steps"] == {2.0}


def test_plain_deepspeed_checkpoint_and_wrong_model(zero2, sample_prefix, tmp_path):
    """A checkpoint of a user's own DeepSpeed script carries no hetu_ext client state: the iteration comes from
    DeepSpeed's global_steps and the LR schedule is replayed to it, so training continues as the uninterrupted
    run does (same tolerances). A model of another shape is refused with one error naming tensor and shapes."""
    import shutil

    from hetu_ext.testing.multiproc import RankError

    directory, saved, reference = zero2
    plain = tmp_path / "plain"
    shutil.copytree(directory, plain)
    states = plain / "global_step2" / "mp_rank_00_model_states.pt"
    content = torch.load(states, weights_only=False)
    del content["hetu_ext"]
    torch.save(content, states)
    world, argv = _plan_argv("one", sample_prefix, tmp_path, ("--train-iters", "4", "--load", str(plain)))
    result = _run(world, argv)
    assert result["loaded"]["iteration"] == 2 and result["loaded"]["losses"] == []
    assert result["loaded"]["scheduler"] == saved["scheduler"]
    final = result["final"]
    loss = max(abs(a - b) / abs(b) for a, b in zip(final["losses"], reference["losses"][2:]))
    assert len(final["losses"]) == 2 and loss <= LOSS_RTOL
    argv = gpt_argv(1, 1, sample_prefix, SCHEDULE + ("--train-iters", "4", "--load", str(plain)))
    argv[argv.index("--ffn-hidden-size") + 1] = "96"
    with pytest.raises(RankError, match=r"linear_fc1.weight\[0\]: the model holds box .* but the DeepSpeed "
                                        r"checkpoint stores \[64, 32\]; the model configuration differs"):
        _run(1, argv)


def test_deepspeed_config_from_flags_and_its_errors():
    """Pure: the DeepSpeed config the Megatron-LM flags give, and one error naming rule, values and fix for a
    batch that does not split over the ranks, a user config contradicting the flags, or an unknown stage."""
    from hetu_ext.config import from_namespace
    from hetu_ext.deepspeed.engine import (
        ZeroConfig,
        add_deepspeed_args,
        deepspeed_config,
    )
    from hetu_ext.cli.args import build_parser

    args = from_namespace(add_deepspeed_args(build_parser()).parse_args(gpt_argv(1, 1, "unused")))
    config = deepspeed_config(args, ZeroConfig(stage=3, extra={"zero_optimization": {"sub_group_size": 10**6},
                                                               "steps_per_print": 10}), 2)
    assert (config["train_batch_size"], config["gradient_accumulation_steps"], config["gradient_clipping"]) == \
        (8, 2, 1.0)
    assert config["zero_optimization"] == {"stage": 3, "sub_group_size": 10**6} and config["steps_per_print"] == 10
    with pytest.raises(ValueError, match="--global-batch-size 8 must be a multiple of --micro-batch-size 2 x "
                                         "world size 3"):
        deepspeed_config(args, ZeroConfig(stage=2), 3)
    with pytest.raises(ValueError, match="--deepspeed-config sets train_batch_size=16 but the flags give 8"):
        deepspeed_config(args, ZeroConfig(stage=2, extra={"train_batch_size": 16}), 2)
    with pytest.raises(ValueError, match="sets zero_optimization=.*'stage': 1.*make them agree"):
        deepspeed_config(args, ZeroConfig(stage=2, extra={"zero_optimization": {"stage": 1}}), 2)
    with pytest.raises(ValueError, match="sets bf16=.* use --bf16"):
        deepspeed_config(args, ZeroConfig(stage=2, extra={"bf16": {"enabled": True}}), 2)
    with pytest.raises(ValueError, match="ZeRO stage 4 is not one of"):
        ZeroConfig(stage=4)


def test_zero2_bf16_into_a_pipeline(sample_prefix, tmp_path):
    """--bf16 (Megatron's Float16Module; DeepSpeed keeps fp32 partitions): ZeRO-2 at world size 2 into a bf16 PP2
    plan. bf16 weights, fp32 masters and moments equal DeepSpeed's bit for bit; steps 3-4 match the
    uninterrupted single-process bf16 Megatron run within test_ckpt_resume's BF16_LOSS_RTOL (bf16 roundings of
    differently ordered sums; measured 3.5e-6 here). A master weight not restored (resuming from the bf16
    copy) fails the bit-exact check of ``master/``."""
    saved = _deepspeed(2, sample_prefix, tmp_path / "ckpt", ("--bf16",))
    reference = _run(1, gpt_argv(1, 1, sample_prefix, SCHEDULE + ("--train-iters", "4", "--bf16")))["final"]
    world, argv = _plan_argv("pp2b", sample_prefix, tmp_path, ("--train-iters", "4", "--load", str(tmp_path / "ckpt")))
    result = _run(world, argv)
    loaded = result["loaded"]
    assert loaded["tensors"].keys() == saved["state"].keys()
    assert {v.dtype for k, v in loaded["tensors"].items() if k[0].startswith("param/")} == {torch.bfloat16}
    assert {v.dtype for k, v in loaded["tensors"].items() if k[0].startswith("master/")} == {torch.float32}
    for key, value in saved["state"].items():
        assert torch.equal(loaded["tensors"][key], value), key
    assert loaded["steps"] == {2.0} and loaded["iteration"] == 2 and loaded["losses"] == saved["losses"]
    loss = max(abs(a - b) / abs(b) for a, b in zip(result["final"]["losses"], reference["losses"]))
    print(f"DeepSpeed ZeRO-2 bf16 (2 ranks) -> pp2b: loss rel diff {loss:.2e}")
    assert len(result["final"]["losses"]) == 4 and loss <= BF16_LOSS_RTOL

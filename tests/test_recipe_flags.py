"""Megatron-LM's own recipes on hetu_ext's trainer (issue 45, point 1): every flag of the example scripts is
implemented, accepted with a notice, or refused by name; the implemented ones do what Megatron-LM does.

The example scripts are not in the fixture (it has no examples/), so their flags are copied here (tag core_v0.16.1:
examples/llama/train_llama3_8b_h100_fp8.sh with sizes shrunk and CPU flags added, as /tmp/rec/llama.sh of the
issue; examples/gpt3/train_gpt3_175b_distributed.sh; examples/mixtral/train_mixtral_8x7b_distributed.sh).
"""

from __future__ import annotations

import os
import time

import pytest

from hetu_ext.cli.args import take_megatron_lm_flags
from hetu_ext.config import build_parser
from hetu_ext.config.megatron_flags import (
    KINDS,
    MEGATRON_FLAGS,
    accepted_notice,
    classification_rows,
    take_megatron_flags,
)
from helpers import megatron_lm

LLAMA = ("--use-mcore-models --num-layers 4 --hidden-size 64 --ffn-hidden-size 96 --num-attention-heads 4 "
         "--group-query-attention --num-query-groups 2 --kv-channels 16 --seq-length 128 --max-position-embeddings 128 "
         "--position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0 "
         "--hidden-dropout 0.0 --swiglu --init-method-std 0.0134 --attention-backend fused --apply-layernorm-1p "
         "--untie-embeddings-and-output-weights --disable-bias-linear "
         "--micro-batch-size 1 --global-batch-size 8 --train-samples 96 --lr-decay-samples 90 --lr-warmup-samples 8 "
         "--lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine "
         "--clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16 "
         "--cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc --empty-unused-memory-level 1 "
         "--exit-duration-in-mins 235 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
         "--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather "
         "--tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel "
         "--mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --data-cache-path CACHE --tiktoken-pattern v2 "
         "--split 99,1,0 --no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1 "
         "--log-interval 1 --eval-iters 2 --eval-interval 4 --save-interval 1000 --log-throughput "
         "--ckpt-format torch_dist --distributed-timeout-minutes 60 --save CK --load CK --tensorboard-dir TB "
         "--transformer-impl local --no-gradient-accumulation-fusion --no-persist-layer-norm "
         "--distributed-backend gloo --no-rope-fusion").split()
GPT3 = ("--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 --max-position-embeddings 2048 "
        "--attention-backend auto --micro-batch-size 1 --global-batch-size 1536 --rampup-batch-size 16 16 5859375 "
        "--train-iters 500000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 "
        "--clip-grad 1.0 --fp16 --lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001 "
        "--lr-decay-iters 430000 --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 "
        "--data-path DATA --vocab-file VOCAB --merge-file MERGES --split 949,50,1 --log-interval 100 "
        "--save-interval 10000 --eval-interval 1000 --save CK --load CK --eval-iters 10 --tensorboard-dir TB").split()
MIXTRAL = ("--use-mcore-models --disable-bias-linear --seq-length 4096 --max-position-embeddings 32768 "
           "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --init-method-std 0.01 "
           "--attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope "
           "--swiglu --untie-embeddings-and-output-weights --group-query-attention --num-query-groups 8 "
           "--no-masked-softmax-fusion --no-position-embedding --rotary-base 1000000 "
           "--num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 "
           "--moe-grouped-gemm --moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce "
           "--tokenizer-type Llama2Tokenizer --tokenizer-model TOKENIZER --data-path DATA --split 99990,8,2 "
           "--micro-batch-size 1 --global-batch-size 256 --lr 1e-4 --train-iters 500000 --lr-decay-iters 320000 "
           "--lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1 --lr-warmup-iters 500 --clip-grad 1.0 --bf16 "
           "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --expert-model-parallel-size 8 "
           "--use-distributed-optimizer --sequence-parallel --log-interval 1 --save-interval 10000 "
           "--eval-interval 1000 --eval-iters 10 --save CK --load CK --tensorboard-dir TB --no-load-optim "
           "--no-load-rng").split()
EXAMPLES = {"llama": LLAMA, "gpt3": GPT3, "mixtral": MIXTRAL}


def _known() -> set[str]:
    return {s for a in build_parser()._actions for s in a.option_strings}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_example_flag_is_classified(name):
    """Each flag of the example is the schema's (implemented) or has a rule in MEGATRON_FLAGS: none would reach the
    parser as an unknown flag (whose refusal says nothing of why)."""
    known = _known()
    flags = [t for t in EXAMPLES[name] if t.startswith("--")]
    taken = take_megatron_flags(EXAMPLES[name], known)
    left = [t for t in taken.argv if t.startswith("--") and t not in known]
    assert not left, f"{name}: unclassified {left}"
    assert len(flags) == len(set(flags)), "an example flag copied twice"


def test_llama_recipe_nothing_refused_and_one_notice():
    """The Llama 3 recipe's flags: nothing refused; the kernel/perf flags are listed in one notice, each with what
    runs instead; the flags the trainer always implies are taken silently."""
    taken = take_megatron_flags(LLAMA, _known())
    assert not taken.refused, taken.refused
    argv, notice = taken.argv, accepted_notice(taken.accepted)
    for flag in ("--attention-backend fused", "--cross-entropy-loss-fusion", "--manual-gc",
                 "--empty-unused-memory-level 1", "--overlap-grad-reduce", "--overlap-param-gather",
                 "--tiktoken-pattern v2", "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files",
                 "--num-workers 1", "--log-throughput", "--fp8-format hybrid", "--fp8-param-gather",
                 "--ckpt-format torch_dist"):
        assert flag in notice, (flag, notice)
    assert notice.count("trained without FP8") == 1, notice  # flags with the same instead are listed together
    for silent in ("--calculate-per-token-loss", "--use-mcore-models", "--no-rope-fusion"):
        assert silent not in notice and silent not in argv, silent
    # a setting of the schema (local or transformer_engine, issue 47): passed on to the parser, in no notice
    assert "--transformer-impl" not in notice and argv[argv.index("--transformer-impl") + 1] == "local"
    # --context-parallel-size is a setting of the schema too (issue 48: CP on the plan runtime)
    assert "--context-parallel-size" not in notice and argv[argv.index("--context-parallel-size") + 1] == "1"


@pytest.mark.parametrize("flags, needle", [
    (["--num-experts", "8"], "MoE"),
    (["--moe-router-topk", "2"], "--moe-router-topk 2"),
    (["--no-position-embedding"], "--position-embedding-type rope"),
    (["--no-load-optim"], "--no-load-optim"),
])
def test_refused_flags_name_themselves(flags, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")) as err:
        take_megatron_lm_flags(["--num-layers", "2", *flags], build_parser())
    assert "\n" not in str(err.value)


def test_table_is_consistent_with_the_schema():
    """A table entry for a flag the schema has is dead (the schema's parser wins); every kind is one of three."""
    known = _known()
    assert not [f for f in MEGATRON_FLAGS if f in known]
    assert {kind for _, kind, _ in classification_rows()} <= set(KINDS)


def test_no_position_embedding_with_rope_is_implied():
    argv, notice = take_megatron_lm_flags(["--position-embedding-type", "rope", "--no-position-embedding"],
                                          build_parser())
    assert argv == ["--position-embedding-type", "rope"] and notice is None


def test_launcher_prints_one_notice(monkeypatch, capsys):
    """launch/pretrain_gpt.py itself takes the accepted flags and says so once (training replaced by a stub)."""
    import hetu_ext.cli.train as train

    monkeypatch.setattr(train, "_train", lambda config: 0)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--mock-data",
            "--attention-backend", "auto", "--overlap-grad-reduce", "--transformer-impl", "local"]
    try:
        assert train.main(argv) == 0
    finally:
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(key, raising=False)
    err = [line for line in capsys.readouterr().err.splitlines() if "accepted" in line]
    assert len(err) == 1 and "--attention-backend auto -> " in err[0] and "--overlap-grad-reduce -> " in err[0]
    assert "--transformer-impl" not in err[0]


# --- sample-based schedules (--train-samples --lr-decay-samples --lr-warmup-samples --lr-warmup-fraction) ---
BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--min-lr", "1e-4", "--mock-data",
        "--lr-decay-style", "cosine", "--hidden-dropout", "0", "--attention-dropout", "0"]


def _config(*flags: str):
    from hetu_ext.cli.args import parse_run_config

    return parse_run_config([*BASE, *flags])


def _megatron_lr(samples: float, *, max_lr: float, min_lr: float, warmup: float, decay: float) -> float:
    """Megatron-LM's LR after ``samples`` samples (OptimizerParamScheduler.get_lr, cosine, init LR 0), written
    out here independently of the scheduler the trainer builds."""
    import math

    if warmup > 0 and samples <= warmup:
        return max_lr * samples / warmup
    if samples > decay:
        return min_lr
    ratio = (samples - warmup) / (decay - warmup)
    return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (max_lr - min_lr)


def _lrs(training, unit: int, steps: int) -> list[float]:
    """The LR the trainer's scheduler (Megatron-core's, with scheduler_settings) gives after each step."""
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from hetu_ext.megatron.state import scheduler_settings

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    sched = OptimizerParamScheduler(opt, init_lr=0.0, **scheduler_settings(training, unit))
    out = []
    for _ in range(steps):
        sched.step(increment=unit)
        out.append(opt.param_groups[0]["lr"])
    return out


def test_train_samples_sets_the_steps_and_the_schedule_counts_samples():
    """--train-samples 100 at global batch 8: 12 steps (the partial batch dropped, as Megatron-LM); the LR after
    each step is Megatron-LM's formula over samples (warmup 20 samples: not a whole number of steps, so an
    iteration-based stand-in would get it wrong)."""
    config = _config("--train-samples", "100", "--lr-decay-samples", "90", "--lr-warmup-samples", "20")
    assert config.training.train_iters == 12
    want = [_megatron_lr(8 * k, max_lr=1e-3, min_lr=1e-4, warmup=20, decay=90) for k in range(1, 13)]
    assert _lrs(config.training, 8, 12) == pytest.approx(want, rel=1e-12)


def test_sample_schedule_equals_the_iteration_schedule_in_whole_batches():
    samples = _config("--train-samples", "96", "--lr-decay-samples", "80", "--lr-warmup-samples", "16")
    iters = _config("--train-iters", "12", "--lr-decay-iters", "10", "--lr-warmup-iters", "2")
    assert _lrs(samples.training, 8, 12) == _lrs(iters.training, 8, 12)


@pytest.mark.parametrize("flags", [["--train-samples", "96"], ["--train-iters", "12"]])
def test_warmup_fraction_is_a_share_of_the_decay(flags):
    config = _config(*flags, "--lr-warmup-fraction", "0.25")
    want = [_megatron_lr(8 * k, max_lr=1e-3, min_lr=1e-4, warmup=24, decay=96) for k in range(1, 13)]
    assert _lrs(config.training, 8, 12) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("flags, needle", [
    (["--train-samples", "96", "--train-iters", "12"], "exactly one of --train-iters"),
    ([], "--train-iters is required"),
    (["--train-samples", "96", "--lr-decay-iters", "10"], "--lr-decay-samples"),
    (["--train-iters", "12", "--lr-warmup-samples", "8"], "--lr-warmup-iters"),
    (["--train-iters", "12", "--lr-warmup-iters", "2", "--lr-warmup-fraction", "0.1"], "give one"),
    (["--train-samples", "4"], "less than one global batch"),
    (["--train-iters", "12", "--lr-warmup-fraction", "2"], "[0, 1]"),
])
def test_schedule_flags_bad_input_is_one_line(flags, needle):
    with pytest.raises(ValueError) as err:
        _config(*flags)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_train_samples_needs_the_global_batch():
    from hetu_ext.cli.args import parse_run_config

    argv = [t for t in BASE if t not in ("--global-batch-size", "8")] + ["--train-samples", "96"]
    with pytest.raises(ValueError, match="needs --global-batch-size"):
        parse_run_config(argv)


def test_printed_config_of_a_sample_run_reproduces_it(tmp_path):
    """--hetu-print-config writes the samples and a null step count: the file alone parses to the same run."""
    from hetu_ext.config import to_yaml

    config = _config("--train-samples", "96", "--lr-warmup-samples", "8")
    path = tmp_path / "run.yaml"
    path.write_text(to_yaml(config))
    again = __import__("hetu_ext.cli.args", fromlist=["x"]).parse_run_config(["--hetu-config", str(path)])
    assert again == config and again.training.train_iters == 12


# --- --decoupled-lr / --decoupled-min-lr ---
def _group_lrs(rank: int, world_size: int, argv: list[str]) -> dict:
    """Train ``argv`` 3 steps; each parameter's (lr, max_lr, min_lr) of its optimizer group, by parameter name."""
    from hetu_ext.cli.args import parse_run_config
    from hetu_ext.cli.train import build_run
    from hetu_ext.megatron.state import optimizers

    trainer = build_run(parse_run_config(argv))
    trainer.train(log=lambda line: None)
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    out = {}
    for opt in optimizers(trainer.optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                main = names.get(id(p))
                if main is None:  # bf16: the group holds the fp32 master; find its model parameter
                    continue
                out[main] = (group["lr"], group["max_lr"], group["min_lr"])
    return out


@pytest.mark.parametrize("runtime", ["megatron", "plan"])
def test_decoupled_lr_drives_the_embedding_and_output_layer(runtime):
    """The word embedding and the (untied) output layer follow the decoupled peak and minimum; every other
    parameter the main schedule. After 3 of 4 steps with cosine decay both are strictly between peak and min, so a
    group on the wrong schedule shows."""
    from hetu_ext.testing.multiproc import run_ranks

    argv = [*BASE, "--train-iters", "3", "--lr-decay-iters", "4", "--untie-embeddings-and-output-weights",
            "--decoupled-lr", "5e-3", "--decoupled-min-lr", "5e-4", "--hetu-runtime", runtime]
    groups = run_ranks(_group_lrs, 1, argv, timeout=240)[0]
    want = {"main": _megatron_lr(24, max_lr=1e-3, min_lr=1e-4, warmup=0, decay=32),
            "decoupled": _megatron_lr(24, max_lr=5e-3, min_lr=5e-4, warmup=0, decay=32)}
    decoupled = [n for n in groups if "word_embeddings" in n or "output_layer" in n]
    assert len(decoupled) == 2, sorted(groups)
    for name, (lr, max_lr, min_lr) in groups.items():
        kind = "decoupled" if name in decoupled else "main"
        assert (max_lr, min_lr) == ((5e-3, 5e-4) if kind == "decoupled" else (1e-3, 1e-4)), name
        assert lr == pytest.approx(want[kind], rel=1e-12), (name, lr, want)


def test_decoupled_min_lr_needs_the_decoupled_lr():
    with pytest.raises(ValueError, match="needs --decoupled-lr"):
        _config("--train-iters", "2", "--decoupled-min-lr", "1e-5")


# --- --apply-layernorm-1p ---
def _norm_keys(weights: dict) -> list[str]:
    """The norms' gammas: the parameters the model inventory initialises to ones."""
    from hetu_ext.model.inventory import init_rule

    return [k for k in weights if init_rule(k) == "ones"]


@pytest.mark.parametrize("normalization, ranks, extra", [
    ("LayerNorm", 1, []),
    ("RMSNorm", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--qk-layernorm",
                    "--hetu-runtime", "plan"]),
])
def test_layernorm_1p_equals_the_plain_model_with_gamma_plus_one(normalization, ranks, extra):
    """--apply-layernorm-1p stores each norm weight as gamma - 1 (Megatron's own value, in the gathered weights and
    so in checkpoints) and trains like the plain model whose gammas are those + 1. Initialised at gamma 1, both
    start from the same function: the first loss is bit-identical (a stored 1, i.e. gamma 2, would change it), the
    later ones differ by the rounding of w - u + 1 against (w + 1) - u (relative 1e-5 allows far more than that
    and far less than a wrong gamma). The second case runs TP 2 with sequence parallelism and q/k norms, where the
    zero-centred norms must also carry the sequence-parallel mark."""
    from hetu_ext.cli.runs import train
    from hetu_ext.testing.multiproc import run_ranks

    argv = [*BASE, "--train-iters", "3", "--normalization", normalization]
    if "--qk-layernorm" in extra:  # the reference has the same q/k norms, on one rank
        argv.append("--qk-layernorm")
        extra = [f for f in extra if f != "--qk-layernorm"]
    plain = run_ranks(train, 1, argv, timeout=240)[0]
    one_p = [r for r in run_ranks(train, ranks, [*argv, "--apply-layernorm-1p", *extra],
                                  timeout=240) if r][0]
    if ranks == 1:
        assert one_p["losses"][0] == plain["losses"][0]
    assert one_p["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    keys = _norm_keys(plain["weights"])
    assert any("final_layernorm" in k for k in keys) and any("layer_norm_weight" in k for k in keys), keys
    for key, tensor in plain["weights"].items():
        stored = one_p["weights"][key]
        if key in keys:
            assert stored.abs().max() < 0.05, key  # near 0: gamma - 1 after 3 small steps
            assert torch_allclose(stored + 1, tensor), key
        else:
            assert torch_allclose(stored, tensor), key


def torch_allclose(a, b) -> bool:
    import torch

    return torch.allclose(a, b, rtol=0, atol=2e-5)


# --- --exit-duration-in-mins ---
def _train_started_early(rank: int, world_size: int, argv: list[str], minutes_ago: float) -> dict:
    """Train ``argv`` as if the process had started ``minutes_ago`` minutes earlier on rank 1 only (the MAX over
    ranks must stop rank 0 too)."""
    import hetu_ext.train.trainer as trainer_module
    from hetu_ext.cli.runs import train

    if rank == 1:
        trainer_module.PROCESS_START -= minutes_ago * 60
    return train(rank, world_size, argv, gather=False)


def test_a_forked_process_counts_from_its_own_start():
    """The test harness forks ranks from a server that imported the trainer long before (CI's run of stop 44 saw a
    rank stop after one step of a run 40 minutes into the suite): a forked process's clock starts at the fork."""
    import hetu_ext.train.trainer as trainer_module

    saved = trainer_module.PROCESS_START
    trainer_module.PROCESS_START -= 3600.0
    try:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report its own age in seconds, then leave without pytest's teardown
            os.write(write, str(time.time() - trainer_module.PROCESS_START).encode())
            os._exit(0)
        os.close(write)
        age = float(os.read(read, 64).decode())
        os.waitpid(pid, 0)
    finally:
        trainer_module.PROCESS_START = saved
    assert 0.0 <= age < 60.0


def test_exit_duration_stops_every_rank_after_the_step_and_saves(tmp_path):
    """Rank 1's clock is past --exit-duration-in-mins 30 from the start: both ranks stop after step 1 (not 4) and
    the final save holds iteration 1."""
    from hetu_ext.testing.multiproc import run_ranks

    argv = [*BASE, "--train-iters", "4", "--exit-duration-in-mins", "30", "--save", str(tmp_path / "ck")]
    out = run_ranks(_train_started_early, 2, argv, 45.0, timeout=240)[0]
    assert len(out["losses"]) == 1, out["log_lines"]
    assert any("exiting program after" in line for line in out["log_lines"]), out["log_lines"]
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    again = run_ranks(_train_started_early, 2, argv[:-2], 0.0, timeout=240)[0]  # not yet 30 minutes: all 4 steps
    assert len(again["losses"]) == 4


def test_exit_duration_on_a_save_interval_step_saves_once_and_completes(tmp_path):
    """Stopping at a step of --save-interval: that save is the last one and is complete (not left in the
    background) when training returns."""
    from hetu_ext.testing.multiproc import run_ranks

    argv = [*BASE, "--train-iters", "4", "--exit-duration-in-mins", "30", "--save", str(tmp_path / "ck"),
            "--save-interval", "1"]
    out = run_ranks(_train_started_early, 2, argv, 45.0, timeout=240)[0]
    assert len(out["losses"]) == 1
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


# --- --grad-reduce-in-bf16 ---
def _grad_dtype(rank: int, world_size: int, argv: list[str]) -> dict:
    """Train ``argv``; the dtype of DDP's gradient buffer (``main_grad``) and the losses."""
    from hetu_ext.cli.args import parse_run_config
    from hetu_ext.cli.train import build_run

    trainer = build_run(parse_run_config(argv))
    losses = trainer.train(log=lambda line: None)
    dtypes = {str(p.main_grad.dtype) for p in trainer.model.parameters() if hasattr(p, "main_grad")}
    return {"losses": losses, "dtypes": dtypes}


@pytest.mark.parametrize("extra", [[], ["--hetu-runtime", "plan"],
                                   ["--hetu-runtime", "plan", "--use-distributed-optimizer"]])
def test_grad_reduce_in_bf16_keeps_the_gradient_buffers_in_bf16(extra):
    """Megatron-LM's default under --bf16 accumulates and reduces gradients in fp32; --grad-reduce-in-bf16 in
    the bf16 parameters' dtype. DP 2, both runtimes: the buffers' dtype says which, and the losses stay those of
    the fp32 reduction within bf16's resolution (relative 1e-2: 2-3 bf16 ulps of a loss near 7)."""
    from hetu_ext.testing.multiproc import run_ranks

    argv = [*BASE, "--train-iters", "3", "--bf16", *extra]
    fp32 = run_ranks(_grad_dtype, 2, argv, timeout=240)[0]
    bf16 = run_ranks(_grad_dtype, 2, [*argv, "--grad-reduce-in-bf16"], timeout=240)[0]
    assert fp32["dtypes"] == {"torch.float32"} and bf16["dtypes"] == {"torch.bfloat16"}
    assert bf16["losses"] == pytest.approx(fp32["losses"], rel=1e-2)


def test_grad_reduce_in_bf16_needs_bf16():
    with pytest.raises(ValueError, match="add --bf16"):
        _config("--train-iters", "2", "--grad-reduce-in-bf16")


# --- file tokenizers: HuggingFaceTokenizer, GPT2BPETokenizer (local files, nothing downloaded) ---
TEXTS = ["hello world, the quick brown fox jumps over the lazy dog", "def f(x): return x + 1  # it's 42",
         "Megatron-LM's recipes, unchanged"]


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    """A tiny GPT-2-style byte-level BPE (300 ids, <|endoftext|> among them), made here with the tokenizers
    library: vocab.json + merges.txt, and the same as a Hugging Face tokenizer directory."""
    import json

    from tokenizers import ByteLevelBPETokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(TEXTS * 20, vocab_size=300, min_frequency=1, special_tokens=["<|endoftext|>"])
    bpe.save_model(str(out))
    hf = out / "hf"
    hf.mkdir()
    bpe._tokenizer.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>",
                                                          "tokenizer_class": "PreTrainedTokenizerFast"}))
    return {"vocab": str(out / "vocab.json"), "merges": str(out / "merges.txt"), "hf": str(hf)}


def _megatron_gpt2_tokenizer(vocab: str, merges: str):
    """Megatron-LM's own GPT-2 BPE (megatron/training/tokenizer/gpt2_tokenization.py of the checkout), loaded by
    path: the reference of GPT2BPETokenizer."""
    import importlib.util
    from pathlib import Path

    path = (Path(__file__).resolve().parents[2] / "shared" / "thirdparty" / "Megatron-LM-core_v0.16.1" / "megatron"
            / "training" / "tokenizer" / "gpt2_tokenization.py")
    if not path.is_file():
        pytest.skip(f"no Megatron-LM checkout at {path}")
    spec = importlib.util.spec_from_file_location("megatron_lm_gpt2_tokenization", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.GPT2Tokenizer(vocab, merges, errors="replace", special_tokens=[], max_len=None)


def test_gpt2_bpe_tokenizer_is_megatron_lms(tokenizer_files):
    from hetu_ext.megatron.tokenizers import open_file_tokenizer

    ours = open_file_tokenizer("GPT2BPETokenizer", vocab_file=tokenizer_files["vocab"],
                               merge_file=tokenizer_files["merges"])
    theirs = _megatron_gpt2_tokenizer(tokenizer_files["vocab"], tokenizer_files["merges"])
    for text in [*TEXTS, "unseen: Zürich ß 東京 \n\n  spaces"]:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(ours.encode(text)) == text
    assert ours.vocab_size == len(theirs.encoder) == 300 and ours.eod == theirs.encoder["<|endoftext|>"]


def test_huggingface_tokenizer_reads_a_local_directory(tokenizer_files):
    """Megatron-LM's HuggingFaceTokenizer is transformers' AutoTokenizer: ids from the directory's tokenizer.json
    (read here independently with the tokenizers library), vocabulary len(tokenizer), end of document its EOS."""
    from tokenizers import Tokenizer

    from hetu_ext.megatron.tokenizers import open_file_tokenizer

    ours = open_file_tokenizer("HuggingFaceTokenizer", tokenizer_model=tokenizer_files["hf"])
    raw = Tokenizer.from_file(f"{tokenizer_files['hf']}/tokenizer.json")
    for text in TEXTS:
        assert ours.encode(text) == raw.encode(text).ids
    assert ours.vocab_size == raw.get_vocab_size(with_added_tokens=True) == 300
    assert ours.eod == raw.token_to_id("<|endoftext|>")


def test_file_tokenizer_sets_the_vocabulary_and_trains(tokenizer_files):
    """The launcher reads the files' vocabulary (300 ids, padded to 384 rows); a run trains on it."""
    from hetu_ext.cli.runs import train
    from hetu_ext.testing.multiproc import run_ranks

    flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", tokenizer_files["vocab"], "--merge-file",
             tokenizer_files["merges"]]
    assert _config("--train-iters", "1", *flags).data.vocab_size == 300
    out = run_ranks(train, 1, [*BASE, "--train-iters", "2", "--tokenizer-type", "HuggingFaceTokenizer",
                               "--tokenizer-model", tokenizer_files["hf"]], timeout=240)[0]
    assert out["weights"]["embedding.word_embeddings.weight"].shape[0] == 384 and len(out["losses"]) == 2


@pytest.mark.parametrize("flags, needle", [
    (["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "x.model"], "a local SentencePiece model"),
    (["--tokenizer-type", "NullTokenizer", "--vocab-size", "10", "--vocab-file", "v.json"],
     "read by --tokenizer-type GPT2BPETokenizer"),
    (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "/no/such/dir"], "nothing is downloaded"),
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "/no/vocab.json"], "--vocab-file"),
])
def test_tokenizer_bad_input_is_one_line(flags, needle):
    with pytest.raises(ValueError) as err:
        _config("--train-iters", "1", *flags)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_vocab_size_other_than_the_files_is_refused(tokenizer_files):
    with pytest.raises(ValueError, match="differs from the 300 ids"):
        _config("--train-iters", "1", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                tokenizer_files["hf"], "--vocab-size", "512")


def test_data_cache_path_holds_the_index_caches(tmp_path):
    """--data-cache-path reaches Megatron-core's dataset builder: the mock dataset's index caches are written
    there (without it Megatron-core says it cannot save them)."""
    from hetu_ext.cli.runs import train
    from hetu_ext.testing.multiproc import run_ranks

    run_ranks(train, 1, [*BASE, "--train-iters", "1", "--split", "949,50,1", "--data-cache-path", str(tmp_path)],
              False, timeout=240)
    assert list(tmp_path.rglob("*.npy")), sorted(tmp_path.rglob("*"))


# --- the Llama 3 recipe handed over to hetu_ext's trainer (e2e) ---
HETERO_2 = """
pipelines:
  - num_microbatches: 5
    stages:
      - {ranks: [0], layers: [0, 4]}
  - num_microbatches: 3
    stages:
      - {ranks: [1], layers: [0, 4]}
"""


def _recipe(tmp_path) -> list[str]:
    """The Llama recipe's flags, 4 steps (32 samples), an evaluation every 2, paths in ``tmp_path``."""
    swap = {"96": "32", "90": "30", "CACHE": str(tmp_path / "cache"), "CK": str(tmp_path / "ck"),
            "TB": str(tmp_path / "tb")}
    flags, prev = [], None
    for token in LLAMA:
        value = swap.get(token, token) if prev in ("--train-samples", "--lr-decay-samples", "--data-cache-path",
                                                    "--save", "--load", "--tensorboard-dir") else token
        flags.append({"--eval-iters": "1", "--eval-interval": "2"}.get(prev, value) if prev in (
            "--eval-iters", "--eval-interval") else value)
        prev = token
    return flags


def test_llama_recipe_hands_off_to_a_heterogeneous_plan_and_equals_one_process(tmp_path):
    """``torchrun -m hetu_ext.megatron_lm pretrain_gpt.py <the recipe's flags> --hetu-plan`` (pipelines of 5 and
    3 microbatches) trains through its evaluations with the accepted flags' one notice, and its losses equal one
    process's run of the same flags through launch/pretrain_gpt.py's parser (bf16: relative 1e-4; dropping
    --decoupled-lr alone moves the last loss by 7e-3, measured 2026-12-07)."""
    import re
    from pathlib import Path

    from hetu_ext.cli.runs import train
    from hetu_ext.testing.multiproc import run_ranks

    script = Path(__file__).resolve().parents[2] / "shared" / "thirdparty" / "Megatron-LM-core_v0.16.1" / \
        "pretrain_gpt.py"
    if not script.is_file():
        pytest.skip(f"no Megatron-LM checkout at {script.parent}")
    plan = tmp_path / "plan.yaml"
    plan.write_text(HETERO_2)
    flags = _recipe(tmp_path)
    proc = megatron_lm(tmp_path, script, *flags, "--hetu-plan", str(plan), timeout=600)
    out = proc.stdout + proc.stderr
    assert len([line for line in out.splitlines() if "accepted (what runs instead)" in line]) == 1, out[-3000:]
    losses = [float(x) for x in re.findall(r"iteration\s+\d+/\s*4 \|.*?lm loss: ([0-9.E+-]+) \|", out)]
    assert len(losses) == 4 and out.count("validation loss at iteration") >= 2, out[-3000:]
    alone = [str(tmp_path / "ck_one") if f == str(tmp_path / "ck") else f for f in flags]  # its own --save/--load
    reference = run_ranks(train, 1, alone, False, timeout=300)[0]["losses"]
    assert losses == pytest.approx(reference, rel=1e-4), (losses, reference)


def test_checkpoint_of_the_other_norm_convention_is_refused(tmp_path):
    """A checkpoint saved with --apply-layernorm-1p holds gamma - 1: loading it into a run without the flag (same
    tensors, other meaning) is one line naming the flag; with the flag it resumes."""
    from hetu_ext.cli.runs import train
    from hetu_ext.testing.multiproc import RankError, run_ranks

    argv = [*BASE, "--train-iters", "1", "--lr-decay-iters", "2", "--apply-layernorm-1p", "--save", str(tmp_path)]
    run_ranks(train, 1, argv, False, timeout=240)
    with pytest.raises(RankError, match="saved with --apply-layernorm-1p"):
        run_ranks(train, 1, [*BASE, "--train-iters", "2", "--load", str(tmp_path)], False, timeout=240)
    out = run_ranks(train, 1, [*BASE, "--train-iters", "2", "--apply-layernorm-1p", "--load", str(tmp_path)],
                    False, timeout=240)[0]
    assert len(out["losses"]) == 2


def test_print_config_says_which_flags_it_leaves_out(capsys):
    """--hetu-print-config writes no accepted flag into the file; the notice says so on stderr."""
    import hetu_ext.cli.train as train

    argv = [*BASE, "--train-iters", "2", "--manual-gc", "--hetu-print-config"]
    assert train.main(argv) == 0
    out, err = capsys.readouterr()
    assert "manual" not in out and "--manual-gc -> " in err

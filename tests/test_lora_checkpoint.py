"""LobRA checkpoints: tenants' adapters and Adam state saved in hetu_ext's format, resumed and resharded.

One 4-step run of 3 tenants on the 3-rank heterogeneous plan of test_lobra_training (a TP 1 pipeline and a TP 2
pipeline) saves every 2 steps; the tenant ``sums`` has no data in steps 2 and 4, so at the step-2 checkpoint its
Adam step count (1) differs from the others' (2). That run is the uninterrupted reference. Its step-2 checkpoint
is then resumed for 2 more steps:

* under the same plan: right after loading, every adapter factor, Adam moment and per-tenant step equals the
  saved one bit for bit, and the final adapters, moments, steps and (per-tenant) losses equal the uninterrupted
  run's bit for bit (the same sums in the same order; RNG restored);
* resharded into 2 ranks (DP 2, one TP 1 stage each; or one TP 2 stage): the loaded state again equals the
  saved one bit for bit (a reshard moves bytes), and the final adapters and moments are within
  test_lobra_training's ADAPTER_ATOL (1e-5; another layout orders floating-point sums differently, see that
  module's docstring; measured 6.4e-7 / 8.3e-7), losses within 1e-6 relative (measured 2.5e-8 / 1.9e-8).
  Loading every tenant at the same Adam step (a lost per-tenant count) moves them by 1.4e-4 (measured, DP 2).

The frozen base is not in the checkpoint (only ``param/``, ``exp_avg/``, ``exp_avg_sq/`` adapter tensors) and a
checkpoint whose tenants differ from the tenants file is refused with one line, exit 2.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import yaml
from test_lobra_training import ADAPTER_ATOL, HETERO, LOSS_RTOL, TENANTS, _argv, _tenants_file
from helpers import assert_one_error_line, run

from hetu_ext.testing.multiproc import run_ranks

STEPS = 4


def _state(trainer) -> dict:
    """Gathered adapters and moments (by key), per-tenant Adam steps, iteration and losses (collective)."""
    from hetu_ext.lora.adapters import gather_adapters
    from hetu_ext.lora.checkpoint import tenant_steps

    placement = trainer.placement
    offset = placement.shard_kwargs.get("layer_offset", 0)
    moments: dict[str, dict] = {"exp_avg": {}, "exp_avg_sq": {}}
    stepped = {id(p): getattr(p, "main_param", p) for p in trainer.model.parameters() if p.requires_grad} \
        if placement.active else {}  # under --bf16 the optimizer steps (and the checkpoint holds) the fp32 masters
    for inner in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]) if placement.active else []:
        states = inner.optimizer.state
        for pid, held in stepped.items():
            if held in states or pid not in moments["exp_avg"]:
                for m in moments:
                    moments[m][pid] = states[held][m] if m in states.get(held, {}) else torch.zeros_like(held)
    out = {"param": gather_adapters(trainer.model, layer_offset=offset, values=stepped),
           "weight": gather_adapters(trainer.model, layer_offset=offset)}  # the model's copies (bf16 or fp32)
    for m, values in moments.items():
        out[m] = gather_adapters(trainer.model, layer_offset=offset, values=values)
    return {"tensors": out, "steps": tenant_steps(trainer.placement, trainer.plugin.tenants),
            "iteration": trainer.iteration, "losses": list(trainer.losses), "tenant_losses": [list(r) for r in trainer.plugin.tenant_losses]}


def ckpt_body(rank: int, world_size: int, argv: list[str]) -> dict | None:
    """Build (loading with --load), capture the state, train (capturing it at each save), capture again."""
    from hetu_ext.cli.args import parse_run_config
    from hetu_ext.cli.train import build_run

    trainer = build_run(parse_run_config(argv))
    loaded = _state(trainer)
    saved, save = {}, trainer._save

    def recording_save(directory):
        save(directory)
        saved[trainer.iteration] = _state(trainer)

    trainer._save = recording_save
    trainer.train(log=lambda line: None)
    final = _state(trainer)
    return {"loaded": loaded, "saved": saved, "final": final} if rank == trainer.log_rank else None


def _run(world: int, argv: list[str]) -> dict:
    return next(r for r in run_ranks(ckpt_body, world, argv, timeout=300) if r is not None)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[kind][k] - b[kind][k]).abs().max()) for kind in a for k in a[kind])


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[kind].keys() == b[kind].keys() and
                                        all(torch.equal(v, b[kind][k]) for k, v in a[kind].items()) for kind in a)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """The uninterrupted 4-step run on the heterogeneous plan, saving every 2 steps; a directory holding only its
    step-2 checkpoint (its ``latest``)."""
    tmp = tmp_path_factory.mktemp("lobra_ckpt")
    (tmp / "hetero.yaml").write_text(HETERO)
    tenants = _tenants_file(tmp / "tenants.yaml", TENANTS)
    argv = _argv(tenants, "--hetu-plan", str(tmp / "hetero.yaml"), "--train-iters", str(STEPS),
                 "--save", str(tmp / "ckpt"), "--save-interval", "2")
    result = _run(3, argv)
    at2 = tmp / "at2"
    at2.mkdir()
    shutil.copytree(tmp / "ckpt" / "iter_0000002", at2 / "iter_0000002")
    (at2 / "latest_checkpointed_iteration.txt").write_text("2")
    return {"result": result, "tenants": tenants, "plan": str(tmp / "hetero.yaml"), "at2": str(at2),
            "ckpt": str(tmp / "ckpt"), "tmp": tmp}


def test_checkpoint_holds_adapters_and_per_tenant_steps(saved_run):
    from hetu_ext.checkpoint import LocalStorage
    from hetu_ext.checkpoint.reader import ShardReader, read_manifest

    manifest = read_manifest(LocalStorage(saved_run["at2"]), 2)
    kinds = {t.name.split("/", 1)[0] for t in manifest.tensors}
    assert kinds == {"param", "exp_avg", "exp_avg_sq"}
    assert all(".lora_A." in t.name or ".lora_B." in t.name for t in manifest.tensors), "the base was saved"
    assert manifest.state["tenant_steps"] == {"chat": 2.0, "code": 2.0, "sums": 1.0}
    saved = saved_run["result"]["saved"][2]
    assert saved["steps"] == manifest.state["tenant_steps"]
    full = ShardReader(LocalStorage(saved_run["at2"]), manifest).read_full()
    for (name, (layer,)), value in full.items():
        kind, key = name.split("/", 1)
        assert torch.equal(value, saved["tensors"][kind][key][layer]), name


def test_resume_same_plan_is_bit_exact(saved_run, tmp_path):
    """2 steps + save + 2 resumed steps == 4 uninterrupted steps, bit for bit, on the heterogeneous plan; the
    resumed run saves into the directory it resumed from as the same run."""
    from hetu_ext.checkpoint import LocalStorage
    from hetu_ext.checkpoint.reader import read_manifest

    full = saved_run["result"]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved_run["at2"], ckpt)
    resumed = _run(3, _argv(saved_run["tenants"], "--hetu-plan", saved_run["plan"], "--train-iters", str(STEPS),
                            "--load", str(ckpt), "--save", str(ckpt)))
    storage = LocalStorage(ckpt)
    assert read_manifest(storage, 4).run_id == read_manifest(storage, 2).run_id is not None
    loaded, saved = resumed["loaded"], full["saved"][2]
    assert loaded["iteration"] == 2 and loaded["steps"] == saved["steps"] and loaded["losses"] == saved["losses"]
    assert _equal(loaded["tensors"], saved["tensors"])
    final, want = resumed["final"], full["final"]
    assert final["steps"] == want["steps"] == {"chat": 4.0, "code": 4.0, "sums": 2.0}
    assert final["losses"] == want["losses"] and final["tenant_losses"] == want["tenant_losses"]
    assert _equal(final["tensors"], want["tensors"]), _max_diff(final["tensors"], want["tensors"])


@pytest.mark.parametrize("extra", [("--bf16",), ("--use-distributed-optimizer",),
                                   ("--bf16", "--use-distributed-optimizer")], ids=["bf16", "sharded", "bf16-sharded"])
def test_bf16_or_sharded_resume_same_plan_is_bit_exact(tmp_path, extra):
    """--bf16: the checkpoint holds the adapters' fp32 masters (not their bf16 copies) and Adam state;
    --use-distributed-optimizer: each box's Adam state (and master) from the rank that owns it. 2 steps + save +
    2 resumed steps equal 4 uninterrupted steps bit for bit (weights, masters, losses, per-tenant steps; with the
    distributed optimizer the moments are not gathered here, and a moment not restored changes step 3's update).
    Saving the bf16 copies instead fails the dtype check; skipping the cast after the load fails bit-exactness."""
    from hetu_ext.checkpoint import LocalStorage
    from hetu_ext.checkpoint.reader import read_manifest

    (tmp_path / "hetero.yaml").write_text(HETERO)
    tenants = _tenants_file(tmp_path / "tenants.yaml", TENANTS)
    argv = _argv(tenants, "--hetu-plan", str(tmp_path / "hetero.yaml"), "--train-iters", str(STEPS), *extra)
    full = _run(3, [*argv, "--save", str(tmp_path / "ckpt"), "--save-interval", "2"])
    manifest = read_manifest(LocalStorage(tmp_path / "ckpt"), 2)
    dtypes = {t.dtype for t in manifest.tensors}
    assert dtypes == {"F32"}, dtypes  # the fp32 masters, not the bf16 copies (BF16)
    assert {t.name.split("/", 1)[0] for t in manifest.tensors} == {"param", "exp_avg", "exp_avg_sq"}
    at2 = tmp_path / "at2"
    shutil.copytree(tmp_path / "ckpt" / "iter_0000002", at2 / "iter_0000002")
    (at2 / "latest_checkpointed_iteration.txt").write_text("2")
    resumed = _run(3, [*argv, "--load", str(at2)])
    assert _equal(resumed["loaded"]["tensors"], full["saved"][2]["tensors"])
    final, want = resumed["final"], full["final"]
    assert final["steps"] == want["steps"] == {"chat": 4.0, "code": 4.0, "sums": 2.0}
    assert final["losses"] == want["losses"] and final["tenant_losses"] == want["tenant_losses"]
    assert _equal(final["tensors"], want["tensors"]), _max_diff(final["tensors"], want["tensors"])
    if "--bf16" in extra and "--use-distributed-optimizer" not in extra:
        masters, weights = want["tensors"]["param"], want["tensors"]["weight"]
        assert any(not torch.equal(masters[k], weights[k]) for k in masters)  # the masters are not the bf16 copies


@pytest.mark.parametrize("layout", [(), ("--tensor-model-parallel-size", "2")], ids=["dp2", "tp2"])
def test_resume_resharded_into_two_ranks(saved_run, layout):
    """The heterogeneous plan's checkpoint into 2 ranks, DP 2 (every factor whole on each rank) or TP 2 (column
    B and row A split): loaded bit for bit, continued within 1e-5."""
    full = saved_run["result"]
    resumed = _run(2, _argv(saved_run["tenants"], "--train-iters", str(STEPS), "--load", saved_run["at2"], *layout))
    loaded, saved = resumed["loaded"], full["saved"][2]
    assert loaded["iteration"] == 2 and loaded["steps"] == saved["steps"] and loaded["losses"] == saved["losses"]
    assert _equal(loaded["tensors"], saved["tensors"])
    final, want = resumed["final"], full["final"]
    assert final["steps"] == want["steps"]
    diff = _max_diff(final["tensors"], want["tensors"])
    loss = max(abs(a - b) / abs(b) for a, b in zip(final["losses"], want["losses"]))
    print(f"hetero -> {'TP2' if layout else 'DP2'}: adapters/moments max abs diff {diff:.2e}, loss rel diff {loss:.2e}")
    assert diff <= ADAPTER_ATOL and loss <= LOSS_RTOL


def test_other_lora_rank_refused_exit_2(saved_run, tmp_path):
    """A tenant's LoRA rank differs from the checkpoint's: one line naming the tenant and both values, exit 2,
    before any rank starts (the launcher's check)."""
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump({"tenants": [TENANTS[0], {**TENANTS[1], "lora": {**TENANTS[1]["lora"],
                                                                                     "rank": 4}}, TENANTS[2]]}))
    proc = run(_argv(str(path), "--train-iters", str(STEPS), "--load", saved_run["at2"]))
    assert_one_error_line(proc, "tenant 'code': --load")
    assert "has LoRA rank 8, the tenants file 4" in proc.stderr


@pytest.mark.parametrize("tenants,needle", [
    (TENANTS[:2], "holds tenant 'sums' (tenants ['chat', 'code', 'sums']), which the tenants file does not have"),
    (TENANTS + [{**TENANTS[0], "name": "new"}], "tenant 'new' of the tenants file is not in --load"),
], ids=["missing", "added"])
def test_other_tenants_refused(saved_run, tmp_path, tenants, needle):
    """A tenant of the checkpoint missing from the tenants file, or one the checkpoint does not have: the same
    check (validate_args), one-line ValueError."""
    from hetu_ext.cli.args import parse_run_config

    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump({"tenants": tenants}))
    with pytest.raises(ValueError) as info:
        parse_run_config(_argv(str(path), "--train-iters", str(STEPS), "--load", saved_run["at2"]))
    assert needle in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_export_peft_from_checkpoint(saved_run, tmp_path):
    """``python -m hetu_ext.lora export-peft`` writes what write_peft writes from the trained adapters (the
    PEFT round trip of those files is test_lora_peft's)."""
    from safetensors.torch import load_file

    from hetu_ext.lora.__main__ import main
    from hetu_ext.lora.peft import write_peft
    from hetu_ext.config.tenants import load_tenants

    assert main(["export-peft", "--load", saved_run["ckpt"], "--out", str(tmp_path / "out"), "--base", "gpt2"]) == 0
    adapters = saved_run["result"]["final"]["tensors"]["param"]  # the iteration-4 checkpoint is the final state
    for tenant in load_tenants(saved_run["tenants"]):
        want = write_peft(tmp_path / "want" / tenant.name, adapters, tenant, num_attention_heads=4, base="gpt2")
        got = tmp_path / "out" / tenant.name
        assert (got / "adapter_config.json").read_text() == (want / "adapter_config.json").read_text()
        a, b = load_file(got / "adapter_model.safetensors"), load_file(want / "adapter_model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert main(["export-peft", "--load", str(tmp_path / "want"), "--out", str(tmp_path / "x")]) == 2

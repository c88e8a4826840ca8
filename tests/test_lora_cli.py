"""LobRA's inputs: the tenants file's one-line errors (launcher and planner, exit 2), and the pure planner."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from helpers import ROOT, assert_one_error_line, run

TENANT = """tenants:
  - name: chat
    lengths: {mode: distribution, type: lognormal, min_seq_len: 4, max_seq_len: 60, mean_seq_len: 16,
              lognormal_sigma: 0.6}
    samples: 4
    lora: {rank: 4, alpha: 8, targets: [qkv, fc2]}
"""
ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3"]


@pytest.mark.parametrize("edit,needle", [
    (("samples: 4", "sampels: 4"), "unknown key 'sampels' in tenant 'chat' of --hetu-lora-tenants"),
    (("samples: 4", "samples: [0, 0]"), "gives the tenant no data in any step"),
    (("targets: [qkv, fc2]", "targets: [qkv, fc3]"), "target 'fc3' is not a layer of the model"),
])
def test_bad_tenants_file_is_one_error_line(tmp_path, edit, needle):
    """Acceptance 4: an unknown key (with the closest one), a tenant with no data, an adapter target that does
    not exist: one error line, exit 2, before any rank starts."""
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANT.replace(*edit))
    proc = run(["--nproc-per-node", "2", *ARGV, "--hetu-lora-tenants", str(path)])
    assert_one_error_line(proc, needle)
    if "sampels" in edit[1]:
        assert "did you mean 'samples'?" in proc.stderr


def test_tenants_with_other_data_flags_refused(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANT)
    assert_one_error_line(run([*ARGV, "--mock-data", "--hetu-lora-tenants", str(path)]), "drop --mock-data")


def test_tenants_refuse_torch_dist_checkpoints(tmp_path):
    """Adapter checkpoints are hetu_ext's format only: one error line, exit 2, before any rank starts."""
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANT)
    assert_one_error_line(run(["--nproc-per-node", "2", *ARGV, "--hetu-lora-tenants", str(path),
                               "--hetu-ckpt-format", "torch_dist", "--save", "ckpt"]),
                          "does not combine with --hetu-ckpt-format torch_dist yet")


def test_planner_bad_tenants_file_exit_2(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANT.replace("lora:", "lroa:"))
    proc = subprocess.run([sys.executable, "-m", "hetu_ext.plan", "lobra", "--tenants", str(path), "--world-size",
                           "4", *ARGV[:8]], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("error:") == 1 and "unknown key 'lroa'" in proc.stderr and "'lora'" in proc.stderr


def test_tenants_file_parses_schedules_and_defaults(tmp_path):
    from hetu_ext.config.tenants import TARGETS, load_tenants

    (tmp_path / "lens.txt").write_text("5\n9\n")
    (tmp_path / "t.yaml").write_text(TENANT + """  - name: docs
    lengths: {mode: file, path: lens.txt}
    tokens: [100, 0]
""")
    chat, docs = load_tenants(tmp_path / "t.yaml")
    assert chat.lora.targets == ("qkv", "fc2") and chat.lora.scaling == 2.0 and chat.quota(5) == ("samples", 4)
    assert docs.lora.targets == TARGETS and docs.quota(0) == ("tokens", 100) and docs.quota(1) == ("tokens", 0)
    assert docs.lengths["path"] == str(tmp_path / "lens.txt")  # relative to the tenants file


def _tiny_planner(world_size: int):
    from hetu_ext.plan import ModelSpec
    from hetu_ext.plan.lobra import TenantLengths, lobra_cost_model, sample_steps, strategy_pool

    spec = ModelSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=11008,
                     vocab_size=32000, seq_length=16384)
    pool = strategy_pool(spec, lobra_cost_model(), gpu_memory_bytes=80 * 2**30, gpus_per_node=8,
                         max_gpus=world_size)
    rng = np.random.default_rng(0)
    tenants = [TenantLengths("short", rng.integers(50, 800, 500), 48),
               TenantLengths("long", rng.integers(2000, 16384, 500), 6)]
    return spec, pool, sample_steps(tenants, steps=3, seed=0, max_len=16384)


def test_planner_deployment_holds_every_sequence_and_beats_homogeneous():
    """The deployment fills the GPUs, its largest replica holds the longest sequence, its plan validates, and
    it is no slower than any homogeneous deployment (those are among the candidates it evaluates)."""
    from hetu_ext.plan.lobra import deployment_plan, joint_time_s, plan_deployment

    spec, pool, batches = _tiny_planner(16)
    best = plan_deployment(pool, batches, world_size=16, max_len=16384)
    assert 16 - best.gpus < min(s.gpus for s in pool)
    assert max(s.capacity for s, _ in best.counts) >= max(int(np.concatenate(b).max()) for b in batches)
    plan = deployment_plan(best, num_layers=32, gpus_per_node=8)
    plan.validate(spec, 16)
    for s in pool:
        if s.capacity >= 16384:
            homo = [s.replica] * (16 // s.gpus)
            assert best.step_s <= np.mean([joint_time_s(np.concatenate(b), homo) for b in batches]) * (1 + 1e-9)


def test_capacity_bound_is_a_lower_bound():
    """The enumeration's score never exceeds the exact evaluation (else it could discard the best deployment)."""
    from hetu_ext.plan.lobra import capacity_bound_s, joint_time_s

    _, pool, batches = _tiny_planner(8)
    for counts in ((8, 0, 0, 0), (4, 2, 0, 0), (0, 0, 2, 0), (2, 1, 1, 0)):
        chosen = tuple((s, n) for s, n in zip(pool, counts) if n)
        replicas = [s.replica for s, n in chosen for _ in range(n)]
        for b in batches:
            lengths = np.concatenate(b)
            if max(s.capacity for s, _ in chosen) < lengths.max():
                continue
            assert capacity_bound_s(lengths, chosen) <= joint_time_s(lengths, replicas) * (1 + 1e-9)

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "hetu_ext" / "data" / "samples" / "python_reference.jsonl"

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _launcher_env_restored():
    """A test that runs one rank in pytest's own process (a CLI's ``main``) gives it torchrun's variables; the
    next test's subprocesses must not inherit them (they would think torchrun launched them)."""
    before = {key: os.environ.get(key) for key in LAUNCHER_ENV}
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def sample_prefix(tmp_path_factory) -> str:
    """The shipped text sample as a Megatron indexed dataset (.bin/.idx), made once per session."""
    from hetu_ext.megatron.preprocess_data import preprocess

    out = tmp_path_factory.mktemp("data") / "pyref"
    prefix, count = preprocess(str(SAMPLE), str(out), append_eod=True)
    assert count == 79
    return prefix


@pytest.fixture(scope="session")
def one_process():
    """``one_process(argv)``: the single-process reference run of ``argv`` (hetu_ext.cli.runs.train on one
    rank: losses, gathered weights, log lines), computed once per session and shared by every module that compares
    with it. Callers must not modify what it returns."""
    from hetu_ext.testing.multiproc import run_ranks
    from hetu_ext.cli.runs import train

    runs: dict[tuple[str, ...], dict] = {}

    def reference(argv: list[str], timeout: float = 180) -> dict:
        key = tuple(argv)
        if key not in runs:
            runs[key] = run_ranks(train, 1, list(argv), timeout=timeout)[0]
        return runs[key]
    return reference


# --- Test kinds (pytest.ini registers the markers; `make test-fast` deselects all three) -------------------------
# gold:   exactness against a single-process (or uninterrupted, or dense) reference
# e2e:    launches real processes: torchrun, Megatron-LM's script, the DeepSpeed launcher, the elastic launcher,
#         the demo, README and docs/ blocks
# faults: fault injection: kills, corrupt or truncated files
# A test gets the markers of its module (MODULE_KINDS) plus those of every (module, name pattern) row of TEST_KINDS
# whose pattern matches the start of its name. Kept here so that no test file carries its own marks; FAST_MODULES
# lists the modules with none (pure tests, small multi-process tests, one-line-error checks).
MODULE_KINDS: dict[str, tuple[str, ...]] = {
    "test_uniform_equivalence": ("gold",),
    "test_plan_runtime": ("gold",),
    "test_context_parallel_training": ("gold",),
    "test_attention_gpu_check": ("e2e",),
    "test_migration": ("gold",),
    "test_packed_attention": ("gold",),
    "test_checkpointing": ("gold",),
    "test_ckpt_resume": ("gold",),
    "test_ckpt_interop": ("gold",),
    "test_ckpt_hf": ("gold",),
    "test_sharded_optimizer": ("gold",),
    "test_lobra_training": ("gold",),
    "test_lora_peft": ("gold",),
    "test_deepspeed_interop": ("gold",),
    "test_deepspeed_resume": ("gold",),
    "test_ckpt_faults": ("faults",),
    "test_ckpt_fallback": ("faults", "gold"),
    "test_ckpt_recovery": ("faults", "gold"),
    "test_deepspeed_elastic": ("e2e", "faults", "gold"),
    "test_elastic_rehearsal": ("e2e", "faults", "gold"),
    "test_elastic_config_error": ("e2e",),
    "test_deepspeed_packing": ("gold",),
    "test_demo": ("e2e",),
    "test_megatron_lm": ("e2e",),
    "test_megatron_lm_llama": ("e2e",),
    "test_megatron_lm_distopt": ("e2e", "gold"),
    "test_megatron_lm_moe": ("e2e", "gold"),
    "test_fp16": ("e2e", "gold"),
    "test_trainer_fp16": ("gold",),
    "test_trainer_distopt": ("gold",),
}
TEST_KINDS: list[tuple[str, str, tuple[str, ...]]] = [
    ("test_readme", r"test_docs_block_runs", ("e2e",)),
    ("test_megatron_lm", r"test_megatron_lm_(hetu_checkpoint|packing_equals)", ("gold",)),
    ("test_megatron_lm_llama", r"test_llama_(resume|packing_on_megatron_lm)", ("gold",)),
    ("test_megatron_lm_recipe", r"test_llama3_recipe_", ("e2e",)),
    ("test_megatron_lm_recipe", r"test_llama3_recipe_(with_straggler|handed_to)", ("gold",)),
    ("test_packed_training", r"test_packed_training_matches_unpacked_reference", ("gold",)),
    ("test_hf_llama", r"test_(imported_model_gives_transformers_logits|imported_model_runs_under|"
                      r"exported_model_is_the_original|llama31_rope_scaling)", ("gold",)),
    ("test_hf_moe", r"test_(imported_moe_model_gives|exported_moe_model_is)", ("gold",)),
    ("test_llama_training", r"test_llama_(plan_matches|packed_equals|migration_continues|hotspa_switching|"
                            r"lora_tenants|recomputation_is_bit_exact|hydraulis_candidates|sequence_parallel_with|"
                            r"activation_memory)", ("gold",)),
    ("test_hotspa", r"test_(hotspa_matches|per_group_normalisation|bf16_hotspa|checkpoint_saved_from_the_home)",
     ("gold",)),
    ("test_hydraulis_training", r"test_(steps_longest|each_step_under_its_candidate)", ("gold",)),
    ("test_lora_checkpoint", r"test_resume_(same_plan|resharded)", ("gold",)),
    ("test_lora_pretrained", r"test_(base_is_the_pretrained|resume_on_the_same_base)", ("gold",)),
    ("test_ckpt_deepspeed", r"test_(deepspeed_path_trains_like_megatron|zero2_world2|zero1_and_zero3|zero2_bf16)",
     ("gold",)),
    ("test_deepspeed_weighting", r"test_(zero1_weighted|zero0_weighted|zero0_bf16_weighted|emulated_straggler_moves)",
     ("gold",)),
    ("test_ckpt_hardening", r"test_distributed_optimizer_save_and_resume", ("gold",)),
    ("test_ckpt_hardening", r"test_schedule_error_is_one_line_and_exit_2_from_the_launcher", ("e2e",)),
    ("test_ckpt_hardening", r"test_inspect_notices_a_truncated_shard", ("faults",)),
    ("test_ckpt_format", r"test_every_flipped_byte_and_every_truncation", ("faults",)),
    ("test_stragglers", r"test_timing_and_emulation_leave_training_bit_identical", ("gold",)),
    ("test_fisedit", r"test_(conv_only_block|sparse_kernels|empty_mask|full_mask|budgeted_cache_stays_exact)",
     ("gold",)),
    ("test_fisedit_pipeline", r"test_launcher_writes", ("e2e",)),
    ("test_fisedit_toy", r"test_launcher_runs", ("e2e",)),
    ("test_pretrain_cli", r"test_(rank_errors_under_torchrun|without_torchrun_one_rank_trains|"
                          r"launcher_reports_a_crashed_rank|torchrun_tp2_pp2_trains)", ("e2e",)),
    ("test_deepspeed_cli", r"test_(resume_and_hetu_save_through_the_launcher|exit_interval_and_ckpt_step)", ("e2e",)),
    ("test_quiet", r"test_deepspeed_run_prints", ("e2e",)),
    ("test_tools_hardening", r"test_elastic_stops_on_a_configuration_error", ("e2e",)),
    ("test_recipe_flags", r"test_llama_recipe_hands_off", ("e2e", "gold")),
    ("test_tokenizers", r"test_mixtral_tokenizer_flags_train_(through_the_launcher|on_megatron_lms_loop)", ("e2e",)),
    ("test_recipe_flags", r"test_(layernorm_1p_equals|grad_reduce_in_bf16_keeps|decoupled_lr_drives)", ("gold",)),
    ("test_evaluation", r"test_(validation_loss_is_the_same|evaluations_read|training_is_bit_identical|"
                        r"evaluation_runs_in_eval_mode|megatron_lm_block|a_resumed_run)", ("gold",)),
    ("test_evaluation", r"test_(no_validation_split_is_one_line|a_split_part_without)", ("e2e",)),
    ("test_rampup", r"test_(heterogeneous_plan_with_a_ramp|resume_mid_ramp|uniform_grid_with_uneven)", ("gold",)),
    ("test_rampup", r"test_hand_off_ramps", ("e2e", "gold")),
]
FAST_MODULES = {
    "test_activations", "test_attention", "test_benchmarks_common", "test_calibrate_fit", "test_ckpt_cli", "test_ckpt_coverage",
    "test_chunked_loss", "test_layer_spec", "test_moe_predict",
    "test_ckpt_elastic", "test_ckpt_formats", "test_code_size",
    "test_ckpt_save_cache", "test_config", "test_cpu_patches", "test_data", "test_elastic_agreement",
    "test_elastic_argv", "test_elastic_watchdog", "test_fisedit_progress", "test_hydraulis_plan", "test_import_cost",
    "test_inventory", "test_layering", "test_layout", "test_lengths", "test_lobra_bound", "test_lobra_search", "test_lora_cli",
    "test_hotspa_pair_exact", "test_hotspa_relaxation_program", "test_malleus_planner", "test_packing", "test_plan",
    "test_plan_options", "test_reshard", "test_sharded_optimizer_layout",
    "test_step_model", "test_context_parallel_plans",
}
"""Modules read and found to hold no gold, e2e or fault-injection test (all in ``make test-fast``). Every test
module must be named here, in MODULE_KINDS or in TEST_KINDS (tests/test_readme.py checks it), so a new module
states its kind."""
KINDS = ("gold", "e2e", "faults")

SERIAL_MODULES = {"test_demo", "test_elastic_rehearsal", "test_elastic_config_error", "test_deepspeed_elastic"}
SERIAL_TESTS = [("test_readme", r"test_docs_block_runs\[(elastic-|plans-python_launch_elastic|"
                                r"deepspeed-python_launch_elastic|readme-make_demo)")]
"""Tests marked ``serial``: `make test` runs them one at a time after everything else, which runs on two
pytest-xdist workers. They judge wall-clock time (the demo's detection and recovery, the elastic launcher's
heartbeats, watchdog and restart rounds), which another test's ranks on the same two cores would push past their
deadlines; every other test's verdict does not depend on how busy the machine is."""

HEAVY_FIRST = ("test_readme", "test_megatron_lm_distopt", "test_megatron_lm_moe", "test_megatron_lm_llama",
               "test_megatron_lm_recipe",
               "test_deepspeed_resume", "test_megatron_lm", "test_ckpt_resume", "test_recipe_flags",
               "test_evaluation", "test_rampup", "test_deepspeed_weighting", "test_lobra_training")
"""Modules that take longest, handed to the two workers first (longest first: neither worker is left alone with
a long module at the end). The rest keep their collection order."""


def kinds_of(module: str, name: str) -> set[str]:
    """The kind markers of test ``name`` (parameters included or not) in ``module`` (file name without .py)."""
    kinds = set(MODULE_KINDS.get(module, ()))
    for mod, pattern, marks in TEST_KINDS:
        if mod == module and re.match(pattern, name):
            kinds.update(marks)
    return kinds


def xdist_group(module: str, item) -> str:
    """The tests one pytest-xdist worker runs together (`--dist loadgroup`): a whole module, so its module fixtures
    are built once; test_readme's blocks by page (a page's blocks share one folder, pages do not), so that its
    hundred launches are spread over both workers."""
    if module == "test_readme" and hasattr(item, "callspec") and "index" in item.callspec.params:
        return f"{module}:{item.module.BLOCKS[item.callspec.params['index']][1].stem}"
    return module


def is_serial(module: str, name: str) -> bool:
    return module in SERIAL_MODULES or any(mod == module and re.match(pattern, name)
                                           for mod, pattern in SERIAL_TESTS)


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = Path(str(item.fspath)).stem
        for kind in sorted(kinds_of(module, item.name)):
            item.add_marker(getattr(pytest.mark, kind))
        if is_serial(module, item.name):
            item.add_marker(pytest.mark.serial)
        item.add_marker(pytest.mark.xdist_group(xdist_group(module, item)))
    rank = {module: i for i, module in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).stem, len(rank)))  # stable: order kept within

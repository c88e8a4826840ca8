"""The trainer's metrics: one record per step (the JSONL file, TensorBoard, W&B) and Megatron-LM's log line of a
window of them; where the records go."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from hetu_ext.config import RunConfig
from hetu_ext.metrics import MetricsWriter, format_log_line
from hetu_ext.plan import format_plan, plan_to_dict
from hetu_ext.train.step import StepResult


def step_record(trainer, result: StepResult, *, step_s: float, consumed: int) -> dict:
    """This step's metrics record (written by the logging rank of ``trainer``, a
    :class:`~hetu_ext.train.trainer.Trainer`), the source of its log line. Under --fp16 it
    also has ``loss_scale`` (the scale after this step's update of the scaler) and ``skipped_iterations`` (1
    when this step's update was skipped, else 0), Megatron-LM's two fields."""
    loss, samples, tokens = result.loss, result.samples, result.tokens
    used = len(trainer.plan.used_ranks)
    tflops = trainer.flops_per_token * tokens / step_s / used / 1e12
    record = {"iteration": trainer.iteration, "train_iters": trainer.config.training.train_iters, "loss": loss,
              "lr": trainer.optimizer.param_groups[0]["lr"], "grad_norm": result.grad_norm, "samples": samples,
              "tokens": tokens, "consumed_samples": consumed, "step_ms": step_s * 1e3,
              "tokens_per_s": tokens / step_s, "tflops_per_rank": tflops,
              "mfu": tflops / trainer.peak_tflops if trainer.peak_tflops else None,
              "plan_id": trainer.plan_key, "ranks": used}
    if trainer.config.training.fp16:
        record["loss_scale"] = float(trainer.optimizer.get_loss_scale().item())
        record["skipped_iterations"] = int(result.skipped)
    if trainer.timer is not None and (trainer.timer.nominal_s is not None or trainer.layer_cost is not None):
        record["emulation_overruns"] = trainer.overruns
    if trainer.monitor is not None and trainer.monitor.exchanged_at == trainer.iteration:  # measured at this step
        record["compute_ms"] = {str(r): ms for r, ms in trainer.monitor.compute_ms.items()}
        record["slowdowns"] = {str(r): x for r, x in trainer.monitor.estimates.items()}
    if result.statistics is not None:
        record["packing"] = result.statistics
    if trainer.metrics is not None:
        trainer.metrics.step(**record)
    return record


def window_line(window: list[dict]) -> str:
    """Megatron-LM's log line of the steps since the last one: the last step's record with the window's mean step
    time and tokens/s, and under --fp16 the window's skipped steps (Megatron-LM counts them per log interval)."""
    seconds = sum(r["step_ms"] for r in window) / 1e3
    line = {**window[-1], "step_ms": seconds * 1e3 / len(window),
            "tokens_per_s": sum(r["tokens"] for r in window) / seconds}
    if "skipped_iterations" in line:
        line["skipped_iterations"] = sum(r["skipped_iterations"] for r in window)
    return format_log_line(line)


def report_migration(trainer, report, log, *, reporting: bool) -> None:
    """After a migration to ``trainer.plan`` (collective: every rank adds its bytes): the ``migration`` event and
    its log line, on the ``reporting`` rank."""
    sent = torch.tensor([float(report.bytes_sent), float(report.bytes_kept)], dtype=torch.float64)
    dist.all_reduce(sent)
    if not reporting:
        return
    if trainer.metrics is not None:
        trainer.metrics.event("migration", iteration=trainer.iteration, seconds=report.seconds,
                              bytes_sent=int(sent[0]), bytes_kept=int(sent[1]), plan_id=trainer.plan_key,
                              plan=plan_to_dict(trainer.plan))
    log(f"migrated to a new plan after step {trainer.iteration} in {report.seconds:.2f} s: "
        f"{sent[0] / 2**20:.2f} MiB sent between ranks, {sent[1] / 2**20:.2f} MiB kept in place\n"
        f"{format_plan(trainer.plan)}")


def open_metrics(config: RunConfig) -> MetricsWriter:
    """The run's metrics writer (a file only where :func:`metrics_path` names one)."""
    return MetricsWriter(metrics_path(config), tensorboard_dir=config.logging.tensorboard_dir,
                         wandb_project=config.logging.wandb_project, config=config.to_dict())


def metrics_path(config: RunConfig) -> str | None:
    """``--hetu-metrics-file``, else ``metrics.jsonl`` in the run directory (``--save``, else
    ``--tensorboard-dir``), else None (no file)."""
    if config.logging.metrics_file:
        return config.logging.metrics_file
    run_dir = config.checkpoint.save or config.logging.tensorboard_dir
    return os.path.join(run_dir, "metrics.jsonl") if run_dir else None

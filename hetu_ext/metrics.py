"""Metrics as records: one JSON object per training step and per event, appended to a JSONL file.

The Megatron-LM log line people read is formatted from the same record (:func:`format_log_line`); TensorBoard
(``--tensorboard-dir``) and W&B (``--wandb-project``) get the record's numbers; tests and benchmarks read the file
(:func:`read_records`), never the log text.

A step record (``"kind": "step"``)::

    iteration, train_iters, loss (mean per-token loss of the global batch), lr, grad_norm, samples and tokens
    (of the global batch), consumed_samples, step_ms (mean over the log window), tokens_per_s, tflops_per_rank
    (model FLOPs per second per used rank, 6 N + attention, as picotron's get_mfu counts), mfu (that over the
    device's peak when known, else null), plan_id, ranks (used), and, when measured: compute_ms (per rank, the
    straggler monitor's layer time of the step), slowdowns (per rank), packing ({microbatches, predicted_s}).

An evaluation record (``"kind": "eval"``, ``--eval-iters``): split (``valid`` or ``test``), iteration, final
(the evaluation after the last step), loss (per-token mean over every token of the evaluation), ppl, eval_iters,
samples, tokens, seconds; :func:`format_eval_lines` prints it as Megatron-LM's validation block.

An event record (``"kind": "event"``, ``"event"``: detection, replan, migration, checkpoint_save,
checkpoint_load, ...) carries the iteration and the event's own fields (bytes, seconds, blocking seconds, ...).

Pure: no torch.distributed, no host framework (TensorBoard and wandb are imported only when asked for).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "A800": 312.0, "H800": 989.0, "L40S": 362.0,
               "V100": 125.0}
"""Dense bf16 peak TFLOP/s by device name fragment (tensor cores; the datasheets' figures without sparsity)."""


def peak_tflops(device_name: str | None) -> float | None:
    """The device's dense bf16 peak, or None when unknown (a CPU)."""
    for fragment, peak in PEAK_TFLOPS.items():
        if device_name and fragment in device_name:
            return peak
    return None


class MetricsWriter:
    """Appends records to ``path`` (JSONL, flushed per record) and mirrors step scalars to TensorBoard / W&B.

    Only the rank that logs (the plan's lowest used rank) should own one; others use ``None``."""

    def __init__(self, path: str | Path | None, *, tensorboard_dir: str | None = None,
                 wandb_project: str | None = None, config: dict[str, Any] | None = None) -> None:
        self.path = Path(path) if path else None
        self._file = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        self._tb = None
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:  # tensorboard is an optional extra
                raise ValueError(f"--tensorboard-dir {tensorboard_dir}: the tensorboard package is not installed; "
                                 "pip install 'hetu_ext[metrics]' (or tensorboard)") from exc
            self._tb = SummaryWriter(log_dir=tensorboard_dir)
        self._wandb = None
        if wandb_project:
            try:
                import wandb
            except ImportError as exc:
                raise ValueError(f"--wandb-project {wandb_project}: the wandb package is not installed; pip install "
                                 "wandb") from exc
            self._wandb = wandb.init(project=wandb_project, config=config or {})

    def write(self, record: dict[str, Any]) -> dict[str, Any]:
        record = {"time": round(time.time(), 3), **record}
        if self._file is not None:
            self._file.write(json.dumps(record, sort_keys=False) + "\n")
            self._file.flush()
        if record.get("kind") == "step":
            scalars = {k: v for k, v in record.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("time", "iteration")}
            if self._tb is not None:
                for key, value in scalars.items():
                    self._tb.add_scalar(f"train/{key}", value, record["iteration"])
                self._tb.flush()
            if self._wandb is not None:
                self._wandb.log(scalars, step=record["iteration"])
        elif record.get("kind") == "eval":  # Megatron-LM's scalar names: "lm loss validation" (or "... test")
            scalars = {f"lm loss {_SPLIT_NAMES[record['split']]}": record["loss"]}
            if self._tb is not None:
                for key, value in scalars.items():
                    self._tb.add_scalar(key, value, record["iteration"])
                self._tb.flush()
            if self._wandb is not None:
                self._wandb.log(scalars, step=record["iteration"])
        return record

    def step(self, **fields: Any) -> dict[str, Any]:
        return self.write({"kind": "step", **fields})

    def evaluation(self, **fields: Any) -> dict[str, Any]:
        return self.write({"kind": "eval", **fields})

    def event(self, event: str, **fields: Any) -> dict[str, Any]:
        return self.write({"kind": "event", "event": event, **fields})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def read_records(path: str | Path, kind: str | None = None, event: str | None = None) -> list[dict[str, Any]]:
    """The records of a metrics file (``kind``: "step", "eval" or "event"; ``event``: one event's records)."""
    return [r for r in _lines(path) if (kind is None or r.get("kind") == kind)
            and (event is None or r.get("event") == event)]


def _lines(path: str | Path) -> Iterator[dict[str, Any]]:
    with Path(path).open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def format_log_line(record: dict[str, Any]) -> str:
    """A step record as Megatron-LM's log line."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.get("time", time.time())))
    norm = f" grad norm: {record['grad_norm']:.3f} |" if record.get("grad_norm") is not None else ""
    # --fp16: Megatron-LM's loss scale (before the grad norm) and skipped iterations of the interval (after it)
    scale = f" loss scale: {record['loss_scale']:.1f} |" if record.get("loss_scale") is not None else ""
    skipped = f" number of skipped iterations: {record['skipped_iterations']:3d} |" \
        if record.get("skipped_iterations") is not None else ""
    return (f" [{stamp}] iteration {record['iteration']:8d}/{record['train_iters']:8d} | consumed samples: "
            f"{record['consumed_samples']:12d} | elapsed time per iteration (ms): {record['step_ms']:.1f} | "
            f"learning rate: {record['lr']:.6E} | global batch size: {record['samples']:5d} | lm loss: "
            f"{record['loss']:.6E} |{scale}{norm}{skipped} tokens/s: {record['tokens_per_s']:.0f} |")


_SPLIT_NAMES = {"valid": "validation", "test": "test"}


def perplexity(loss: float) -> float:
    """Megatron-LM's reported perplexity: exp of the mean token loss, capped at exp(20)."""
    return math.exp(min(20.0, loss))


def format_eval_lines(record: dict[str, Any]) -> list[str]:
    """An evaluation record as Megatron-LM's block (``evaluate_and_print_results``): the line between two lines
    of dashes one longer than it; the evaluation after the last step says on which split it ran, as
    Megatron-LM's ``pretrain`` does (its test-set line also starts with "validation")."""
    prefix = f"iteration {record['iteration']}"
    if record.get("final"):
        prefix += f" on {_SPLIT_NAMES[record['split']]} set"
    line = f" validation loss at {prefix} | lm loss value: {record['loss']:.6E} | lm loss PPL: {record['ppl']:.6E} | "
    dashes = "-" * (len(line) + 1)
    return [dashes, line, dashes]

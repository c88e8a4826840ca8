"""Evaluation: Megatron-LM's ``--eval-iters N --eval-interval M`` in hetu_ext's trainer.

Every M steps, and once more after the last step, the plan runs N global batches (``--global-batch-size``
samples each, split over the pipelines as training batches are) of the validation split forward only, and logs
the per-token mean loss of all of them: the sum of every token's loss over the sum of tokens, added over every
pipeline's last stage in float64. It is therefore the same number under any plan (uniform TP x PP x DP or
heterogeneous), up to the order of floating-point sums. After the last step the test split (when ``--split``
gives it documents) is evaluated too, as Megatron-LM's ``pretrain`` does.

Which samples (Megatron-LM's ``consumed_valid_samples``, derived instead of stored): evaluation k (0-based) reads
validation global batches ``[k N, (k + 1) N)``; the one after step ``i`` (``i % M == 0``) is k = i / M - 1 and
the final one k = ``train_iters // M``, so a resumed run evaluates the same samples as an uninterrupted one and
the split needs ``(train_iters // M + 1) N`` global batches. The test split is read from its start, and so is
the validation split under ``--skip-train`` (no training: one evaluation at the step of ``--load``, as
Megatron-LM's). An early exit (--exit-duration-in-mins) skips the final evaluation, as Megatron-LM's exit does.

What evaluation leaves alone: gradients (``torch.no_grad``, forward-only schedule, no optimizer or scheduler
step), the training data position (a separate dataset and iterator), the RNG streams (torch's, CUDA's and
Megatron's tracker: saved and restored; in eval mode nothing draws from them anyway), the model's mode (eval
mode, dropout off, during it; train mode after), the layer timer's accumulations (the straggler monitor and
--hetu-emulate-* see training passes only). Training losses with and without evaluation are bit-identical
(tests/test_evaluation.py).

Not built, refused by name: packed documents (--hetu-packing, --hetu-hotspa, --hetu-strategies: their data is a
corpus of documents, not Megatron's splits) and LoRA tenants (--hetu-lora-tenants).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hetu_ext.config import RunConfig, TrainingConfig
from hetu_ext.megatron.context_parallel import cp_batches
from hetu_ext.megatron.data import microbatch_iterator
from hetu_ext.metrics import format_eval_lines, perplexity
from hetu_ext.plan.core.batches import global_batch_size
from hetu_ext.train.step import forward_step


def check_evaluation(config: RunConfig) -> None:
    """Refuse settings evaluation cannot honour (pure; before any process group)."""
    training = config.training
    if training.eval_iters < 0:
        raise ValueError(f"--eval-iters must be >= 0 (0: no evaluation), got {training.eval_iters}")
    if training.eval_interval is not None and training.eval_interval < 1:
        raise ValueError(f"--eval-interval must be >= 1 step, got {training.eval_interval}; leave it out to "
                         "evaluate only after the last step")
    if training.skip_train and not training.eval_iters:
        raise ValueError("--skip-train only evaluates: give --eval-iters N (Megatron-LM's default 100 is 0 here)")
    if not training.eval_iters:
        return
    packing = config.packing
    if packing.method != "off" or packing.hotspa or packing.strategies:
        flag = "--hetu-hotspa" if packing.hotspa else "--hetu-strategies" if packing.strategies else \
            f"--hetu-packing {packing.method}"
        raise ValueError(f"--eval-iters {training.eval_iters}: evaluation is built on Megatron's validation split "
                         f"of fixed-length samples, not for {flag} (packed documents); drop --eval-iters or the "
                         "packing")
    if config.lora.tenants:
        raise ValueError(f"--eval-iters {training.eval_iters}: evaluation is not built for --hetu-lora-tenants "
                         "(per-tenant losses); drop --eval-iters")


def eval_samples(training: TrainingConfig, global_batch: int) -> tuple[int, int]:
    """Samples the validation and test splits must hold (Megatron-LM's ``get_train_valid_test_num_samples``)."""
    if not training.eval_iters:
        return 0, 0
    evaluations = training.train_iters // training.eval_interval + 1 \
        if training.eval_interval and not training.skip_train else 1
    return evaluations * training.eval_iters * global_batch, training.eval_iters * global_batch


@dataclass
class Evaluation:
    """The validation (and test) datasets and when to read them; :meth:`after_step` and :meth:`at_end` are called
    by the training loop on the plan's used ranks (collective over them)."""

    valid: object
    test: object | None
    eval_iters: int
    eval_interval: int | None
    skip_train: bool = False
    """--skip-train: the one evaluation reads the validation split from its start."""

    @classmethod
    def of(cls, training: TrainingConfig, split: str, valid, test) -> Evaluation | None:
        """None when --eval-iters is 0; a ValueError when the split gives validation no documents."""
        if not training.eval_iters:
            return None
        if valid is None or len(valid) == 0:
            raise ValueError(f"--eval-iters {training.eval_iters} evaluates on the validation split, but --split "
                             f"{split} gives it no documents; give it a share (e.g. --split 98,2,0) or drop "
                             "--eval-iters")
        return cls(valid=valid, test=test if test is not None and len(test) else None,
                   eval_iters=training.eval_iters, eval_interval=training.eval_interval,
                   skip_train=training.skip_train)

    def after_step(self, trainer, log, watchdog=None) -> bool:
        """Evaluate on the validation split if the step just done is a multiple of --eval-interval; whether it
        did."""
        if not self.eval_interval or trainer.iteration % self.eval_interval:
            return False
        if watchdog is not None:
            watchdog.pause()  # evaluating is no step
        self.run(trainer, "valid", self.eval_iters * (trainer.iteration // self.eval_interval - 1), log)
        if watchdog is not None:
            watchdog.beat(trainer.iteration)
        return True

    def at_end(self, trainer, log) -> None:
        """After the last step: the validation split (the batches after the periodic evaluations'), then the
        test split from its start."""
        done = trainer.iteration // self.eval_interval if self.eval_interval and not self.skip_train else 0
        self.run(trainer, "valid", self.eval_iters * done, log, final=True)
        if self.test is not None:
            self.run(trainer, "test", 0, log, final=True)

    def run(self, trainer, split: str, first_batch: int, log, *, final: bool = False) -> float:
        """Global batches ``[first_batch, first_batch + eval_iters)`` of ``split``, forward only; logs the block
        and writes the record on the logging rank; returns the per-token mean loss (on every used rank)."""
        placement, training = trainer.placement, trainer.config.training
        start = time.perf_counter()
        batches = microbatch_iterator(self.valid if split == "valid" else self.test, trainer.plan,
                                      placement.pipeline_index, training.micro_batch_size,
                                      start_iteration=first_batch, num_iterations=self.eval_iters,
                                      device=trainer.host.device)
        # (loss, tokens) over this rank's microbatches, on the device: NCCL reduces no CPU tensor
        sums = torch.zeros(2, dtype=torch.float64, device=trainer.host.device)
        with _evaluating(placement.model, trainer.timer), torch.no_grad():
            for _ in range(self.eval_iters):
                reports = placement.forward_backward(
                    forward_step_func=forward_step, data_iterator=cp_batches(batches, placement),
                    model=[placement.model],
                    num_microbatches=trainer.plan.pipelines[placement.pipeline_index].num_microbatches,
                    seq_length=trainer.spec.seq_length, micro_batch_size=training.micro_batch_size,
                    forward_only=True, **placement.schedule_kwargs)
                if placement.is_last_stage and placement.tp_rank == 0:  # one copy of each pipeline's sums
                    for report in reports:
                        sums += report["lm loss"].double().to(sums.device)
        dist.all_reduce(sums, group=placement.report_group)
        sums = sums.cpu()
        loss = float(sums[0] / sums[1])
        if trainer.host.rank == trainer.log_rank:
            samples = self.eval_iters * global_batch_size(trainer.plan, training.micro_batch_size)
            record = {"split": split, "iteration": trainer.iteration, "final": final, "loss": loss,
                      "ppl": perplexity(loss), "eval_iters": self.eval_iters, "samples": samples,
                      "tokens": int(sums[1]), "seconds": time.perf_counter() - start}
            if trainer.metrics is not None:
                record = trainer.metrics.evaluation(**record)
            for line in format_eval_lines(record):
                log(line)
        return loss


@contextmanager
def _evaluating(model: torch.nn.Module, timer):
    """Eval mode and untouched RNG streams and layer-timer accumulations inside; train mode after."""
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    rng = torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None, \
        {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in tracker.get_states().items()}
    kept = (timer.take(), timer.take_work(), timer.take_overruns()) if timer is not None else None
    model.eval()
    try:
        yield
    finally:
        model.train()
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state_all(rng[1])
        tracker.set_states(rng[2])
        if timer is not None:  # the evaluation's passes are dropped, the training's kept
            timer.take(), timer.take_work(), timer.take_overruns()
            timer.seconds += kept[0]
            timer.work += kept[1]
            timer.overruns += kept[2]

"""Variable-length documents fed to Megatron-core as THD packs (``--hetu-packing``).

Each step every rank computes, from the same inputs, the same assignment of the global batch's sequences to the
plan's pipelines and their microbatches (hetu_ext.data.packing, pure and deterministic), then builds its own
pipeline's packs: ``tokens``/``labels``/``position_ids``/``loss_mask`` of shape ``(1, t)`` (``t`` = the pack's
tokens) and a ``PackedSeqParams`` with the documents' ``cu_seqlens``. The assignment of step g + 1 is computed in
a background thread while step g trains, so planning never stalls a step.

Methods (``--hetu-packing``):

- ``unpacked``: one sequence per microbatch, no pack (ordinary ``(1, s)`` causal input): the reference.
- ``concat``: Megatron-style: the batch's sequences concatenated and cut every ``--seq-length`` tokens, the
  pieces of a cut sequence attending to themselves only; packs dealt to pipelines in equal contiguous runs.
- ``concat-causal``: Megatron-LM's default (GPTDataset without ``--reset-attention-mask``): the same packs, causal
  attention over the whole pack (a document sees the ones before it), positions running through the pack.
- ``ffd`` / ``greedy`` / ``balanced``: first-fit-decreasing by tokens, DeepSpeed-style greedy by tokens, and
  Hydraulis's two-stage length-aware assignment (``hetu`` in hetu_ext.data.packing).

Every method except the two ``concat`` ones trains on exactly the (input, label) pairs and attention of the
reference, so with the per-token loss the gradient is the reference's up to summation order
(tests/test_packed_training.py).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hetu_ext.config import DataConfig, PackingConfig
from hetu_ext.data.cost import CostTable, load_cost_table
from hetu_ext.data.lengths import concat_split, parse_length_spec
from hetu_ext.data.packing import Assignment, ReplicaSpec, assign
from hetu_ext.plan.core.replicas import replica_specs
from hetu_ext.data.sequences import GlobalBatches, SequenceTable
from hetu_ext.plan import ModelSpec, Plan

logger = logging.getLogger(__name__)

_ASSIGN_METHOD = {"ffd": "ffd", "greedy": "greedy", "balanced": "hetu"}

Segment = tuple[int, int, int]
"""(sequence id, first position within the sequence, positions): a whole sequence, or a piece of one (concat)."""


class IndexedDocuments:
    """Documents of a Megatron indexed dataset (``PREFIX.bin/.idx``); boundaries from the .idx."""

    def __init__(self, prefix: str) -> None:
        from megatron.core.datasets.indexed_dataset import IndexedDataset, get_bin_path, get_idx_path

        for path in (get_idx_path(prefix), get_bin_path(prefix)):
            if not Path(path).is_file():
                raise ValueError(f"--data-path {prefix}: {path} does not exist; make it with python -m "
                                        "hetu_ext.megatron.preprocess_data and give the prefix it prints "
                                        "(OUTPUT_PREFIX_text_document)")
        self._data = IndexedDataset(prefix, mmap=True)
        bounds = np.asarray(self._data.document_indices, dtype=np.int64)  # (D+1,) sequence index bounds
        lengths = np.concatenate([[0], np.cumsum(np.asarray(self._data.sequence_lengths, dtype=np.int64))])
        self._start = lengths[bounds[:-1]]
        self.token_counts = lengths[bounds[1:]] - self._start
        if not (self.token_counts >= 2).any():
            raise ValueError(f"--data-path {prefix}: the dataset is empty: none of its {self.token_counts.size} "
                             f"documents ({int(self.token_counts.sum())} tokens) has the 2 tokens a training "
                             "position needs; preprocess a jsonl with text")
        self._bounds = bounds

    def tokens(self, doc: int, start: int, count: int) -> np.ndarray:
        """``count`` tokens of document ``doc`` from ``start``."""
        first, last = int(self._bounds[doc]), int(self._bounds[doc + 1])
        whole = np.concatenate([self._data[i] for i in range(first, last)]) if last - first > 1 else self._data[first]
        return np.asarray(whole[start:start + count], dtype=np.int64)


class SyntheticDocuments:
    """Documents of given token counts with seeded random tokens (``--mock-data`` with a varlen config)."""

    def __init__(self, token_counts: np.ndarray, vocab_size: int, seed: int) -> None:
        self.token_counts = np.asarray(token_counts, dtype=np.int64)
        self._vocab, self._seed = vocab_size, seed

    def tokens(self, doc: int, start: int, count: int) -> np.ndarray:
        rng = np.random.default_rng([self._seed, doc])
        return rng.integers(0, self._vocab - 1, int(self.token_counts[doc]))[start:start + count]


def varlen_mock_documents(config_json: str, *, vocab_size: int, seed: int, count: int) -> SyntheticDocuments:
    """Megatron's varlen mock-data forms: ``{"mode": "file", "path": ...}`` or ``{"mode": "distribution",
    "type": "lognormal", ...}`` (hetu_ext.data.lengths): ``count`` documents (at most the file's) of those
    training lengths, i.e. lengths + 1 tokens."""
    lengths = parse_length_spec(config_json).sample(count, seed)
    return SyntheticDocuments(np.asarray(lengths, dtype=np.int64) + 1, vocab_size, seed)


@dataclass
class StepData:
    """One step's microbatches for this rank's pipeline."""

    microbatches: list[dict]
    sequences: int
    """Sequences in the whole global batch (all pipelines)."""
    tokens: int
    """Training tokens in the whole global batch."""
    predicted_s: tuple[float, ...] = ()
    """Predicted time of each pipeline (the packer's cost model)."""
    shapes: list[tuple[int, int]] | None = None
    """This pipeline's microbatches as (tokens, sum of squared document lengths): their work."""


class PackedSteps:
    """Step ``g`` -> this pipeline's packed microbatches (deterministic on every rank)."""

    def __init__(self, documents, table: SequenceTable, batches: GlobalBatches, *, method: str,
                 replicas: list[ReplicaSpec], pipeline: int, max_len: int, device: torch.device) -> None:
        self.documents, self.table, self.batches = documents, table, batches
        self.method, self.replicas, self.pipeline = method, replicas, pipeline
        self.max_len, self.device = max_len, device
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hetu-packing")
        self._ahead: dict[int, Future] = {}
        self._lock = threading.Lock()  # GlobalBatches extends its caches lazily; the planning thread reads it too

    def consumed(self, g: int) -> int:
        """Sequences in steps ``0..g-1`` (Megatron-LM's "consumed samples")."""
        with self._lock:
            return self.batches.consumed(g)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def plan_step(self, g: int) -> tuple[np.ndarray, list[list[list[Segment]]], tuple[float, ...]]:
        """Step ``g``'s sequence ids and every pipeline's microbatches as segments, with their predicted times."""
        with self._lock:
            ids = self.batches[g]
        return self.plan_sequences(ids)

    def plan_sequences(self, ids: np.ndarray, packed: Assignment | None = None
                       ) -> tuple[np.ndarray, list[list[list[Segment]]], tuple[float, ...]]:
        """These sequences' assignment to the pipelines' microbatches (segments), with predicted times.
        ``packed`` (Hydraulis, issue 15): the two-stage packer's result for exactly these lengths and replicas,
        already made (the candidate selection's), used instead of packing again where the method is that packer."""
        lengths = self.table.length[ids]
        if self.method == "unpacked":
            runs = np.array_split(np.arange(ids.size), len(self.replicas))
            per = [[[(int(ids[i]), 0, int(lengths[i]))] for i in run] for run in runs]
            return ids, per, ()
        if self.method in ("concat", "concat-causal"):
            pieces = _concat_cut(ids, lengths, self.max_len)
            piece_lengths = [p[2] for p in pieces]
            out = assign(piece_lengths, self.replicas, method="megatron")
            return ids, [[[pieces[i] for i in mb] for mb in rep] for rep in out.microbatches], out.predicted_s
        method = _ASSIGN_METHOD[self.method]
        out = packed if packed is not None and method == "hetu" else \
            assign(lengths.tolist(), self.replicas, method=method)  # Hydraulis (issue 15): packed
        per = [[[(int(ids[i]), 0, int(lengths[i])) for i in mb] for mb in rep] for rep in out.microbatches]
        return ids, per, out.predicted_s

    def step(self, g: int) -> StepData:
        """Step ``g``'s data for this pipeline; starts planning step ``g + 1`` in the background."""
        future = self._ahead.pop(g, None)
        ids, per, predicted = future.result() if future is not None else self.plan_step(g)
        self._ahead = {g + 1: self._pool.submit(self.plan_step, g + 1)}
        return self.step_data(g, ids, per, predicted)

    def step_data(self, g: int, ids: np.ndarray, per: list[list[list[Segment]]], predicted: tuple[float, ...]
                  ) -> StepData:
        """This pipeline's collated microbatches of an assignment (``plan_sequences``) of step ``g``."""
        if sum(len(mb) for rep in per for mb in rep) < len(per):
            raise ValueError(f"step {g + 1}: the global batch has too few sequences ({ids.size}) to give each of "
                             f"the plan's {len(per)} pipelines a microbatch; raise --global-batch-size or "
                             "--hetu-global-batch-tokens")
        mine = _fill_empty(per)[self.pipeline]
        if self.method == "balanced" and self.replicas[self.pipeline].pp > 1:
            mine = _fill_drain_order(mine, self.replicas[self.pipeline])
        return StepData(microbatches=[self._collate(mb) for mb in mine], sequences=int(ids.size),
                        tokens=int(self.table.length[ids].sum()), predicted_s=predicted,
                        shapes=[(sum(n for *_, n in mb), sum(n * n for *_, n in mb)) for mb in mine])

    def _collate(self, segments: list[Segment]) -> dict:
        tokens, labels, positions, lengths = [], [], [], []
        causal_pack = self.method == "concat-causal"
        for seq, offset, count in segments:
            doc = int(self.table.doc[seq])
            first = int(self.table.start[seq]) + offset
            ids = self.documents.tokens(doc, first, count + 1)  # inputs and the label of the last one
            tokens.append(ids[:-1])
            labels.append(ids[1:])
            positions.append(np.arange(count))
            lengths.append(count)
        if causal_pack:  # one attention span: the whole pack, positions through it
            lengths, positions = [sum(lengths)], [np.arange(sum(lengths))]
        batch = {key: torch.from_numpy(np.concatenate(parts)).long()[None].to(self.device)
                 for key, parts in (("tokens", tokens), ("labels", labels), ("position_ids", positions))}
        batch["loss_mask"] = torch.ones_like(batch["tokens"], dtype=torch.float32)
        if self.method != "unpacked":
            from megatron.core.packed_seq_params import PackedSeqParams

            cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32, device=self.device)
            batch["packed_seq_params"] = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                         max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
        return batch


def _fill_drain_order(microbatches: list[list[Segment]], replica: ReplicaSpec) -> list[list[Segment]]:
    """Most expensive microbatch first, cheapest last, for 1F1B: in the steady state a stage runs the backward of
    microbatch k while the stage before it runs the forward of k + 1, so decreasing costs never make a stage wait
    for its predecessor, and the drain (the last microbatch's backward down the pipeline) is the cheapest."""
    def seconds(mb: list[Segment]) -> float:
        return replica.microbatch_s(sum(n * n for *_, n in mb), sum(n for *_, n in mb))

    return sorted(microbatches, key=seconds, reverse=True)


def _fill_empty(per: list[list[list[Segment]]]) -> list[list[list[Segment]]]:
    """Every pipeline must run a microbatch (its schedule and gradient sync take part in the step): a pipeline the
    packer left empty (documents fewer than pipelines, or one pipeline far slower) gets the shortest segment of
    the pipeline holding the most. Deterministic, so every rank agrees."""
    for empty in [r for r, rep in enumerate(per) if not rep]:
        donor = max(range(len(per)), key=lambda r: (sum(len(mb) for mb in per[r]), -r))
        m, k = min(((m, k) for m, mb in enumerate(per[donor]) for k in range(len(mb))),
                   key=lambda mk: (per[donor][mk[0]][mk[1]][2], mk))
        segment = per[donor][m].pop(k)
        if not per[donor][m]:
            per[donor].pop(m)
        per[empty].append([segment])
    return per


def _concat_cut(ids: np.ndarray, lengths: np.ndarray, max_len: int) -> list[Segment]:
    """Megatron's packing of one global batch: its sequences end to end, cut every ``max_len`` tokens."""
    pieces = concat_split(lengths, max_len)
    return [(int(ids[d]), int(o), int(n)) for d, o, n in zip(pieces.doc, pieces.offset, pieces.length)]


def open_documents(data: DataConfig, packing: PackingConfig, tokenizer, *, seed: int):
    """The corpus for ``--hetu-packing``: the indexed dataset of ``--data-path``, or ``--hetu-varlen-mock``."""
    if data.data_path:
        return IndexedDocuments(data.data_path[0])
    return varlen_mock_documents(packing.varlen_mock, vocab_size=tokenizer.vocab_size, seed=seed,
                                 count=packing.mock_documents)


def build_packed_steps(packing: PackingConfig, spec: ModelSpec, plan: Plan, pipeline: int, documents,
                       device: torch.device, *, seed: int, global_batch_size: int | None,
                       slowdowns: dict[int, float] | None = None, max_pack_tokens: int | None = None
                       ) -> PackedSteps:
    """The packed data of ``plan``'s pipeline ``pipeline``: packs of at most ``spec.seq_length`` tokens, global
    batches of ``packing.global_batch_tokens`` tokens or else ``global_batch_size`` sequences; ``slowdowns``
    (rank -> x, from the straggler monitor) make slow pipelines' shares smaller; ``max_pack_tokens``: packs
    of at most this many tokens instead (HotSPa: a strategy's ``max_len``); ``pipeline`` None: this rank runs
    none of the plan's pipelines (it still plans, so every rank agrees)."""
    cost = load_cost_table(packing.cost_model) if packing.cost_model else CostTable()
    table = SequenceTable.from_documents(documents.token_counts, spec.seq_length)
    batches = GlobalBatches(table, seed=seed, tokens=packing.global_batch_tokens,
                            samples=None if packing.global_batch_tokens else global_batch_size)
    max_len = max_pack_tokens or spec.seq_length
    replicas = replica_specs(plan, spec, cost, slowdowns=slowdowns, max_pack_tokens=max_len)
    steps = PackedSteps(documents, table, batches, method=packing.method, replicas=replicas, pipeline=pipeline,
                        max_len=max_len, device=device)
    steps.cost = cost
    return steps

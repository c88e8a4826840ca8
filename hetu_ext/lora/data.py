"""Tenants' data in one packed global batch: every tenant's sequences of a step, packed together across the plan's
pipelines by the existing two-stage assignment (hetu_ext.data.packing), each token tagged with its tenant.

Each tenant draws its step's sequences from its own documents with its own random stream (seeded by the run's
seed and the tenant's name), so what a tenant trains on does not depend on which other tenants share the run:
the same tenant trained alone reads the same sequences in the same steps (the gold test's reference).
"""

from __future__ import annotations

import numpy as np
import torch

from hetu_ext.config.tenants import TenantSpec
from hetu_ext.data.cost import CostTable, load_cost_table
from hetu_ext.data.lengths import budget_end
from hetu_ext.data.sequences import SequenceTable
from hetu_ext.megatron.packed_data import IndexedDocuments, PackedSteps, varlen_mock_documents
from hetu_ext.plan import ModelSpec, Plan
from hetu_ext.plan.core.replicas import replica_specs


class TenantStream:
    """One tenant's step ``g`` -> its sequence ids (local to its table), by its per-step quota."""

    def __init__(self, table: SequenceTable, tenant: TenantSpec, seed: int) -> None:
        if len(table) == 0:
            raise ValueError(f"tenant {tenant.name!r}: its data has no training sequence (every document has "
                             "fewer than 2 tokens); give it documents of 2 or more tokens")
        self.table, self.tenant, self.seed = table, tenant, seed
        self._order = np.zeros(0, dtype=np.int64)
        self._cum = np.zeros(1, dtype=np.int64)
        self._bounds = [0]

    def _ensure(self, size: int) -> None:
        while self._order.size < size:
            epoch = self._order.size // len(self.table)
            order = np.random.default_rng([self.seed, self.tenant.seed_offset, epoch]).permutation(len(self.table))
            self._order = np.concatenate([self._order, order])
            self._cum = np.concatenate([self._cum, self._cum[-1] + np.cumsum(self.table.length[order])])

    def _next_end(self, g: int, begin: int) -> int:
        kind, count = self.tenant.quota(g)
        if count == 0:
            return begin
        if kind == "samples":
            self._ensure(begin + count)
            return begin + count
        while True:
            self._ensure(begin + 1)
            end = budget_end(self._cum, begin, count)
            if end < self._order.size:
                return end
            self._ensure(self._order.size + 1)

    def __getitem__(self, g: int) -> np.ndarray:
        while len(self._bounds) <= g + 1:
            self._bounds.append(self._next_end(len(self._bounds) - 1, self._bounds[-1]))
        return self._order[self._bounds[g]:self._bounds[g + 1]]


class TenantCorpus:
    """All tenants' documents in one index space (``tokens``/``token_counts`` as the packer's documents)."""

    def __init__(self, tenants: tuple[TenantSpec, ...], *, vocab_size: int, seed: int) -> None:
        self.tenants = tenants
        self.parts = []
        for t in tenants:
            if t.data_path is not None:
                self.parts.append(IndexedDocuments(t.data_path))
            else:
                import json

                self.parts.append(varlen_mock_documents(json.dumps(t.lengths), vocab_size=vocab_size,
                                                        seed=seed * 1_000_003 + t.seed_offset, count=t.documents))
        counts = [np.asarray(p.token_counts, dtype=np.int64) for p in self.parts]
        self.doc_offset = np.concatenate([[0], np.cumsum([c.size for c in counts])]).astype(np.int64)
        self.token_counts = np.concatenate(counts)
        self.tenant_of_doc = np.concatenate([np.full(c.size, k, dtype=np.int64) for k, c in enumerate(counts)])

    def tokens(self, doc: int, start: int, count: int) -> np.ndarray:
        k = int(self.tenant_of_doc[doc])
        return self.parts[k].tokens(doc - int(self.doc_offset[k]), start, count)


class TenantBatches:
    """Global batch ``g`` -> the sequence ids (into the corpus-wide table) of every tenant's step ``g``."""

    def __init__(self, corpus: TenantCorpus, max_len: int, seed: int) -> None:
        self.corpus = corpus
        tables, self.seq_offset = [], [0]
        self.streams = []
        for k, tenant in enumerate(corpus.tenants):
            lo, hi = corpus.doc_offset[k], corpus.doc_offset[k + 1]
            table = SequenceTable.from_documents(corpus.token_counts[lo:hi], max_len)
            self.streams.append(TenantStream(table, tenant, seed))
            tables.append(table)
            self.seq_offset.append(self.seq_offset[-1] + len(table))
        self.table = SequenceTable(doc=np.concatenate([t.doc + corpus.doc_offset[k] for k, t in enumerate(tables)]),
                                   start=np.concatenate([t.start for t in tables]),
                                   length=np.concatenate([t.length for t in tables]))
        self.tenant_of_seq = corpus.tenant_of_doc[self.table.doc]

    def __getitem__(self, g: int) -> np.ndarray:
        return np.concatenate([s[g] + self.seq_offset[k] for k, s in enumerate(self.streams)]).astype(np.int64)

    def consumed(self, g: int) -> int:
        return sum(int(self[i].size) for i in range(g))

    def tenant_tokens(self, g: int) -> np.ndarray:
        """Training tokens of each tenant in global batch ``g`` (tenants' order)."""
        ids = self[g]
        return np.bincount(self.tenant_of_seq[ids], weights=self.table.length[ids],
                           minlength=len(self.streams)).astype(np.int64)


class TenantPackedSteps(PackedSteps):
    """PackedSteps whose microbatches also carry ``tenant_ids`` ``(1, t)``: each token's tenant index."""

    def _collate(self, segments):
        batch = super()._collate(segments)
        ids = [np.full(count, self.batches.tenant_of_seq[seq], dtype=np.int64) for seq, _, count in segments]
        batch["tenant_ids"] = torch.from_numpy(np.concatenate(ids))[None].to(self.device)
        return batch


def build_tenant_steps(tenants: tuple[TenantSpec, ...], *, method: str, cost_model: str | None, spec: ModelSpec,
                       plan: Plan, pipeline: int | None, device: torch.device, seed: int, vocab_size: int,
                       corpus: TenantCorpus | None = None, max_pack_tokens: int | None = None) -> TenantPackedSteps:
    """Every tenant's data packed for ``plan``'s pipeline ``pipeline`` (packs of at most ``spec.seq_length``, or
    ``max_pack_tokens``: a HotSPa strategy's ``max_len``; ``pipeline`` None: this rank runs none of the plan's
    pipelines but plans, so every rank agrees)."""
    corpus = corpus or TenantCorpus(tenants, vocab_size=vocab_size, seed=seed)
    batches = TenantBatches(corpus, spec.seq_length, seed)
    cost = load_cost_table(cost_model) if cost_model else CostTable()
    max_len = max_pack_tokens or spec.seq_length
    replicas = replica_specs(plan, spec, cost, max_pack_tokens=max_len)
    steps = TenantPackedSteps(corpus, batches.table, batches, method=method, replicas=replicas, pipeline=pipeline,
                              max_len=max_len, device=device)
    steps.cost = cost
    return steps

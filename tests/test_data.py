"""Offline tokenizer, jsonl preprocessing into Megatron's indexed dataset, and sample assignment."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import SAMPLE

from hetu_ext.plan.core.batches import microbatch_samples
from hetu_ext.data.tokenizer import ByteLevelTokenizer
from hetu_ext.plan import Pipeline, Plan, Stage, uniform_plan


def test_byte_tokenizer_round_trips_any_text():
    tok = ByteLevelTokenizer()
    text = "naïve café — 東京 🚀"
    ids = tok.tokenize(text)
    assert max(ids) < 256 and tok.detokenize(ids + [tok.eod]) == text


def test_preprocessed_sample_holds_every_document_exactly(sample_prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    docs = [json.loads(line)["text"] for line in SAMPLE.read_text().splitlines()]
    dataset = IndexedDataset(sample_prefix)
    assert len(dataset) == len(docs) == 79
    tok = ByteLevelTokenizer()
    for i in (0, 40, 78):
        ids = dataset[i]
        assert ids[-1] == tok.eod
        assert tok.detokenize(ids[:-1]) == docs[i]


def test_bad_jsonl_exits_2_and_writes_nothing(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text key"}\n')
    proc = subprocess.run([sys.executable, "-m", "hetu_ext.megatron.preprocess_data", "--input", str(bad),
                           "--output-prefix", str(tmp_path / "out")], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "bad.jsonl:2: each line must be a JSON object with a string 'text'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


@pytest.mark.parametrize("plan", [
    uniform_plan(world_size=4, tp=1, pp=2, num_layers=4, num_microbatches=3),
    Plan(pipelines=(Pipeline(stages=(Stage(ranks=(0,), layer_start=0, layer_stop=4, has_embedding=True,
                                           has_output=True),), num_microbatches=3),
                    Pipeline(stages=(Stage(ranks=(1,), layer_start=0, layer_stop=4, has_embedding=True,
                                           has_output=True),), num_microbatches=1))),
])
def test_every_sample_is_used_once_per_global_batch(plan):
    mbs = 2
    for iteration in range(3):
        ids = [i for p in range(len(plan.pipelines)) for mb in microbatch_samples(plan, p, iteration, mbs)
               for i in mb]
        gbs = mbs * plan.num_microbatches
        assert sorted(ids) == list(range(iteration * gbs, (iteration + 1) * gbs))
    assert np.all([len(mb) == mbs for mb in microbatch_samples(plan, 0, 0, mbs)])

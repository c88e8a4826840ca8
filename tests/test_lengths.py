"""Document lengths: length files and their errors, Megatron's mock-data JSON forms, splitting, global batches.

Pure tests (numpy only, no process group). Error tests check that the message names the file, the line number and
the offending text, since that is what a user needs to fix the input (Acceptance 5 of issue 5).
"""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from hetu_ext.data.lengths import (
    FileLengths,
    LengthFileError,
    LognormalLengths,
    batch_bounds,
    concat_split,
    global_batch,
    parse_length_spec,
    read_lengths,
    split_long,
)

LOGNORMAL = {"mode": "distribution", "type": "lognormal", "min_seq_len": 16, "max_seq_len": 8192,
             "mean_seq_len": 1024, "lognormal_sigma": 1.2}


def test_reads_text_and_gzip_alike(tmp_path):
    text = tmp_path / "l.txt"
    text.write_text("5\n17\n3\n")
    gz = tmp_path / "l.txt.gz"
    with gzip.open(gz, "wt") as f:
        f.write("5\n17\n3")  # no final newline
    assert read_lengths(text).tolist() == [5, 17, 3]
    assert read_lengths(gz).tolist() == [5, 17, 3]
    assert read_lengths(text).dtype == np.int64


def test_missing_file_names_it(tmp_path):
    path = tmp_path / "nope.txt"
    with pytest.raises(LengthFileError, match="nope.txt.*does not exist"):
        read_lengths(path)


def test_empty_file_names_it_and_the_fix(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text("")
    with pytest.raises(LengthFileError, match=r"empty\.txt.*is empty.*one token count"):
        read_lengths(path)


@pytest.mark.parametrize("content, line, text", [("12\n7\nabc\n4\n", 3, "abc"), ("1\n2.5\n", 2, "2.5"),
                                                 ("3\n0\n", 2, "0"), ("-4\n", 1, "-4"), ("3\n\n5\n", 2, "")])
def test_bad_line_names_file_line_and_text(tmp_path, content, line, text):
    path = tmp_path / "bad.txt"
    path.write_text(content)
    with pytest.raises(LengthFileError) as err:
        read_lengths(path)
    message = str(err.value)
    assert "bad.txt" in message and f"line {line}:" in message and repr(text) in message


def test_corrupt_gzip_is_a_clear_error(tmp_path):
    path = tmp_path / "broken.txt.gz"
    path.write_bytes(b"not gzip at all")
    with pytest.raises(LengthFileError, match="broken.txt.gz.*cannot be read"):
        read_lengths(path)


def test_json_file_form(tmp_path):
    path = tmp_path / "l.txt"
    path.write_text("9\n8\n7\n")
    spec = parse_length_spec(json.dumps({"mode": "file", "path": str(path)}))
    assert spec == FileLengths(path=str(path))
    assert spec.sample().tolist() == [9, 8, 7]
    assert spec.sample(2).tolist() == [9, 8]


def test_json_distribution_form_is_deterministic_and_bounded():
    spec = parse_length_spec(json.dumps(LOGNORMAL))
    assert isinstance(spec, LognormalLengths)
    a, b, c = spec.sample(20000, seed=1), spec.sample(20000, seed=1), spec.sample(20000, seed=2)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert a.min() >= 16 and a.max() <= 8192
    # untruncated mean 1024; clipping at 8192 removes ~3% of the mass's tail, so the sample mean is a bit lower
    assert 800 < a.mean() < 1100
    assert parse_length_spec(LOGNORMAL) == spec  # a dict works as well as a JSON string


@pytest.mark.parametrize("spec, match", [
    ({**LOGNORMAL, "seed": 3}, r"unknown key 'seed' in the length spec \(mode 'distribution'\); the keys are \['lognormal_sigma', 'max_seq_len'"),
    ({k: v for k, v in LOGNORMAL.items() if k != "lognormal_sigma"}, r"missing key\(s\) \['lognormal_sigma'\]"),
    ({"mode": "file", "path": "x", "type": "lognormal"}, r"unknown key 'type' in the length spec \(mode 'file'\); the keys are \['mode', 'path'\]"),
    ({"mode": "stream"}, "'mode' must be one of"),
    ({**LOGNORMAL, "type": "zipf"}, "'zipf' is not supported"),
    ({**LOGNORMAL, "min_seq_len": 9000}, r"max_seq_len \(8192\) < min_seq_len \(9000\)"),
    ({**LOGNORMAL, "lognormal_sigma": 0}, "lognormal_sigma must be > 0"),
    ("{not json", "not valid JSON"),
])
def test_json_errors_name_the_rule(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_length_spec(spec if isinstance(spec, str) else json.dumps(spec))


def test_split_long_pieces():
    lengths = np.array([5, 3, 9, 4, 1, 12])
    pieces = split_long(lengths, 4)
    assert pieces.length.tolist() == [4, 1, 3, 4, 4, 1, 4, 1, 4, 4, 4]
    assert pieces.doc.tolist() == [0, 0, 1, 2, 2, 2, 3, 4, 5, 5, 5]
    assert pieces.offset.tolist() == [0, 4, 0, 0, 4, 8, 0, 0, 0, 4, 8]
    rng = np.random.default_rng(0)
    big = rng.integers(1, 5000, 2000)
    p = split_long(big, 512)
    assert p.length.max() <= 512 and p.length.min() >= 1
    assert np.array_equal(np.bincount(p.doc, weights=p.length, minlength=big.size), big)  # tokens kept
    assert np.array_equal(np.bincount(p.doc, minlength=big.size), -(-big // 512))  # ceil(L / max) pieces
    with pytest.raises(ValueError, match="max_len must be an integer >= 1"):
        split_long(big, 0)


def test_concat_split_fills_packs_exactly():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 3000, 500)
    p = concat_split(lengths, 1024)
    ends = np.cumsum(p.length)
    assert np.all(np.isin(np.arange(1024, int(ends[-1]), 1024), ends))  # every cut is a piece boundary
    assert np.array_equal(np.bincount(p.doc, weights=p.length, minlength=lengths.size), lengths)
    # pieces of one document are consecutive and contiguous
    assert np.all(np.diff(p.doc) >= 0)
    same = p.doc[1:] == p.doc[:-1]
    assert np.array_equal(p.offset[1:][same], (p.offset + p.length)[:-1][same])


def _check_partition(bounds: np.ndarray, n: int) -> None:
    assert bounds[0] == 0 and bounds[-1] == n and np.all(np.diff(bounds) >= 1)


def test_token_batches_never_skip_or_repeat():
    rng = np.random.default_rng(2)
    lengths = rng.integers(1, 9000, 3000)
    budget = 32768
    bounds = batch_bounds(lengths, tokens=budget)
    _check_partition(bounds, lengths.size)
    for g in range(bounds.size - 1):
        batch = lengths[bounds[g]:bounds[g + 1]]
        assert batch.sum() <= budget or batch.size == 1  # within the budget, or one over-long document alone
        if bounds[g + 1] < lengths.size:
            assert batch.sum() + lengths[bounds[g + 1]] > budget  # the next document would not have fit
    assert global_batch(lengths, 3, tokens=budget) == range(int(bounds[3]), int(bounds[4]))
    assert np.array_equal(batch_bounds(lengths, tokens=budget), bounds)  # deterministic


def test_training_stream_batches_follow_the_same_budget_rule():
    """GlobalBatches (the trainer's endless, reshuffled stream) cuts its first epoch exactly where batch_bounds
    cuts the same sequences."""
    from hetu_ext.data.sequences import GlobalBatches, SequenceTable

    rng = np.random.default_rng(5)
    table = SequenceTable.from_documents(rng.integers(2, 9000, 400), 4096)
    batches = GlobalBatches(table, seed=3, tokens=20000)
    order = np.random.default_rng([3, 0]).permutation(len(table))
    bounds = batch_bounds(table.length[order], tokens=20000)
    for g in range(bounds.size - 2):  # the last batch of the epoch continues into the next one
        assert np.array_equal(batches[g], order[bounds[g]:bounds[g + 1]])


def test_over_budget_document_is_a_batch_alone():
    assert batch_bounds(np.array([3, 50, 2, 2]), tokens=10).tolist() == [0, 1, 2, 4]


def test_sample_batches_and_drop_last():
    lengths = np.arange(1, 11)
    assert batch_bounds(lengths, samples=4).tolist() == [0, 4, 8, 10]
    assert batch_bounds(lengths, samples=4, drop_last=True).tolist() == [0, 4, 8]
    assert batch_bounds(lengths, samples=5, drop_last=True).tolist() == [0, 5, 10]
    assert batch_bounds(np.array([4, 4, 4, 1]), tokens=8, drop_last=True).tolist() == [0, 2]
    with pytest.raises(IndexError, match="global batch 3 does not exist.*make 3 batches"):
        global_batch(lengths, 3, samples=4)
    with pytest.raises(ValueError, match="exactly one of tokens= and samples="):
        batch_bounds(lengths, tokens=4, samples=4)

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "hetu_ext" / "data" / "samples" / "python_reference.jsonl"

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


@pytest.fixture(scope="session")
def sample_prefix(tmp_path_factory) -> str:
    """The shipped text sample as a Megatron indexed dataset (.bin/.idx), made once per session."""
    from hetu_ext.megatron.preprocess_data import preprocess

    out = tmp_path_factory.mktemp("data") / "pyref"
    prefix, count = preprocess(str(SAMPLE), str(out), append_eod=True)
    assert count == 79
    return prefix

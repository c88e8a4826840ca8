"""``import hetu_ext`` (and its pure planners) must not import torch.distributed users or any host framework."""

import subprocess
import sys


def test_import_is_cheap():
    code = ("import sys, hetu_ext, hetu_ext.plan, hetu_ext.plan.core.batches, hetu_ext.data.tokenizer; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'deepspeed', 'diffusers', "
            "'torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

"""``python -m hetu_ext.plan show FILE``: print a plan as a table, after validating it.
``python -m hetu_ext.plan malleus ...``: plan around stragglers (Malleus) and write the plan as YAML.
``python -m hetu_ext.plan lobra ...``: replicas for many tenants' LoRA fine-tuning (LobRA), written as YAML.
``python -m hetu_ext.plan hydraulis ...``: candidate heterogeneous strategies chosen per step (Hydraulis).
``python -m hetu_ext.plan predict ...``: step time, TFLOP/s, MFU and memory per GPU of a run (or ``--table CSV``)."""

from __future__ import annotations

import sys

from hetu_ext.plan.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())

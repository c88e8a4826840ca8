"""Elastic rehearsal of a DeepSpeed job through the elastic launcher, with no manual restart: one command,
``launch/elastic.py --launcher deepspeed --nproc-per-node 4``, runs launch/pretrain_gpt_deepspeed.py on 4 ranks
(ZeRO-2, a DeepSpeed checkpoint at step 4); rank 3 kills itself (SIGKILL, as a lost GPU's process dies) at the start
of step 7; the survivors' collectives fail, the launcher counts that device lost, restarts the job on the 3 left
with ``--load`` of the ``--save`` directory (``global_step4``, the newest checkpoint), and the job trains to step 8
and exits 0.

What must hold, from one run (the first round, steps 1-6, is the uninterrupted run the recovery is compared with):

* no sample skipped or repeated: every step's sample ids, taking steps 1-4 from the first round and 5-8 from the
  second, are global batch g = samples [12(g - 1), 12g), the data contract at any world size (and the first round's
  steps 5-6 read the same ids as their retraining on 3 ranks);
* the state came back: the losses of steps 1-4 restored from the checkpoint equal the first round's bit for bit,
  and steps 5-6 retrained on 3 ranks equal the first round's within test_uniform_equivalence's tolerance (3 ranks
  sum the same gradients in another grouping; test_deepspeed_resume measured 1.4e-8 over 4 steps). Step 6 follows
  the first update after the load, so Adam's moments and step and the LR schedule are checked as well as the weights;
* the launcher did it: one failure event naming the lost device, rounds of 4 and 3 ranks, exit code 0;
* recovery (the kill to the first step completed on 3 ranks) under 60 s, the bound of the Megatron path's rehearsal
  (test_elastic_rehearsal); a survivor left waiting for its collective timeout (30 s here) would show there.

The kill and the records are put into the job's processes by a ``sitecustomize`` module on the job's PYTHONPATH
(``INJECT``); the launcher, its forkserver and every rank run unmodified code otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from test_deepspeed_resume import ds_argv
from helpers import LOSS_RTOL

from hetu_ext.cli.runs import recorded_samples

ROOT = Path(__file__).resolve().parents[1]
STEPS, SAVE_INTERVAL, GLOBAL_BATCH = 8, 4, 12
KILLED_RANK, KILLED_AT_STEP = 3, 7
RECOVERY_BOUND_S = 60.0

INJECT = f'''
"""Test-only (tests/test_deepspeed_elastic.py): once hetu_ext.deepspeed.engine is imported (in the elastic
launcher's forkserver, before the ranks fork from it), DeepSpeedGPT records each rank's samples and, per step, the
loss and the time, under $HETU_TEST_DS_ELASTIC_OUT; rank {KILLED_RANK} of a 4-rank world dies at the start of step
{KILLED_AT_STEP}."""
import importlib.abc
import importlib.util
import os
import sys

OUT = os.environ.get("HETU_TEST_DS_ELASTIC_OUT")


def _patch(engine):
    import json
    import signal
    import time
    from pathlib import Path

    from hetu_ext.cli.runs import SampleRecorder

    cls = engine.DeepSpeedGPT
    train, step = cls.train, cls._step

    def record(world, rank, **fields):
        with open(Path(OUT) / f"steps_{{world}}_{{rank}}.jsonl", "a") as f:
            f.write(json.dumps(fields) + "\\n")

    def recorded_train(self, *args, **kwargs):
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        self.dataset = SampleRecorder(self.dataset, self, Path(OUT) / f"ids_{{world}}_{{rank}}.txt")
        record(world, rank, start=self.iteration, losses=list(self.losses))
        return train(self, *args, **kwargs)

    def dying_step(self, *args, **kwargs):
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        if world == 4 and rank == {KILLED_RANK} and self.iteration + 1 == {KILLED_AT_STEP}:
            Path(OUT, "killed_at").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        total = step(self, *args, **kwargs)
        record(world, rank, iteration=self.iteration + 1, loss=float(total[0] / total[1]), time=time.time())
        return total

    cls.train, cls._step = recorded_train, dying_step


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "hetu_ext.deepspeed.engine":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if OUT:
    sys.meta_path.insert(0, _AfterImport())
'''


def _records(path: Path) -> tuple[dict, dict[int, dict]]:
    """(the train() start record, iteration -> step record) of one rank's steps file."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return lines[0], {r["iteration"]: r for r in lines[1:]}


def test_rank_lost_resumes_on_3_with_the_same_samples(sample_prefix, tmp_path):
    flags = ds_argv(sample_prefix, STEPS, ("--distributed-timeout-minutes", "0.5", "--zero-stage", "2",
                                           "--lr-decay-iters", str(STEPS)))
    out, ckpt, events, inject = tmp_path / "job", tmp_path / "ckpt", tmp_path / "events.jsonl", tmp_path / "inject"
    out.mkdir()
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(INJECT)
    env = dict(os.environ, HETU_TEST_DS_ELASTIC_OUT=str(out), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=os.pathsep.join([str(inject), *filter(None, [os.environ.get("PYTHONPATH")])]))
    job = [sys.executable, str(ROOT / "launch" / "elastic.py"), "--launcher", "deepspeed", "--nproc-per-node", "4",
           "--max-restarts", "1", "--events", str(events), "--",
           *flags, "--save", str(ckpt), "--save-interval", str(SAVE_INTERVAL)]
    proc = subprocess.run(job, env=env, capture_output=True, text=True, timeout=300)
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, log
    assert (out / "killed_at").exists(), log  # the failure happened, in the first round

    records = [json.loads(line) for line in events.read_text().splitlines()]
    failures = [r for r in records if r["event"] == "failure"]
    assert len(failures) == 1 and failures[0]["lost_devices"] == [KILLED_RANK], failures
    assert [r["world"] for r in records if r["event"] == "plan"] == [4, 3], records
    assert "resumed from deepspeed checkpoint" in proc.stdout and "global_step4" in proc.stdout, log
    assert (ckpt / "latest").read_text().strip() == f"global_step{STEPS}"

    first_start, first = _records(out / "steps_4_0.jsonl")
    second_start, second = _records(out / "steps_3_0.jsonl")
    assert first_start["start"] == 0 and sorted(first) == list(range(1, KILLED_AT_STEP))
    assert second_start["start"] == SAVE_INTERVAL and sorted(second) == list(range(SAVE_INTERVAL + 1, STEPS + 1))

    want = {g: list(range(GLOBAL_BATCH * (g - 1), GLOBAL_BATCH * g)) for g in range(1, STEPS + 1)}
    before, after = recorded_samples(out, 4), recorded_samples(out, 3)
    trained = {g: ids for g, ids in before.items() if g <= SAVE_INTERVAL} | after
    assert trained == want, json.dumps({"trained": trained, "want": want})
    assert {g: before[g] for g in range(SAVE_INTERVAL + 1, KILLED_AT_STEP)} == \
        {g: after[g] for g in range(SAVE_INTERVAL + 1, KILLED_AT_STEP)}

    assert second_start["losses"] == [first[g]["loss"] for g in range(1, SAVE_INTERVAL + 1)]
    retrained = range(SAVE_INTERVAL + 1, KILLED_AT_STEP)
    loss = max(abs(second[g]["loss"] - first[g]["loss"]) / abs(first[g]["loss"]) for g in retrained)
    killed_at = float((out / "killed_at").read_text())
    recovery = second[SAVE_INTERVAL + 1]["time"] - killed_at
    restarted = [r for r in records if r["event"] == "workers_started"][-1]["time"] - killed_at
    print(f"launch/elastic.py --launcher deepspeed: rank {KILLED_RANK} of 4 lost at step {KILLED_AT_STEP}, resumed on "
          f"3 from global_step{SAVE_INTERVAL}; steps {SAVE_INTERVAL + 1}-{KILLED_AT_STEP - 1} loss rel diff "
          f"{loss:.2e}; failure seen {failures[0]['time'] - killed_at:.2f} s, ranks restarted {restarted:.2f} s, "
          f"first step on 3 ranks done {recovery:.2f} s after the kill")
    assert loss <= LOSS_RTOL
    assert recovery < RECOVERY_BOUND_S, recovery

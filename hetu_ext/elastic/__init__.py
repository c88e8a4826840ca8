"""Elastor across nodes: membership by torch's elastic rendezvous, one Malleus plan agreed over the survivors.

* ``agreement`` (pure): per-node healthy devices -> one plan and the node, local rank and device of every rank.
* ``watchdog``: a rank's step-progress watchdog (``--hetu-hang-timeout``), stdlib only.
* ``agent``: torch's ``LocalElasticAgent`` with the plan agreement in its rendezvous, the hang and
  configuration-error rules in its monitor (imports torch.distributed.elastic; used by ``launch/elastic.py``).
"""

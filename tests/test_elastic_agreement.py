"""The plan agreement of launch/elastic.py across nodes (pure, no process group): nodes that report different
healthy devices get one plan over all of them, every rank of it on a healthy device of its node.

Bugs this catches: a plan laid out as if every node were full (Malleus' ``Cluster`` assumes equal nodes), which
puts a rank on a device that is gone or a TP group across two nodes; ranks numbered in another order than torch
elastic's (node after node in group-rank order), which starts a stage on the wrong node; a plan that does not
survive the JSON round trip every other node reads it through.
"""

from __future__ import annotations

import pytest

from hetu_ext.elastic.agreement import Agreement, NodeReport, agree
from hetu_ext.plan import ModelSpec

SMALL = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=128)
"""The rehearsal's model: any plan fits, so Malleus uses every healthy device."""
WIDE = ModelSpec(num_layers=8, hidden_size=8192, num_attention_heads=64, seq_length=4096, vocab_size=50304)
"""A model whose layers do not fit one 80 GiB device: TP groups and several stages are needed."""


def _check(agreement: Agreement, nodes: list[NodeReport]) -> None:
    plan = agreement.plan
    assert plan.world_size == sum(len(n.devices) for n in nodes)
    assert len(agreement.ranks) == plan.world_size
    start = 0
    for n, report in enumerate(nodes):  # torch elastic's order: node after node, consecutive ranks
        assert agreement.node_ranks(n) == list(range(start, start + len(report.devices)))
        start += len(report.devices)
    for rank, where in enumerate(agreement.ranks):
        assert where.device in nodes[where.node].devices, (rank, where)
        assert nodes[where.node].devices[where.local_rank] == where.device
    for pipeline in plan.pipelines:
        for stage in pipeline.stages:  # a TP group never spans two nodes
            assert len({agreement.ranks[r].node for r in stage.ranks}) == 1, stage.ranks
    again = Agreement.from_json(agreement.to_json())
    assert again == agreement


@pytest.mark.parametrize("devices", [
    [(0, 1), (0, 1), (0, 1)],      # the rehearsal's start: 3 nodes of 2
    [(0,), (0, 1), (0, 1)],        # one rank of node 0 lost
    [(0, 1), (1,), (0, 1)],        # node 1 lost its device 0: local rank 0 runs on device 1
    [(0, 1), (0, 1)],              # a whole node lost
    [(0, 1), (0,), (0, 1), (1,)],  # a spare node joined beside two short ones
])
def test_nodes_with_different_healthy_counts_get_one_plan_on_healthy_devices(devices):
    nodes = [NodeReport(node=f"node{i}", devices=d) for i, d in enumerate(devices)]
    agreement = agree(nodes, SMALL, micro_batch=2, num_microbatches=4)
    _check(agreement, nodes)
    assert agreement.plan.num_microbatches == 4  # the global batch is kept
    assert agree(nodes, SMALL, micro_batch=2, num_microbatches=4) == agreement  # one answer for one input


def test_tensor_parallel_groups_stay_inside_short_nodes():
    """A model that needs TP: nodes of 8, 5 and 7 healthy GPUs (device ids with holes) give TP groups inside each
    node, leftovers unused, never a missing device."""
    nodes = [NodeReport(node="a", devices=range(8)), NodeReport(node="b", devices=(0, 2, 3, 5, 7)),
             NodeReport(node="c", devices=(0, 1, 2, 3, 4, 5, 7))]
    agreement = agree(nodes, WIDE, micro_batch=1, num_microbatches=16)
    _check(agreement, nodes)
    assert max(s.tp for p in agreement.plan.pipelines for s in p.stages) > 1


def test_no_plan_on_too_few_devices_is_an_error_naming_the_counts():
    with pytest.raises(ValueError, match=r"no plan fits"):
        agree([NodeReport(node="a", devices=(0,))], WIDE, micro_batch=1, num_microbatches=4)
    with pytest.raises(ValueError, match="at least one"):
        NodeReport(node="a", devices=())


def test_a_node_reports_the_devices_its_command_prints_or_those_not_lost():
    """--healthy-devices-cmd prints a count or a list (a node that lost device 1 of 4 prints [0, 2, 3]); without
    one, on a CPU, the devices not lost so far. A malformed answer is an error naming the command and the fix."""
    from hetu_ext.elastic.agent import healthy_devices

    assert healthy_devices("echo 3", 8, set()) == (0, 1, 2)
    assert healthy_devices("echo '[0, 2, 3]'", 4, set()) == (0, 2, 3)
    import torch

    if not torch.cuda.is_available():  # CPU emulation; with CUDA each device is probed instead
        assert healthy_devices(None, 4, {1}) == (0, 2, 3)
    with pytest.raises(ValueError, match=r"must print a count or a JSON list of device indices"):
        healthy_devices("echo '\"all\"'", 4, set())


@pytest.mark.parametrize("devices, world, used", [
    ([(0, 1, 2, 3)], 4, [(0, 1, 2, 3)]),            # the DeepSpeed rehearsal's start
    ([(0, 1, 2)], 3, [(0, 1, 2)]),                  # rank 3 lost: 3 divides 12 microbatches
    ([(0, 1), (0, 2, 3), (1,)], 6, [(0, 1), (0, 2, 3), (1,)]),
    ([(0, 1, 2, 3), (0, 1, 3)], 6, [(0, 1, 2), (0, 1, 3)]),    # 7 healthy: 6 used, the fullest node gives one up
    ([(0, 1, 2, 3, 4)], 4, [(0, 1, 2, 3)]),         # 5 does not divide 12
])
def test_deepspeed_gets_data_parallel_over_the_largest_count_that_divides_the_global_batch(devices, world, used):
    """DeepSpeed's layout (``--launcher deepspeed``): one data-parallel rank per used device, as many as divide
    the 12 microbatches of the global batch, each node keeping at least one; the devices left out are the last of
    the fullest nodes, and torch elastic's rank order holds over the devices used. A world that does not divide
    the global batch would fail every rank's DeepSpeed config (train_batch_size = micro x accumulation x world)."""
    from hetu_ext.elastic.agreement import data_parallel

    nodes = [NodeReport(node=f"node{i}", devices=d) for i, d in enumerate(devices)]
    agreement = data_parallel(nodes, num_layers=4, num_microbatches=12)
    assert agreement.plan.world_size == world
    assert [n.devices for n in agreement.nodes] == used
    assert [len(p.stages) for p in agreement.plan.pipelines] == [1] * world  # TP 1, PP 1: data parallel only
    assert agreement.plan.num_microbatches == 12  # the global batch is kept
    _check(agreement, list(agreement.nodes))
    with pytest.raises(ValueError, match=r"divides the global batch's 7 microbatches"):
        data_parallel([NodeReport(node="a", devices=(0, 1)), NodeReport(node="b", devices=(0, 1))],
                      num_layers=4, num_microbatches=7)

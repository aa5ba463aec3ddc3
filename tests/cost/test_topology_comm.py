"""Mesh placement and alpha-beta collective costs."""

from __future__ import annotations

import math

import pytest

from ptc.compiler.cost import collectives as comm
from ptc.compiler.cost.topology import AxisGroup, axis_placements
from ptc.plan import HardwareSpec


def test_tp_innermost_stays_in_node_and_dp_spans():
    groups = axis_placements({"tp": 8, "dp": 4, "pp": 2}, ("tp", "dp", "pp"), 8)
    assert groups["tp"].link == "intra"
    assert (groups["dp"].stride, groups["dp"].per_node, groups["dp"].nodes) == (8, 1, 4)
    assert groups["pp"].spans_nodes


def test_partial_node_groups():
    groups = axis_placements({"tp": 2, "dp": 16, "pp": 1}, ("tp", "dp", "pp"), 8)
    assert (groups["dp"].per_node, groups["dp"].nodes) == (4, 4)


def test_order_decides_which_axis_gets_nvlink():
    groups = axis_placements({"tp": 8, "dp": 8, "pp": 1}, ("dp", "tp", "pp"), 8)
    assert groups["dp"].link == "intra" and groups["tp"].link == "inter"


A100 = HardwareSpec.preset("A100-80GB", nodes=16)
H100 = HardwareSpec.preset("H100-SXM", nodes=16)


def test_ring_all_reduce_formula():
    group = AxisGroup(axis="tp", size=8, stride=1, per_node=8)
    size = 1e9
    expected = 2 * 7 * (A100.intra.latency + size / 8 / A100.intra.bandwidth)
    cost = comm.all_reduce(size, group, A100)
    assert cost.algorithm == "ring" and cost.seconds == pytest.approx(expected)


def test_tree_for_small_messages_across_many_nodes():
    group = AxisGroup(axis="dp", size=128, stride=8, per_node=1)
    small, large = comm.all_reduce(1e3, group, A100), comm.all_reduce(1e10, group, A100)
    assert small.algorithm == "tree" and large.algorithm == "ring"


def test_nvls_where_the_switch_reduces():
    group = AxisGroup(axis="tp", size=8, stride=1, per_node=8)
    assert comm.all_reduce(1e9, group, H100).algorithm == "nvls"
    assert comm.all_reduce(1e9, group, A100).algorithm == "ring"


def test_spanning_group_uses_every_nic():
    group = AxisGroup(axis="dp", size=32, stride=1, per_node=8)
    cost = comm.all_reduce(8e9, group, A100)
    # Each of the 8 local members drives its own NIC: far below a ring on one NIC.
    one_nic = 2 * 31 / 32 * 8e9 / A100.inter.bandwidth
    assert cost.seconds < one_nic / 4


def test_gather_across_nodes_is_nccls_one_ring():
    """NCCL's ring over n ranks on N nodes: N - 1 of its n - 1 steps cross the network, the
    rest stay on NVLink; its bandwidth is the k local members' NICs together, at most
    NVLink's (src/graph/tuning.cc)."""
    n, k = 1024, 8
    group = AxisGroup(axis="dp", size=n, stride=1, per_node=k)
    nodes = n // k
    latency = (n - nodes) * A100.intra.latency + (nodes - 1) * A100.inter.latency
    for size in (1e3, 4e9):
        expected = latency + size * (n - 1) / n / min(A100.intra.bandwidth,
                                                        k * A100.inter.bandwidth)
        for op in (comm.all_gather, comm.reduce_scatter):
            cost = op(size, group, A100)
            assert cost.algorithm == "ring" and cost.seconds == pytest.approx(expected)
    # At 1024 ranks the 896 NVLink steps alone outweigh a hierarchical ring's 7 + 127.
    assert comm.all_gather(1e3, group, A100).seconds > 896 * A100.intra.latency


def test_a_group_with_one_member_per_node_is_a_ring_on_the_network():
    group = AxisGroup(axis="dp", size=16, stride=8, per_node=1)
    expected = 15 * (A100.inter.latency + 1e9 / 16 / A100.inter.bandwidth)
    assert comm.reduce_scatter(1e9, group, A100).seconds == pytest.approx(expected)


def test_reduce_scatter_plus_all_gather_equals_ring_all_reduce():
    group = AxisGroup(axis="tp", size=4, stride=1, per_node=4)
    halves = comm.reduce_scatter(1e8, group, A100).seconds + comm.all_gather(1e8, group, A100).seconds
    assert halves == pytest.approx(comm.all_reduce(1e8, group, A100).seconds)


def test_point_to_point():
    inside = AxisGroup(axis="pp", size=2, stride=4, per_node=2)
    across = AxisGroup(axis="pp", size=2, stride=8, per_node=1)
    assert comm.send_recv(1e6, inside, A100).seconds == pytest.approx(
        A100.intra.latency + 1e6 / A100.intra.bandwidth)
    assert comm.send_recv(1e6, across, A100).seconds == pytest.approx(
        A100.inter.latency + 1e6 / A100.inter.bandwidth)
    assert math.isclose(comm.send_recv(1e6, AxisGroup("pp", 1, 1, 1), A100).seconds, 0.0)

"""Alpha-beta cost of collectives, with the algorithm NCCL would pick.

Terms: S is the buffer size in bytes (the all-reduce input, the all-gather
output, the reduce-scatter input); n the group size; B a link's per-GPU,
per-direction bandwidth; alpha its latency. One transfer of x bytes costs
alpha + x / B.

Algorithms, each NCCL's own:
- ring all-reduce: 2(n-1) steps of S/n each;
- tree all-reduce (double binary tree): 2·log2(n) latencies, and each byte
  goes up and down the tree once;
- NVLS (NVLink SHARP): the switch reduces in the network, so each GPU sends
  and receives S once instead of 2(n-1)/n · S;
- ring reduce-scatter / all-gather: n-1 steps of S/n.
NCCL tunes its choice by predicted time; we take the fastest that the
hardware offers. For a group spanning N nodes with k members on each, NCCL
(src/graph/tuning.cc, `ncclTopoTuneModel`) prices its ring as one ring over
all n ranks:
- latency: of its steps, N-1 cross a node boundary (the network's alpha)
  and the others stay on NVLink (n-1 for a reduce-scatter or all-gather,
  2(n-1) for an all-reduce);
- bandwidth: the ring runs one channel per NIC it can reach, so its bus
  bandwidth is the k local members' NICs together (each drives its own),
  at most NVLink's.
All-gather and reduce-scatter have only the ring. An all-reduce may also run
hierarchically (NCCL's tree: reduce-scatter inside each node over NVLink,
the inter-node all-reduce on 1/k of the data with each of the k local
members on its own NIC, all-gather inside the node); the faster is taken.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil, log2

from ptc.compiler.cost.topology import AxisGroup
from ptc.plan import HardwareSpec, LinkSpec


@dataclass(frozen=True, slots=True)
class CommCost:
    """Time of one collective and the algorithm that gives it."""

    seconds: float
    """Predicted duration."""
    algorithm: str
    """E.g. "ring", "tree", "nvls", "hier(nvls+tree)"."""


_FREE = CommCost(0.0, "none")


def _ring_ar(size: float, n: int, link: LinkSpec) -> float:
    return 2 * (n - 1) * (link.latency + size / n / link.bandwidth)


def _tree_ar(size: float, n: int, link: LinkSpec) -> float:
    return 2 * ceil(log2(n)) * link.latency + 2 * size / link.bandwidth


def _nvls_ar(size: float, link: LinkSpec) -> float:
    return 2 * link.latency + size / link.bandwidth


def _ring_half(size: float, n: int, link: LinkSpec) -> float:
    """Reduce-scatter or all-gather over a ring."""
    return (n - 1) * (link.latency + size / n / link.bandwidth)


def _spanning_ring_half(size: float, group: AxisGroup, hw: HardwareSpec) -> float:
    """Reduce-scatter or all-gather over one ring of a group spanning nodes (NCCL's model)."""
    n, nodes = group.size, group.nodes
    latency = (n - nodes) * hw.intra.latency + (nodes - 1) * hw.inter.latency
    bandwidth = min(hw.intra.bandwidth, group.per_node * hw.inter.bandwidth)
    return latency + size * (n - 1) / n / bandwidth


def _flat_all_reduce(size: float, n: int, link: LinkSpec, nvls: bool) -> CommCost:
    options = {"ring": _ring_ar(size, n, link), "tree": _tree_ar(size, n, link)}
    if nvls:
        options["nvls"] = _nvls_ar(size, link)
    algo = min(options, key=options.__getitem__)
    return CommCost(options[algo], algo)


def all_reduce(size: float, group: AxisGroup, hw: HardwareSpec) -> CommCost:
    """All-reduce of `size` bytes over `group`."""
    if group.size == 1 or size == 0:
        return _FREE
    if not group.spans_nodes:
        return _flat_all_reduce(size, group.size, hw.intra, hw.nvlink_sharp)
    k = group.per_node
    inter = _flat_all_reduce(size / k, group.nodes, hw.inter, False)
    if k == 1:
        return inter
    ring = 2 * _spanning_ring_half(size, group, hw)
    if hw.nvlink_sharp:
        # NVLS reduce-scatter and all-gather each move S once through the switch.
        local, name = 2 * (hw.intra.latency + size / hw.intra.bandwidth * (k - 1) / k), "nvls"
    else:
        local, name = 2 * _ring_half(size, k, hw.intra), "ring"
    if ring <= local + inter.seconds:
        return CommCost(ring, "ring")
    return CommCost(local + inter.seconds, f"hier({name}+{inter.algorithm})")


def _half(size: float, group: AxisGroup, hw: HardwareSpec) -> CommCost:
    if group.size == 1 or size == 0:
        return _FREE
    if not group.spans_nodes:
        return CommCost(_ring_half(size, group.size, hw.intra), "ring")
    return CommCost(_spanning_ring_half(size, group, hw), "ring")


def reduce_scatter(size: float, group: AxisGroup, hw: HardwareSpec) -> CommCost:
    """Reduce-scatter of a `size`-byte input over `group`."""
    return _half(size, group, hw)


def all_gather(size: float, group: AxisGroup, hw: HardwareSpec) -> CommCost:
    """All-gather into a `size`-byte output over `group`."""
    return _half(size, group, hw)


def all_to_all(size: float, group: AxisGroup, hw: HardwareSpec) -> CommCost:
    """All-to-all of a `size`-byte input over `group`, spread evenly (the mean of a
    router's): each rank keeps 1/n of it and sends 1/n to every other member at once, the
    sends to members on its node over NVLink beside those crossing nodes over its NIC
    (NCCL's grouped point-to-point: one latency per link)."""
    if group.size == 1 or size == 0:
        return _FREE
    n, local = group.size, min(group.per_node, group.size)
    intra = hw.intra.latency + size * (local - 1) / n / hw.intra.bandwidth
    inter = hw.inter.latency + size * (n - local) / n / hw.inter.bandwidth if n > local else 0.0
    return CommCost(max(intra, inter), "pairwise")


def send_recv(size: float, group: AxisGroup, hw: HardwareSpec) -> CommCost:
    """Point-to-point transfer of `size` bytes between neighbours of `group`."""
    if group.size == 1 or size == 0:
        return _FREE
    # The slowest hop bounds the pipeline: any stage boundary across nodes uses InfiniBand.
    link = hw.inter if group.spans_nodes else hw.intra
    return CommCost(link.latency + size / link.bandwidth, "p2p")

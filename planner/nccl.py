"""NCCL's own latency model of a collective, and its choice of ring or tree for an all-reduce.
Torch-free; the planner's collectives are priced with it (``Topology.ring_s``,
``Topology.all_reduce_s``; docs/cost-model.md, "Latency as NCCL prices it").

NCCL picks an algorithm and a protocol for every collective by predicting each one's time as
``latency + bytes / bandwidth`` (``ncclTopoGetAlgoTime``) from a model built at start-up
(``ncclTopoTuneModel``, src/graph/tuning.cc; read at NVIDIA/nccl 5067397c, 2026-06-11). The
latency part, for the Simple protocol (the one large, bandwidth-bound messages run with):

- every collective pays a base latency, 8.4 us for ring and tree (``baseLatencies``);
- each hop of a ring pays the hop's latency (``hwLatencies``): 3.4 us over NVLink, 14 us over
  the network. A ring all-gather or reduce-scatter of G ranks over N nodes has ``G - 1``
  steps, of which only ``N - 1`` cross a node (``nInterSteps``); an all-reduce has twice each;
- a tree all-reduce (NCCL's double binary tree across nodes, a chain inside each) pays
  ``2 ((G / N - 1) intra hop + floor(log2 N) network hop)``;
- a ring all-reduce across nodes is 1.4 times that (``lat *= 1.4``, the "plateau effect of
  ring" on compute capability 8.0 and later, for messages of at least 64 bytes per rank and
  channel: every gradient reduction priced here).

For the bandwidth part, a ring all-reduce moves ``2 (G - 1) / G`` of the buffer per rank at the
bus bandwidth; a tree all-reduce runs at half the bus bandwidth, times 0.92
(``busBw * .92`` then ``ratio = .5``). NCCL takes the faster of the two; so does
:func:`all_reduce_s`. All-gathers and reduce-scatters are rings here (NCCL's PAT and NVLS
algorithms, and CollNet, are not modelled).

Left out, each stated: the tree's extra slowdown below 512 MB (``treeCorrectionFactor``, a
table by message size: it would make the price fall as some messages grow, which the mesh
search's lower bounds cannot have); the tree's own NVLink hop (4.0 us, priced at the ring's);
and the host's network overhead that raises a multi-node ring's intra-node hop to 3 us (Intel
hosts) or 6 us (AMD hosts).
"""

from __future__ import annotations

import math

__all__ = [
    "BASE_LATENCY_S",
    "NET_HOP_LATENCY_S",
    "NVLINK_HOP_LATENCY_S",
    "RING_ALL_REDUCE_PLATEAU",
    "SOURCE",
    "TREE_BUS_SHARE",
    "all_reduce_s",
    "ring_latency_s",
    "tree_all_reduce_latency_s",
]

SOURCE = (
    "NVIDIA/nccl src/graph/tuning.cc at 5067397c (ncclTunerConstantsDefaults, "
    "ncclTopoTuneModel, ncclTopoGetAlgoTime), Simple protocol"
)
BASE_LATENCY_S = 8.4e-6
"""Latency every ring or tree collective pays once (``baseLatencies``, Simple)."""
NVLINK_HOP_LATENCY_S = 3.4e-6
"""Latency of one ring step over NVLink (``hwLatencies[NVLINK][RING][SIMPLE]``)."""
NET_HOP_LATENCY_S = 14e-6
"""Latency of one step over the network, ring or tree (``hwLatencies[NET][*][SIMPLE]``)."""
RING_ALL_REDUCE_PLATEAU = 1.4
"""A multi-node ring all-reduce's latency multiplier (compute capability 8.0 and later)."""
TREE_BUS_SHARE = 0.92
"""Share of the bus bandwidth a tree all-reduce keeps (``busBw * .92``); it then moves the
whole buffer at half of that."""


def ring_latency_s(
    ranks: int,
    nodes: int,
    intra_hop_s: float,
    inter_hop_s: float,
    base_s: float,
    *,
    all_reduce: bool = False,
) -> float:
    """Latency of one ring collective of ``ranks`` ranks over ``nodes`` nodes: ``base_s``, plus
    ``ranks - nodes`` steps inside nodes and ``nodes - 1`` across (all-gather or
    reduce-scatter), both doubled for an all-reduce, which across nodes also takes
    :data:`RING_ALL_REDUCE_PLATEAU` times the whole. 0 for one rank. O(1)."""
    if ranks <= 1:
        return 0.0
    nodes = max(1, min(nodes, ranks))
    passes = 2 if all_reduce else 1
    latency = base_s + passes * ((ranks - nodes) * intra_hop_s + (nodes - 1) * inter_hop_s)
    if all_reduce and nodes > 1:
        latency *= RING_ALL_REDUCE_PLATEAU
    return latency


def tree_all_reduce_latency_s(
    ranks: int, nodes: int, intra_hop_s: float, inter_hop_s: float, base_s: float
) -> float:
    """Latency of one tree all-reduce: ``base_s + 2 ((ranks / nodes - 1) intra +
    floor(log2 nodes) inter)``, up and down the tree. 0 for one rank. O(1)."""
    if ranks <= 1:
        return 0.0
    nodes = max(1, min(nodes, ranks))
    per_node = ranks // nodes
    return base_s + 2 * ((per_node - 1) * intra_hop_s + int(math.log2(nodes)) * inter_hop_s)


def all_reduce_s(
    nbytes: float,
    ranks: int,
    nodes: int,
    bus_bandwidth_bytes_per_s: float,
    intra_hop_s: float,
    inter_hop_s: float,
    base_s: float,
) -> float:
    """Seconds of one all-reduce of ``nbytes`` among ``ranks`` ranks over ``nodes`` nodes, as
    NCCL would run it: the faster of a ring (``2 (G - 1) / G`` of the buffer at the bus
    bandwidth) and, across nodes, a tree (the buffer at half of :data:`TREE_BUS_SHARE` of
    it), each with its latency. 0 for one rank or no bytes. Rises with ``nbytes``. O(1)."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    ring = 2 * (ranks - 1) / ranks * nbytes / bus_bandwidth_bytes_per_s + ring_latency_s(
        ranks, nodes, intra_hop_s, inter_hop_s, base_s, all_reduce=True
    )
    if nodes <= 1:
        return ring
    tree = nbytes / (0.5 * TREE_BUS_SHARE * bus_bandwidth_bytes_per_s)
    tree += tree_all_reduce_latency_s(ranks, nodes, intra_hop_s, inter_hop_s, base_s)
    return min(ring, tree)

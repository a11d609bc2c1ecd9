"""NCCL's latency model and its ring-or-tree all-reduce (planner/nccl.py): the formulas of
NCCL's src/graph/tuning.cc by hand, and the properties the mesh search relies on (a price that
rises with the bytes, never above the ring's)."""

from __future__ import annotations

import math

import pytest
from autopipe.planner import nccl
from hypothesis import given, settings
from hypothesis import strategies as st

HOPS = (nccl.NVLINK_HOP_LATENCY_S, nccl.NET_HOP_LATENCY_S, nccl.BASE_LATENCY_S)


def test_the_constants_are_nccls_simple_protocol_figures() -> None:
    # src/graph/tuning.cc at 5067397c: baseLatencies {6.8, 14.0, 8.4} for Tree and Ring
    # (LL, LL128, Simple); hwLatencies NVLINK Ring Simple 3.4, NET Ring and Tree Simple 14
    assert HOPS == (3.4e-6, 14e-6, 8.4e-6)
    assert nccl.RING_ALL_REDUCE_PLATEAU == 1.4 and nccl.TREE_BUS_SHARE == 0.92
    assert "tuning.cc" in nccl.SOURCE


def test_ring_latency_counts_only_the_steps_that_cross_a_node_at_the_networks_hop() -> None:
    # 64 ranks over 8 nodes: 56 NVLink steps and 7 network steps (NCCL's nInterSteps)
    assert nccl.ring_latency_s(64, 8, *HOPS) == pytest.approx(8.4e-6 + 56 * 3.4e-6 + 7 * 14e-6)
    # an all-reduce: twice each, then 1.4 times the whole across nodes
    twice = 8.4e-6 + 2 * (56 * 3.4e-6 + 7 * 14e-6)
    assert nccl.ring_latency_s(64, 8, *HOPS, all_reduce=True) == pytest.approx(1.4 * twice)
    # inside one node: no plateau
    assert nccl.ring_latency_s(8, 1, *HOPS, all_reduce=True) == pytest.approx(8.4e-6 + 14 * 3.4e-6)
    assert nccl.ring_latency_s(1, 1, *HOPS) == 0.0


def test_tree_latency_climbs_log2_of_the_nodes() -> None:
    # 64 ranks, 8 a node, over 8 nodes: 2 (7 NVLink hops + 3 network hops)
    expect = 8.4e-6 + 2 * (7 * 3.4e-6 + 3 * 14e-6)
    assert nccl.tree_all_reduce_latency_s(64, 8, *HOPS) == pytest.approx(expect)
    # 6 nodes: floor(log2 6) = 2, as NCCL's log2i
    assert nccl.tree_all_reduce_latency_s(6, 6, *HOPS) == pytest.approx(8.4e-6 + 2 * 2 * 14e-6)


def test_an_all_reduce_takes_the_faster_of_ring_and_tree() -> None:
    bw = 200e9
    ring_lat = nccl.ring_latency_s(512, 64, *HOPS, all_reduce=True)
    tree_lat = nccl.tree_all_reduce_latency_s(512, 64, *HOPS)
    small, large = 1e6, 1e10
    ring_small = 2 * 511 / 512 * small / bw + ring_lat
    tree_small = small / (0.46 * bw) + tree_lat
    assert tree_small < ring_small
    assert nccl.all_reduce_s(small, 512, 64, bw, *HOPS) == pytest.approx(tree_small)
    ring_large = 2 * 511 / 512 * large / bw + ring_lat
    assert nccl.all_reduce_s(large, 512, 64, bw, *HOPS) == pytest.approx(ring_large)
    # inside a node NCCL's tree is not weighed: the ring alone
    inside = 2 * 7 / 8 * small / bw + nccl.ring_latency_s(8, 1, *HOPS, all_reduce=True)
    assert nccl.all_reduce_s(small, 8, 1, bw, *HOPS) == pytest.approx(inside)
    assert nccl.all_reduce_s(small, 1, 1, bw, *HOPS) == 0.0
    assert nccl.all_reduce_s(0.0, 8, 2, bw, *HOPS) == 0.0


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    st.integers(2, 4096),
    st.sampled_from([1, 2, 4, 8]),
    st.floats(1e3, 1e11),
    st.floats(1.0, 50.0),
)
def test_the_all_reduce_price_rises_with_its_bytes_and_never_passes_the_rings(
    ranks: int, per_node: int, nbytes: float, grow: float
) -> None:
    """The mesh search's lower bounds price the average rank's gradients and take that as at
    most the busiest rank's price: the price must rise with the bytes (the reason NCCL's
    per-size tree correction is left out)."""
    nodes = max(1, math.ceil(ranks / per_node))
    bw = 100e9
    price = nccl.all_reduce_s(nbytes, ranks, nodes, bw, *HOPS)
    assert nccl.all_reduce_s(nbytes * grow, ranks, nodes, bw, *HOPS) >= price
    ring = 2 * (ranks - 1) / ranks * nbytes / bw
    ring += nccl.ring_latency_s(ranks, nodes, *HOPS, all_reduce=True)
    assert price <= ring * (1 + 1e-12)
    # never below the bandwidth the ring's bus allows a tree at most
    assert price >= min(ring, nbytes / (0.46 * bw))

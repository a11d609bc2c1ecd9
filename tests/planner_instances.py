"""Synthetic Profiles and clusters for the planner tests (no torch)."""

from __future__ import annotations

import random

from autopipe.planner.costs import CostModel

from autopipe.core.cluster import Cluster, Device
from autopipe.core.profile import Profile, UnitProfile


def random_profile(
    n_units: int, seed: int, *, batch_size: int = 32, overhead: bool = False
) -> Profile:
    """Units with random times (s), parameters, activations and cut sizes (bytes)."""
    r = random.Random(seed)
    units = []
    for i in range(n_units):
        fwd = r.uniform(1e-3, 1e-2)
        units.append(
            UnitProfile(
                name=f"layer{i}",
                kind="Linear",
                forward_s=fwd,
                backward_s=fwd * r.uniform(1.0, 3.0),
                forward_overhead_s=fwd * 0.1 if overhead else 0.0,
                backward_overhead_s=fwd * 0.2 if overhead else 0.0,
                parameter_count=r.randint(0, 2_000_000),
                activation_bytes=r.randint(0, 20_000_000),
            )
        )
    for u in units:
        u.parameter_bytes = 4 * u.parameter_count
    cuts = [r.randint(10_000, 5_000_000) for _ in range(n_units - 1)]
    return Profile(units=units, cut_bytes=cuts, batch_size=batch_size, input_bytes=1_000_000)


def random_cluster(k: int, seed: int, memory_bytes: int | None) -> Cluster:
    """K devices with different speeds, memories and links (heterogeneous, fixed order)."""
    r = random.Random(seed)
    return Cluster(
        [
            Device(
                name=f"dev{s}",
                memory_bytes=None
                if memory_bytes is None
                else int(memory_bytes * r.uniform(0.5, 1.5)),
                speed=r.choice([0.5, 1.0, 2.0]),
                link_bandwidth_bytes_per_s=r.choice([1e9, 1e10, float("inf")]),
                link_latency_s=r.choice([0.0, 1e-5]),
            )
            for s in range(k)
        ]
    )


def cost_model(
    profile: Profile, cluster: Cluster, m: int, schedule: str, checkpoint: str
) -> CostModel:
    """The planner's cost model at batch 32, Adam in fp32 (16 B/param), 10% headroom."""
    return CostModel(
        profile,
        cluster,
        batch_size=32,
        microbatches=m,
        schedule=schedule,
        checkpoint=checkpoint,
        state_bytes_per_parameter=16,
        headroom=0.1,
    )

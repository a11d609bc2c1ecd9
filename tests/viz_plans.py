"""Small real plans and image checks shared by the plot tests (test_viz*.py)."""

from __future__ import annotations

import struct
from pathlib import Path

from autopipe.planner import Cluster, plan

from autopipe.core.plan import Plan
from autopipe.core.profile import Profile, UnitProfile
from autopipe.core.request import PlanRequest

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _profile(n: int = 12, batch: int = 32) -> Profile:
    """A small hand-made profile: uneven units, a heavy last unit (like an LM head)."""
    units = [
        UnitProfile(
            name=f"u{i}",
            forward_s=1e-3 * (1 + i % 3) * (3 if i == n - 1 else 1),
            backward_s=2e-3 * (1 + i % 3) * (3 if i == n - 1 else 1),
            forward_overhead_s=1e-4,
            backward_overhead_s=2e-4,
            parameter_count=1_000_000 * (6 if i == n - 1 else 1),
            parameter_bytes=4_000_000 * (6 if i == n - 1 else 1),
            activation_bytes=8_000_000,
            output_bytes=1_000_000,
        )
        for i in range(n)
    ]
    return Profile(units=units, cut_bytes=[1_000_000] * (n - 1), batch_size=batch, input_bytes=1000)


def gpipe_plan_of(profile: Profile) -> Plan:
    """What the ``gpipe_plan`` fixtures hold: K = 4, M chosen, 1 GiB per device."""
    return plan(
        profile, PlanRequest(gpus=4, batch_size=32, microbatches="auto", memory_per_device=2**30)
    )


def onefoneb_plan_of(profile: Profile) -> Plan:
    """What the ``onefoneb_plan`` fixtures hold."""
    # Finite links (sends on the timeline) and checkpointing (recompute boxes).
    cluster = Cluster.homogeneous(4, link_bandwidth_bytes_per_s=2e9)
    return plan(
        profile,
        PlanRequest(
            cluster=cluster, batch_size=32, microbatches=8, schedule="1f1b", checkpoint="always"
        ),
    )


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _check_png(path: Path, min_w: int = 600, min_h: int = 250) -> None:
    width, height = _png_size(path)
    assert min_w <= width <= 4000 and min_h <= height <= 4000, (width, height)
    assert path.stat().st_size > 10_000  # a real drawing, not an empty canvas


def _drawn_idle_fraction(ax) -> float:
    """Idle share recovered from the drawn patches: row length x rows minus the task boxes."""
    tasks = [p for p in ax.patches if str(p.get_gid()).startswith("task:")]
    bubbles = [p for p in ax.patches if p.get_gid() == "bubble"]
    rows = {round(p.get_y() + p.get_height() / 2) for p in tasks + bubbles}
    x0, x1 = ax.get_xlim()
    area = len(rows) * (x1 - x0)
    # Task boxes of one row never overlap in a simulated timeline, so widths add up.
    busy = sum(p.get_width() for p in tasks)
    idle_drawn = sum(p.get_width() for p in bubbles)
    assert abs((area - busy) - idle_drawn) <= 1e-6 * area  # shading = complement of the boxes
    return (area - busy) / area


def _gpt_like_plan(microbatches: int = 16) -> Plan:
    """examples/gpt.py's shape on 8 stages: a light embedding, 24 equal blocks, a head."""
    names = ["tok_emb", *(f"blocks.{i}" for i in range(24)), "head"]
    units = [
        UnitProfile(
            name=n,
            forward_s=(0.3 if n == "tok_emb" else 1.0) * 1e-3,
            backward_s=(0.3 if n == "tok_emb" else 1.0) * 2e-3,
            parameter_bytes=2_000_000,
            activation_bytes=3_000_000,
        )
        for n in names
    ]
    profile = Profile(units=units, cut_bytes=[100_000] * (len(units) - 1), batch_size=32)
    return plan(profile, PlanRequest(gpus=8, microbatches=microbatches, baselines=False))

"""Scaling: predicted throughput and per-device memory against the number of stages K.

Left: samples/s for K = 1..gpus with the ideal linear scaling from K = 1 dashed, so the point
where more devices stop paying shows as the gap. Right: the fullest device's memory against
the device limit. Ks whose plan does not fit memory are marked with an x on the axis.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autopipe.viz.style import byte_unit, new_figure, save


def scaling_figure(data: dict[str, Any]) -> Any:
    """The scaling figure from :func:`autopipe.viz.data.scaling_data`'s dict."""
    fig = new_figure(11.0, 4.2)
    ax_t, ax_m = fig.subplots(1, 2)
    points = data["points"]
    ok = [p for p in points if p.get("feasible", True)]
    bad = [p for p in points if not p.get("feasible", True)]
    ks = [int(p["num_stages"]) for p in points]
    chosen = data.get("chosen_num_stages")
    _draw_throughput(ax_t, ok, ks)
    unit_name = _draw_memory(ax_m, ok, data.get("memory_limit_bytes"))
    for ax in (ax_t, ax_m):
        _mark_ks(ax, bad, ks, chosen)
    ax_t.set_ylabel("samples / s (predicted)")
    ax_t.set_title("throughput vs devices", fontsize=10)
    ax_m.set_ylabel(f"memory per device ({unit_name})")
    ax_m.set_title("memory of the fullest device vs devices", fontsize=10)
    return fig


def _draw_throughput(ax: Any, ok: Sequence[dict[str, Any]], ks: Sequence[int]) -> None:
    """The left panel's lines: predicted samples/s of the feasible points ``ok`` (each
    labelled with its micro-batch count) and, from K = 1, linear scaling over ``ks``."""
    ax.plot(
        [p["num_stages"] for p in ok],
        [p["throughput"] for p in ok],
        marker="o",
        color="#4C72B0",
        linewidth=2,
        label="predicted",
    )
    one = [p for p in ok if int(p["num_stages"]) == 1]
    if one:
        base = float(one[0]["throughput"])
        ax.plot(ks, [base * k for k in ks], linestyle="--", color="gray", label="linear")
    for p in ok:
        if p.get("microbatches"):
            ax.annotate(
                f"M={p['microbatches']}",
                (p["num_stages"], p["throughput"]),
                textcoords="offset points",
                xytext=(0, 6),
                ha="center",
                fontsize=7,
            )


def _draw_memory(ax: Any, ok: Sequence[dict[str, Any]], limit: Any) -> str:
    """The right panel's lines: the fullest device's memory of the feasible points ``ok``
    and the device ``limit`` (bytes, or None); returns the byte unit's name."""
    biggest = max([float(p.get("max_memory_bytes", 0)) for p in ok] + [float(limit or 0)])
    unit_name, unit = byte_unit(biggest)
    ax.plot(
        [p["num_stages"] for p in ok],
        [float(p["max_memory_bytes"]) / unit for p in ok],
        marker="o",
        color="#DD8452",
        linewidth=2,
        label="fullest device",
    )
    if limit:
        ax.axhline(float(limit) / unit, color="#C44E52", linewidth=1.5, label="device limit")
    return unit_name


def _mark_ks(ax: Any, bad: Sequence[dict[str, Any]], ks: Sequence[int], chosen: Any) -> None:
    """On either panel: the Ks whose plan does not fit (``bad``, an x on the axis), the
    chosen K, the K ticks, the grid and the legend."""
    if bad:
        ax.plot(
            [p["num_stages"] for p in bad],
            [0.0] * len(bad),
            linestyle="none",
            marker="x",
            color="#C44E52",
            markersize=9,
            clip_on=False,
            label="does not fit",
        )
    if chosen:
        ax.axvline(int(chosen), color="#55A868", linewidth=1.0, label=f"plan: K={chosen}")
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("pipeline stages K (devices)")
    ax.set_ylim(bottom=0)
    ax.grid(color="#EEEEEE", linewidth=0.5)
    ax.legend(fontsize=7)


def plot_scaling(
    data: dict[str, Any], out: str | Path, formats: Sequence[str] = ("png",)
) -> list[Path]:
    """Write the scaling figure to ``out.<fmt>``. Returns the paths."""
    return save(scaling_figure(data), out, formats)

"""Bubble overhead against the number of micro-batches M.

Left: the idle fraction, GPipe's closed form ``(K-1)/(M+K-1)`` (dashed) and the simulated one
(solid). Right: simulated throughput (samples/s). Both on a log-2 x axis, the plan's chosen M
marked with a star, GPipe's rule of thumb ``M >= 4K`` shaded. Each K is one curve.

The data is a JSON-able dict (see :func:`bubble_data`) so a plan file can carry it and
``autopipe plot`` can redraw the figure without the profile.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autopipe.planner.simulate import fill_drain_bubble
from autopipe.viz.style import new_figure, save

__all__ = ["bubble_figure", "plot_bubble"]


MARKERS = ("s", "^", "D", "v", "P")
"""Markers of the curves of K other than the plan's, in turn (the plan's K: small dots)."""


def bubble_figure(data: dict[str, Any]) -> Any:
    """The bubble-vs-M figure from :func:`bubble_data`'s dict."""
    fig = new_figure(11.0, 4.2)
    ax_bubble, ax_tput = fig.subplots(1, 2)
    chosen_k = int(data["num_stages"])
    chosen_m = int(data["chosen_microbatches"])
    all_m: set[int] = set()
    for i, (color, curve) in enumerate(
        zip(_colors(len(data["curves"])), data["curves"], strict=True)
    ):
        marker = MARKERS[i % len(MARKERS)]
        all_m.update(_draw_curve(ax_bubble, ax_tput, curve, color, marker, chosen_k, chosen_m))
    ax_bubble.plot([], [], linestyle="--", color="gray", label="(K-1)/(M+K-1)")
    _draw_rule_of_thumb(ax_bubble, ax_tput, all_m, chosen_k)
    _label_axes(ax_bubble, ax_tput, data.get("batch_size", "?"))
    return fig


def _draw_curve(
    ax_bubble: Any,
    ax_tput: Any,
    curve: dict[str, Any],
    color: Any,
    marker: str,
    chosen_k: int,
    chosen_m: int,
) -> list[int]:
    """One K's curves: the closed-form bubble (dashed), the simulated bubble and throughput,
    micro-batch counts that do not fit memory (x at 0 throughput) and, on the plan's K, the
    chosen M (a star). Returns the curve's micro-batch counts."""
    k = int(curve["num_stages"])
    pts = [p for p in curve["points"] if p.get("feasible", True)]
    ms = [int(p["microbatches"]) for p in curve["points"]]
    bold = k == chosen_k
    # Other Ks: hollow, larger markers, so a curve lying under the plan's stays visible.
    style = (
        {"marker": "o", "markersize": 3.5, "zorder": 3}
        if bold
        else {"marker": marker, "markersize": 7, "markerfacecolor": "none", "zorder": 2}
    )
    ax_bubble.plot(
        ms,
        [fill_drain_bubble(m, k) for m in ms],
        linestyle="--",
        color=color,
        linewidth=1.0,
        alpha=0.8,
    )
    for ax, key, label in (
        (ax_bubble, "bubble_fraction", f"K={k} simulated"),
        (ax_tput, "throughput", f"K={k}"),
    ):
        ax.plot(
            [p["microbatches"] for p in pts],
            [p[key] for p in pts],
            **style,
            color=color,
            linewidth=2.2 if bold else 1.2,
            label=label,
        )
    bad = [p for p in curve["points"] if not p.get("feasible", True)]
    if bad:
        ax_tput.plot(
            [p["microbatches"] for p in bad],
            [0.0] * len(bad),
            linestyle="none",
            marker="x",
            color=color,
            label=f"K={k}: does not fit memory",
        )
    chosen = [p for p in pts if int(p["microbatches"]) == chosen_m]
    if bold and chosen:
        _mark_chosen(ax_bubble, ax_tput, chosen[0], chosen_m)
    return ms


def _mark_chosen(ax_bubble: Any, ax_tput: Any, point: dict[str, Any], chosen_m: int) -> None:
    """A star at the plan's M on both panels."""
    for ax, key in ((ax_bubble, "bubble_fraction"), (ax_tput, "throughput")):
        ax.plot(
            [chosen_m],
            [point[key]],
            marker="*",
            markersize=16,
            color="#C44E52",
            markeredgecolor="black",
            zorder=5,
            linestyle="none",
            label=f"chosen M={chosen_m}" if key == "throughput" else None,
        )


def _draw_rule_of_thumb(ax_bubble: Any, ax_tput: Any, all_m: set[int], chosen_k: int) -> None:
    """Both panels' log-2 M axis, ticked at every M drawn, with GPipe's ``M >= 4K`` shaded."""
    from matplotlib.ticker import FixedLocator, NullLocator

    hi = max(all_m) if all_m else 4 * chosen_k
    for ax in (ax_bubble, ax_tput):
        ax.set_xscale("log", base=2)
        ax.axvspan(4 * chosen_k, max(hi, 4 * chosen_k) * 1.5, color="#55A868", alpha=0.08)
        ax.axvline(4 * chosen_k, color="#55A868", linewidth=1.0)
        ticks = sorted(all_m | {4 * chosen_k})
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticks(ticks, [str(m) for m in ticks], fontsize=7)
        # Always show the rule-of-thumb line, even when the batch cannot reach M = 4K.
        ax.set_xlim(min(all_m, default=1) / 1.3, max(hi, 4 * chosen_k) * 1.3)
        ax.set_xlabel("micro-batches M (log scale)")
        ax.grid(color="#EEEEEE", linewidth=0.5)
    # Label the rule just left of its line, inside the axes whatever the range of M.
    ax_bubble.text(
        4 * chosen_k,
        0.98,
        f"M >= 4K = {4 * chosen_k} ",
        transform=ax_bubble.get_xaxis_transform(),
        ha="right",
        va="top",
        fontsize=8,
        color="#2F7A3F",
    )


def _label_axes(ax_bubble: Any, ax_tput: Any, batch_size: Any) -> None:
    """The panels' y ranges, labels, titles and legends."""
    ax_bubble.set_ylim(0, 1)
    ax_bubble.set_ylabel("idle (bubble) fraction")
    ax_bubble.set_title("bubble vs micro-batches", fontsize=10)
    ax_tput.set_ylabel("samples / s (simulated)")
    ax_tput.set_ylim(bottom=0)
    ax_tput.set_title(f"throughput vs micro-batches (batch {batch_size})", fontsize=10)
    ax_bubble.legend(fontsize=7, loc="lower left")
    ax_tput.legend(fontsize=7, loc="lower right")


def _colors(n: int) -> list[Any]:
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    return [cmap(0.15 + 0.7 * i / max(n - 1, 1)) for i in range(n)]


def plot_bubble(
    data: dict[str, Any], out: str | Path, formats: Sequence[str] = ("png",)
) -> list[Path]:
    """Write the bubble-vs-M figure to ``out.<fmt>``. Returns the paths."""
    return save(bubble_figure(data), out, formats)

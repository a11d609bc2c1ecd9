"""Stage balance: per-stage time and memory for autopipe's plan beside the baselines.

Top row: seconds per micro-batch per stage, stacked forward / recompute / backward / send,
with the bottleneck stage's time as a dashed line. Bottom row: bytes per stage, stacked
parameters / gradients+optimizer / activations, with the device limit as a red line. One
column per strategy (autopipe, uniform, parameters), y axes shared along each row so bar
heights compare across strategies.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autopipe.core.humanize import format_seconds
from autopipe.viz.style import HEADROOM, MEMORY_COLORS, PHASE_COLORS, byte_unit, new_figure, save

_TIME_PARTS = (
    ("forward", "forward_s"),
    ("recompute", "recompute_s"),
    ("backward", "backward_s"),
    ("send", "send_s"),
)
_MEMORY_PARTS = (
    ("parameters", "parameter_bytes"),
    ("gradients + optimizer", "optimizer_bytes"),
    ("activations", "activation_bytes"),
)


def balance_figure(data: dict[str, Any]) -> Any:
    """The balance figure from :func:`autopipe.viz.data.balance_data`'s dict."""
    strategies = [s for s in data["strategies"] if s.get("stages")]
    n = len(strategies)
    fig = new_figure(max(4.2 * n, 6.0), 6.4)
    axes = fig.subplots(2, n, sharey="row", squeeze=False)
    limit = data.get("memory_limit_bytes")
    biggest = max(
        [float(st.get("memory_bytes", 0)) for s in strategies for st in s["stages"]]
        + [float(limit or 0)]
    )
    unit_name, unit = byte_unit(biggest)
    tallest_ms, tallest_mem = 0.0, biggest / unit
    for col, strat in enumerate(strategies):
        ax_t, ax_m = axes[0, col], axes[1, col]
        stages = strat["stages"]
        xs = list(range(len(stages)))
        bottom = [0.0] * len(stages)
        for name, key in _TIME_PARTS:
            vals = [1e3 * float(s.get(key, 0.0)) for s in stages]
            if any(vals):
                ax_t.bar(xs, vals, bottom=bottom, color=PHASE_COLORS[name], label=name, width=0.75)
                bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        bottleneck = max(bottom, default=0.0)
        tallest_ms = max(tallest_ms, bottleneck)
        ax_t.axhline(bottleneck, color="black", linestyle="--", linewidth=0.8)
        title = strat["name"]
        if strat.get("iteration_time_s"):
            title += f": iteration {format_seconds(float(strat['iteration_time_s']))}"
        if strat.get("microbatches"):
            title += f", M={strat['microbatches']}"
        if not strat.get("feasible", True):
            title += " (does not fit memory)"
        ax_t.set_title(title, fontsize=10)
        bottom = [0.0] * len(stages)
        for name, key in _MEMORY_PARTS:
            vals = [float(s.get(key, 0)) / unit for s in stages]
            if any(vals):
                ax_m.bar(xs, vals, bottom=bottom, color=MEMORY_COLORS[name], label=name, width=0.75)
                bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        tallest_mem = max([tallest_mem, *bottom])
        if limit:
            ax_m.axhline(float(limit) / unit, color="#C44E52", linewidth=1.5, label="device limit")
        for ax in (ax_t, ax_m):
            ax.set_xticks(xs, [str(x) for x in xs], fontsize=8)
            ax.set_xlabel("stage")
            ax.grid(axis="y", color="#EEEEEE", linewidth=0.5)
            ax.set_axisbelow(True)
        if col == 0:
            ax_t.set_ylabel("ms per micro-batch")
            ax_m.set_ylabel(f"memory ({unit_name})")
    # The rows share their y axes: room above the tallest bar of each, so none touches the
    # frame.
    axes[0, 0].set_ylim(0, max(tallest_ms, 1e-9) * HEADROOM)
    axes[1, 0].set_ylim(0, max(tallest_mem, 1e-9) * HEADROOM)
    handles_t, labels_t = _merged_legend(axes[0])
    handles_m, labels_m = _merged_legend(axes[1])
    fig.legend(
        handles_t + handles_m,
        labels_t + labels_m,
        loc="outside lower center",
        ncol=len(labels_t) + len(labels_m),
        fontsize=8,
    )
    fig.suptitle("stage balance: time per micro-batch and memory per stage", fontsize=11)
    return fig


def _merged_legend(axes: Sequence[Any]) -> tuple[list[Any], list[str]]:
    seen: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(label, handle)
    return list(seen.values()), list(seen)


def plot_balance(
    data: dict[str, Any], out: str | Path, formats: Sequence[str] = ("png",)
) -> list[Path]:
    """Write the balance figure to ``out.<fmt>``. Returns the paths."""
    return save(balance_figure(data), out, formats)

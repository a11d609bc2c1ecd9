"""autopipe/viz/balance.py: per-stage time and memory of the plan beside the baselines."""

from __future__ import annotations

from pathlib import Path

from viz_plans import (
    _check_png,
)

from autopipe.core.plan import Plan
from autopipe.core.profile import Profile
from autopipe.viz.balance import balance_figure
from autopipe.viz.data import balance_data


def test_balance_plot(gpipe_plan: Plan, profile: Profile, tmp_path: Path) -> None:
    from autopipe.viz.balance import plot_balance

    data = balance_data(gpipe_plan, profile)
    names = [s["name"] for s in data["strategies"]]
    assert names == ["autopipe", "uniform", "parameters"]
    uniform = data["strategies"][1]
    assert [len(s) for s in [uniform["stages"]]] == [4]

    # autopipe's bottleneck is never worse than a baseline's at the same M.
    def bott(entry: dict) -> float:
        return max(
            s["forward_s"] + s["backward_s"] + s["recompute_s"] + s["send_s"]
            for s in entry["stages"]
        )

    assert all(bott(data["strategies"][0]) <= bott(e) + 1e-12 for e in data["strategies"][1:])
    fig = balance_figure(data)
    assert len(fig.axes) == 6
    # The red device-limit line is on every memory panel.
    assert fig.axes[3].get_ylabel() == "memory (GiB)"
    limit = gpipe_plan.memory_per_device / 2**30
    for ax in fig.axes[3:]:
        assert any(abs(ln.get_ydata()[0] - limit) < 1e-9 for ln in ax.get_lines())
    _check_png(plot_balance(data, tmp_path / "balance")[0])


def test_the_tallest_bars_clear_the_frame(gpipe_plan: Plan, profile: Profile) -> None:
    """Before, the first column fixed each row's shared y axis: a taller bar in a later
    column (uniform's first stage on examples/gpt.py) was cut off by the frame."""
    import copy

    data = copy.deepcopy(balance_data(gpipe_plan, profile))
    data["memory_limit_bytes"] = None  # no limit line above the bars
    for stage in data["strategies"][1]["stages"]:  # uniform: twice as tall as the rest
        for key in ("forward_s", "backward_s", "parameter_bytes", "activation_bytes"):
            stage[key] *= 2
    fig = balance_figure(data)
    for row in (fig.axes[:3], fig.axes[3:]):
        tallest = max(b.get_y() + b.get_height() for ax in row for b in ax.patches)
        lines = [ln.get_ydata()[0] for ax in row for ln in ax.get_lines()]
        assert row[0].get_ylim()[1] >= 1.05 * max([tallest, *lines])

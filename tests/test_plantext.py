"""A Plan in Python prints what the CLI prints: a one-line repr, the CLI's table as
``str(plan)`` and ``plan.summary()``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cli_errors import _saved_profile

from autopipe.cli import main
from autopipe.core.plan import Plan
from autopipe.core.profile import Profile, UnitProfile


def _gpt_like_plan() -> Plan:
    """An 8-stage plan of a 24-block model with long unit names (as a GPT's are)."""
    import autopipe

    names = ["transformer.wte", *(f"transformer.h.{i}" for i in range(24)), "lm_head"]
    units = [
        UnitProfile(name=n, forward_s=1e-3, backward_s=2e-3, parameter_bytes=4e6) for n in names
    ]
    profile = Profile(units=units, cut_bytes=[10_000] * (len(units) - 1), batch_size=16)
    return autopipe.plan(profile, autopipe.PlanRequest(gpus=8))


def test_repr_is_one_short_line() -> None:
    """Before, ``print(plan)`` spelled out every field: ~20 KB for an 8-stage GPT."""
    plan = _gpt_like_plan()
    text = repr(plan)
    assert "\n" not in text and len(text) < 200, text
    assert text.startswith("<Plan model: 8 stages, units ")
    assert "/".join(map(str, plan.balance)) in text and f"M={plan.microbatches} x " in text
    # the fields are all still there, the plan's and its report's (#37)
    assert len(plan.__class__.__dataclass_fields__) + len(plan.report.__dataclass_fields__) > 20


def test_print_and_summary_show_the_table_the_cli_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = _saved_profile(tmp_path)
    out = tmp_path / "plan.json"
    assert main(["plan", str(saved), "--gpus", "2", "--json", str(out)]) == 0
    cli_text = capsys.readouterr().out
    plan = Plan.from_dict(json.loads(out.read_text()))
    assert cli_text.startswith(str(plan) + "\n")  # then "plan written to ..."
    print(plan)
    assert capsys.readouterr().out == str(plan) + "\n"
    assert plan.summary() is None
    assert capsys.readouterr().out == str(plan) + "\n"
    assert plan.summary_text() == str(plan)
    lines = str(plan).splitlines()
    assert lines[0] == "autopipe plan: model on 2 stages (dynamic-programming cut, measured costs)"
    assert lines[2].split() == [
        "stage", "device", "modules", "(units)", "fwd", "ms", "bwd", "ms", "send", "ms",
        "ckpt", "memory", "load",
    ]  # fmt: skip

"""autopipe/cli/common.py: argument types, strict JSON output, checks before any work."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from autopipe.cli import common
from autopipe.core.errors import UsageError


@pytest.mark.parametrize(
    ("parse", "text", "expected"),
    [
        (common.positive_int, "3", 3),
        (common.nonnegative_int, "0", 0),
        (common.microbatches, "auto", "auto"),
        (common.microbatches, "8", 8),
        (common.unit_patterns, " model.layers.*, ,lm_head ", ["model.layers.*", "lm_head"]),
        (common.image_formats, "PNG, svg", ("png", "svg")),
        (common.byte_size, "80GiB", 80 * 2**30),
        (common.byte_size, "40GB", 40 * 10**9),
        (common.positive_float("seconds"), "2.5", 2.5),
    ],
)
def test_argument_types_take_good_values(parse, text: str, expected: object) -> None:  # type: ignore[no-untyped-def]
    assert parse(text) == expected


@pytest.mark.parametrize(
    ("parse", "text", "message"),
    [
        (common.positive_int, "0", "expected a positive integer, got 0"),
        (common.positive_int, "two", "expected a positive integer, got 'two'"),
        (common.nonnegative_int, "-1", "expected an integer >= 0, got -1"),
        (common.microbatches, "1.5", "expected a positive integer, got '1.5'"),
        (common.unit_patterns, " , ", "expected module-path patterns, e.g. 'model.layers.*'"),
        (common.image_formats, "png,jpg", "formats must be png and/or svg, got 'png,jpg'"),
        (common.positive_float("seconds"), "nan", "expected seconds, got 'nan'"),
        (common.positive_float("seconds"), "inf", "expected seconds, got 'inf'"),
        (common.positive_float("seconds"), "-1", "expected seconds, got '-1'"),
        (
            common.positive_float("seconds", at_most=3600),
            "7200",
            "expected seconds, got '7200': the maximum is 3600",
        ),
        (
            common.positive_float("a factor", at_least=0.5),
            "0.1",
            "expected a factor, got '0.1': the minimum is 0.5",
        ),
    ],
)
def test_argument_types_refuse_in_one_line(parse, text: str, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(argparse.ArgumentTypeError) as info:
        parse(text)
    assert str(info.value) == message


def test_json_output_is_strict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = {"a": float("nan"), "b": [1.0, float("inf"), (2, float("-inf"))], "c": "x"}
    assert common.strict_json(data) == {"a": None, "b": [1.0, None, [2, None]], "c": "x"}
    common.emit_json(data, "-")
    assert json.loads(capsys.readouterr().out) == common.strict_json(data)
    common.emit_json(data, str(tmp_path / "out.json"))
    assert json.loads((tmp_path / "out.json").read_text())["a"] is None
    common.emit_json(data, None)  # no --json: nothing written
    assert capsys.readouterr().out == ""
    common.emit_text("hello\n", str(tmp_path / "out.txt"))
    assert (tmp_path / "out.txt").read_text() == "hello\n"


def test_every_line_takes_the_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        common.set_line_prefix("[rank 1] ")
        assert common.line_prefix() == "[rank 1] "
        assert common.prefixed("a\nb") == "[rank 1] a\n[rank 1] b"
        common.say(argparse.Namespace(quiet=False, json=None), "hi")
        common.say(argparse.Namespace(quiet=True, json=None), "quiet")
        common.say(argparse.Namespace(quiet=False, json="-"), "json on stdout")
        assert capsys.readouterr().out == "[rank 1] hi\n"
    finally:
        common.set_line_prefix("")
    assert common.prefixed("a\nb") == "a\nb"


def test_output_paths_are_checked_before_any_work(tmp_path: Path) -> None:
    model = tmp_path / "model.py"
    model.write_text("")
    common.check_output_path(str(tmp_path / "new" / "deeper" / "plan.json"), "--json")
    common.check_output_path(None, "--json")
    common.check_output_path("-", "--json")
    common.check_output_path("/dev/null", "--json")
    with pytest.raises(UsageError, match=r"^--json is empty; give a path \(or - for stdout\)$"):
        common.check_output_path("", "--json")
    with pytest.raises(UsageError, match=r"^--out .* is a file; give a directory$"):
        common.check_output_path(str(model), "--out", directory=True)
    with pytest.raises(UsageError, match=r"^--json .* is a directory; give a file$"):
        common.check_output_path(str(tmp_path), "--json")
    with pytest.raises(
        UsageError, match=r"is the input .*model.py:build; writing there would destroy it"
    ):
        common.check_output_path(str(model), "--json", inputs=[f"{model}:build"])
    with pytest.raises(UsageError, match=r"model.py is a file, not a directory$"):
        common.check_output_path(str(model / "plan.json"), "--json")
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(UsageError, match="cannot write in"):
            common.check_output_path(str(locked / "plan.json"), "--json")
    left = {p.name for p in tmp_path.iterdir()}  # no probe file left, no folder made
    assert "new" not in left and not any(n.startswith(".autopipe-write-check-") for n in left)


def test_two_flags_cannot_write_one_file(tmp_path: Path) -> None:
    common.check_distinct_outputs((str(tmp_path / "a"), "--json"), (None, "--plot"), ("-", "--x"))
    with pytest.raises(UsageError, match=r"^--json and --trace both write .*a; give two paths$"):
        common.check_distinct_outputs(
            (str(tmp_path / "a"), "--json"), (str(tmp_path / "." / "a"), "--trace")
        )


def test_loaders_turn_format_errors_into_usage_errors(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"^plan file not found: .*nope.json \(write one with"):
        common.load_plan_file(str(tmp_path / "nope.json"))
    with pytest.raises(UsageError, match=r"^profile file not found: "):
        common.load_profile_file(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(UsageError, match=r"bad.json: not an autopipe plan: no 'stages' key$"):
        common.load_plan_file(str(bad))
    with pytest.raises(UsageError, match=r"bad.json: not an autopipe profile: no 'units' key$"):
        common.load_profile_file(str(bad))
    with pytest.raises(UsageError, match="^model file not found: "):
        common.load_model_arg(str(tmp_path / "none.py"))

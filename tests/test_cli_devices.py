"""Analytic planning from the CLI: one catalog device, and a mixed list in pipeline order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopipe.cli import main

GPT = str(Path(__file__).resolve().parents[1] / "examples" / "gpt.py")


def _plan(capsys: pytest.CaptureFixture[str], *flags: str) -> dict:
    assert main(["plan", GPT, "--json", "-q", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_catalog_device_sets_memory_and_names(capsys: pytest.CaptureFixture[str]) -> None:
    data = _plan(capsys, "--gpus", "4", "--device", "h100-sxm")
    assert [s["device"] for s in data["stages"]] == ["H100-SXM-80GB"] * 4
    assert data["memory_per_device"] == 80 * 10**9
    assert data["profile_mode"] == "analytic"


def test_mixed_cluster_gives_slower_devices_less_work(capsys: pytest.CaptureFixture[str]) -> None:
    data = _plan(capsys, "--gpus", "4", "--device", "a100-80gb:2,v100-32gb:2", "--dtype", "float16")
    stages = data["stages"]
    assert [s["device"] for s in stages] == ["A100-80GB"] * 2 + ["V100-32GB"] * 2
    # Same units priced on both kinds: a V100 block takes longer than an A100 block.
    blocks = {s["device"]: s for s in stages if all(u.startswith("blocks.") for u in s["units"])}
    a100, v100 = blocks["A100-80GB"], blocks["V100-32GB"]
    per_unit = lambda s: (s["forward_s"] + s["backward_s"]) / len(s["units"])  # noqa: E731
    assert per_unit(v100) > 1.1 * per_unit(a100)
    assert len(v100["units"]) <= len(a100["units"])
    assert data["memory_per_device"] == 32 * 10**9  # the smallest device's capacity


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--gpus", "4", "--device", "a100-80gb:2,v100-32gb:1"], "lists 3 devices but --gpus is 4"),
        (["--gpus", "2", "--device", "a100-80gb:x"], "expected NAME[:COUNT]"),
        (["--gpus", "2", "--device", "tpu-v9:2"], "unknown device"),
        (["--gpus", "2", "--device", "v100-32gb:2"], "no bfloat16 peak"),
    ],
)
def test_bad_device_lists_are_usage_errors(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", GPT, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message.lower() in err.lower(), err


def test_data_parallel_layout_from_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    data = _plan(capsys, "--gpus", "8", "--device", "a100-80gb", "--data-parallel", "2")
    assert (data["num_stages"], data["replicas"], data["batch_size"]) == (4, 2, 8)
    auto = _plan(capsys, "--gpus", "8", "--device", "a100-80gb", "--data-parallel", "auto")
    assert auto["num_stages"] * auto["replicas"] == 8
    best = max(r["throughput"] for r in auto["meta"]["data_parallel"])
    assert auto["throughput"] == pytest.approx(best)


def test_data_parallel_needs_a_bandwidth(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", GPT, "--gpus", "4", "--data-parallel", "auto", "--no-cache"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--allreduce-bandwidth" in err

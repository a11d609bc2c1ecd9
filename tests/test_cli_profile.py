"""autopipe/cli/profile.py: ``autopipe profile`` is flag parsing plus profile_model_file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopipe.cli import main
from autopipe.core.catalog import get_device
from autopipe.core.profile import Profile
from autopipe.device_target import DeviceTarget
from autopipe.profiling import ProfileRequest, profile_model_file


def test_the_cli_counts_what_the_library_counts(
    mlp_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "profile.json"
    args = [
        "profile",
        str(mlp_file),
        "--device",
        "a100-80gb",
        "--batch-size",
        "8",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert text.startswith("autopipe profile: mlp.py:build_model (analytic, ")
    assert text.rstrip().endswith(f"profile written to {out}")
    api = profile_model_file(
        str(mlp_file),
        DeviceTarget(counted_on=get_device("a100-80gb")),
        ProfileRequest(batch_size=8, progress=False),
    )
    cli = Profile.load(out)
    assert cli.units == api.units and cli.cut_bytes == api.cut_bytes
    assert (cli.batch_size, cli.mode, cli.model) == (8, "analytic", "mlp.py:build_model")
    assert main([*args[:-2], "--json", "-q"]) == 0
    assert Profile.from_dict(json.loads(capsys.readouterr().out)).units == api.units


def test_outputs_that_would_destroy_the_input_or_each_other_exit_2(
    mlp_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["profile", str(mlp_file), "--device", "a100-80gb", "--out", str(mlp_file)]) == 2
    assert "writing there would destroy it" in capsys.readouterr().err
    same = str(tmp_path / "p.json")
    assert (
        main(["profile", str(mlp_file), "--device", "a100-80gb", "--out", same, "--json", same])
        == 2
    )
    assert "--out and --json both write" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()

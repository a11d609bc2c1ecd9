"""Bad input gives one line on stderr, no traceback, and a non-zero exit."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopipe.cli import main

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "examples" / "gpt.py")


def _err_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    return err


def test_missing_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "no/such/model.py", "--gpus", "2"]) == 2
    assert "model file not found" in _err_line(capsys)


def test_missing_factory(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", f"{GPT}:nope", "--gpus", "2"]) == 2
    line = _err_line(capsys)
    assert "no factory function 'nope'" in line
    # Before, every function in the file's namespace was offered, imported ones too
    # (dataclass), and helpers that need an argument (num_parameters(model)).
    assert line.endswith("(factories in gpt.py: build_model, gpt_6b, gpt_7b)")


def test_factory_not_a_module(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "bad.py"
    f.write_text("def build_model():\n    return 3\n\ndef example_inputs(b=2):\n    return None\n")
    assert main(["plan", str(f), "--gpus", "2"]) == 2
    assert "returned int, not a torch.nn.Module" in _err_line(capsys)


def test_import_error_in_model_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "broken.py"
    f.write_text("import not_a_real_module_xyz\n")
    assert main(["plan", str(f), "--gpus", "2"]) == 2
    assert "ModuleNotFoundError" in _err_line(capsys)


@pytest.mark.parametrize(
    "flag",
    [
        ["--gpus", "0"],
        ["--gpus", "-3"],
        ["--gpus", "2", "--batch-size", "0"],
        ["--gpus", "2", "--memory", "-5GB"],
        ["--gpus", "2", "--microbatches", "0"],
    ],
)
def test_non_positive_numbers(flag: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", GPT, *flag])
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_bad_profile_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "p.json"
    f.write_text("{not json")
    assert main(["plan", str(f), "--gpus", "2"]) == 2
    assert "not valid JSON" in _err_line(capsys)
    f.write_text('{"units": [], "cut_bytes": [], "batch_size": 1, "version": 99}')
    assert main(["plan", str(f), "--gpus", "2"]) == 2
    assert "schema version 99" in _err_line(capsys)


def test_explain_missing_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "nowhere.json"]) == 2
    assert "plan file not found" in _err_line(capsys)


def test_output_paths_are_checked_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "file.txt"
    a_file.write_text("keep me")
    assert main(["plan", GPT, "--gpus", "2", "--plot", str(a_file)]) == 2
    assert "--plot" in _err_line(capsys)
    assert main(["plan", GPT, "--gpus", "2", "--json", str(tmp_path)]) == 2
    assert "is a directory; give a file" in _err_line(capsys)
    assert main(["profile", GPT, "--out", str(a_file / "p.json")]) == 2
    assert "is a file, not a directory" in _err_line(capsys)
    assert a_file.read_text() == "keep me"


def _saved_profile(tmp_path: Path) -> Path:
    """A hand-made 4-unit CPU profile at batch size 8."""
    from autopipe.core.profile import Profile, UnitProfile

    units = [UnitProfile(name=f"u{i}", forward_s=1e-3, backward_s=2e-3) for i in range(4)]
    saved = tmp_path / "profile.json"
    Profile(units=units, cut_bytes=[1000] * 3, batch_size=8, device="cpu").save(saved)
    return saved


def test_profiling_flags_with_a_saved_profile_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """They would be silently ignored: `plan profile.json --device a100-80gb` is no A100 plan."""
    saved = _saved_profile(tmp_path)
    assert main(["plan", str(saved), "--gpus", "2", "--device", "a100-80gb"]) == 2
    assert "--device a100-80gb applies only when profiling a model file" in _err_line(capsys)
    assert main(["plan", str(saved), "--gpus", "2", "--granularity", "node"]) == 2
    assert "--granularity applies only" in _err_line(capsys)
    # The device it was measured on is no contradiction.
    assert main(["plan", str(saved), "--gpus", "2", "--device", "cpu", "-q"]) == 0


def test_microbatches_must_divide_the_batch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = str(_saved_profile(tmp_path))
    assert main(["plan", saved, "--gpus", "2", "--microbatches", "3"]) == 2
    assert "does not divide the batch size 8" in _err_line(capsys)
    assert main(["plan", saved, "--gpus", "2", "--microbatches", "4", "-q"]) == 0


def test_missing_local_device_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", GPT, "--gpus", "2", "--device", "cuda:99"]) == 2
    assert "CUDA device(s)" in _err_line(capsys)


def test_warnings_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "warns.py"
    f.write_text(
        "import warnings\n\ndef build_model():\n    warnings.warn('first line\\nsecond')\n"
        "    return 3\n\ndef example_inputs(b=2):\n    return None\n"
    )
    assert main(["plan", str(f), "--gpus", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == "autopipe: warning: first line" and len(err) == 2, err


def test_binary_plan_or_profile_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "plan.json"
    f.write_bytes(b"\x7fELF\x02\x01\x01\x00\xd0\xff")
    assert main(["explain", str(f)]) == 2
    assert "not a JSON text file" in _err_line(capsys)
    assert main(["plan", str(f), "--gpus", "2"]) == 2
    assert "not a JSON text file" in _err_line(capsys)


OUTPUT_WITHOUT_BATCH = """\
import torch
from torch import nn


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        h = self.b(self.a(x))
        return {"y": h, "gram": h.T @ h}  # (4, 4): no batch dimension to join


def build_model():
    return M()


def example_inputs(batch_size=8):
    return torch.randn(batch_size, 4)
"""


@pytest.mark.parametrize("extra", [[], ["--device", "a100-80gb"]], ids=["measured", "analytic"])
def test_output_a_pipeline_cannot_join_is_refused_at_plan_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str]
) -> None:
    f = tmp_path / "gram.py"
    f.write_text(OUTPUT_WITHOUT_BATCH)
    assert main(["plan", str(f), "--gpus", "2", "-q", "--no-cache", *extra]) == 2
    line = _err_line(capsys)
    assert "output ['gram'] has shape (4, 4)" in line and "batch (8) as dim 0" in line


def test_every_option_of_every_command_says_what_it_does() -> None:
    """Before, ``plan --strategy`` showed only its choices in ``--help``."""
    import argparse

    from autopipe.cli import build_parser

    parser = build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    silent = [
        f"{name} {action.option_strings[-1]}"
        for name, command in sub.choices.items()
        for action in command._actions
        if action.option_strings and not action.help
    ]
    assert silent == []
    strategy = next(a for a in sub.choices["plan"]._actions if "--strategy" in a.option_strings)
    assert all(choice in (strategy.help or "") for choice in strategy.choices or ())

"""Analytic planning from the CLI: one catalog device, and a mixed list in pipeline order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopipe.cli import main

GPT = str(Path(__file__).resolve().parents[1] / "examples" / "gpt.py")


def _plan(capsys: pytest.CaptureFixture[str], *flags: str) -> dict:
    assert main(["plan", GPT, "--json", "-q", *flags]) == 0
    data = json.loads(capsys.readouterr().out)
    report = data.pop("report")
    stages = [{**s, **r} for s, r in zip(data["stages"], report.pop("stages"), strict=True)]
    return {**data, **report, "stages": stages}  # the plan and its report's figures


def test_catalog_device_sets_memory_and_names(capsys: pytest.CaptureFixture[str]) -> None:
    data = _plan(capsys, "--gpus", "4", "--device", "h100-sxm")
    assert [s["device"] for s in data["stages"]] == ["H100-SXM-80GB"] * 4
    assert data["memory_per_device"] == 81559 * 2**20  # nvidia-smi's total
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
    assert (data["num_stages"], data["data_parallel"], data["batch_size"]) == (4, 2, 8)
    auto = _plan(capsys, "--gpus", "8", "--device", "a100-80gb", "--data-parallel", "auto")
    assert auto["num_stages"] * auto["data_parallel"] == 8
    # the one data-parallel route: the mesh search with T = 1, every (K, D) a mesh row
    best = min(r["step_s"] for r in auto["mesh"]["candidates"] if r["step_s"] is not None)
    assert auto["throughput"] == pytest.approx(auto["batch_size"] * auto["data_parallel"] / best)


def test_data_parallel_needs_a_bandwidth(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", GPT, "--gpus", "4", "--data-parallel", "auto", "--no-cache"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--allreduce-bandwidth" in err


BAD_SPEC = (
    "name: mygpu\n"
    "memory_bytes: lots\n"
    "peak_flops_per_s: {bf16: fast}\n"
    "memory_bandwidth_bytes_per_s: -1\n"
    "link_bandwidth_bytes_per_s: 900GB/s\n"
    "compute_efficiency: 1.5\n"
    "flops: 3\n"
)


def test_a_bad_spec_file_is_refused_at_once_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, each bad field was refused in turn, and a spec without the dtype's peak only
    after the model was imported, built and traced (10-14 s for a large model)."""
    marker = tmp_path / "imported"
    model = tmp_path / "model.py"
    model.write_text(f"open({str(marker)!r}, 'w').close()\n" + Path(GPT).read_text())
    spec = tmp_path / "bad.yaml"
    spec.write_text(BAD_SPEC)
    assert main(["plan", str(model), "--gpus", "2", "--device-spec", str(spec)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"{spec}: 5 problems: (1) unknown field(s) flops" in err
    for problem in (
        "memory_bytes must be a size, e.g. 48GiB, 80GB or 48e9, got 'lots'",
        "peak_flops_per_s.bf16 must be a number, e.g. 312e12, got 'fast'",
        "memory_bandwidth_bytes_per_s must be positive, got -1.0",
        "compute_efficiency must be in (0, 1], got 1.5",
    ):
        assert problem in err
    assert not marker.exists()
    # A valid spec without a peak for the dtype: refused before the model file too.
    spec.write_text(
        "name: fp32-only\nmemory_bytes: 48GiB\npeak_flops_per_s: {float32: 20e12}\n"
        "memory_bandwidth_bytes_per_s: 1TB/s\nlink_bandwidth_bytes_per_s: 100GB/s\n"
    )
    assert main(["plan", str(model), "--gpus", "2", "--device-spec", str(spec)]) == 2
    err = capsys.readouterr().err.strip()
    assert "the default --dtype bfloat16: fp32-only has no bfloat16 peak" in err
    assert not marker.exists()


def test_the_example_spec_file_plans(capsys: pytest.CaptureFixture[str]) -> None:
    """examples/device-spec.yaml, which docs/devices.md shows, is a working spec."""
    example = Path(GPT).parent / "device-spec.yaml"
    data = _plan(capsys, "--gpus", "2", "--device-spec", str(example))
    assert data["profile_mode"] == "analytic"
    assert [s["device"] for s in data["stages"]] == ["my-48gb-gpu"] * 2
    assert data["memory_per_device"] == 48 * 2**30  # written 48GiB, as --memory takes it


def test_a_spec_without_inter_node_figures_is_named_plainly(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Before: "the inter-node bandwidth is the catalog has no figure for my-48gb-gpu", of
    a device that is not in the catalog at all."""
    example = Path(GPT).parent / "device-spec.yaml"
    argv = ["plan", GPT, "--gpus", "4", "--device-spec", str(example), "--shard", "auto",
            "--gpus-per-node", "2", "-q"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "the inter-node bandwidth is not known (my-48gb-gpu's spec has no " in err
    assert "inter_node_bandwidth_bytes_per_s): pass --inter-node-bandwidth" in err


@pytest.mark.parametrize(
    "flags",
    [
        ["--data-parallel", "auto"],
        ["--data-parallel", "2"],
        ["--expert-parallel", "auto"],
        ["--context-parallel", "auto"],
    ],  # fmt: skip
)
def test_a_spec_without_inter_node_figures_refuses_every_route_across_nodes(
    capsys: pytest.CaptureFixture[str], flags: list[str]
) -> None:
    """16 GPUs on the spec's nodes of 8 (its default) and no inter-node figure: data, expert
    or context parallelism is refused as --tensor-parallel is (#36), in the same one line,
    exit 2, not planned with the link between nodes priced as the one inside."""
    example = str(Path(GPT).parent / "device-spec.yaml")
    base = ["plan", GPT, "--gpus", "16", "--device-spec", example, "-q"]
    assert main([*base, "--tensor-parallel", "auto"]) == 2
    mesh = capsys.readouterr().err.strip()
    assert "spans nodes of 8 but the inter-node bandwidth is not known" in mesh
    assert main([*base, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err == mesh and len(err.splitlines()) == 1

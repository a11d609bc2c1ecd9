"""The application layer (``autopipe.profiling``, ``autopipe.device_target``, ``autopipe.placement``):
the Python API makes the same Plan as ``autopipe plan`` for the same inputs, and the CLI
resolves its device flags once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import autopipe
from autopipe.cli import main
from autopipe.core.profile import Profile
from autopipe.core.request import PlanRequest
from autopipe.device_target import DeviceTarget, resolve_devices
from autopipe.placement import Placement, plan_on_devices
from autopipe.profiling import ProfileRequest, profile_model_file

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "examples" / "gpt.py")


@pytest.fixture(scope="module")
def a100_profile() -> Profile:
    """examples/gpt.py counted for an A100 in float16, through the application layer."""
    request = ProfileRequest(dtype="float16", progress=False)
    return profile_model_file(GPT, resolve_devices("a100-80gb"), request)


def _cli_plan(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["plan", *argv, "--json", "-q"]) == 0
    data: dict[str, Any] = json.loads(capsys.readouterr().out)
    data["report"].pop("profile")  # the CLI ships the profile with the plan
    return data


def _api_plan(profile: Profile, placement: Placement) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(json.dumps(plan_on_devices(profile, placement).to_dict()))
    assert data["report"].pop("profile") is None  # only the CLI ships the profile with the plan
    return data


# The CLI's flags beside the Placement the Python API builds for them (a saved A100 profile).
CASES: list[tuple[list[str], Placement]] = [
    (["--gpus", "4"], Placement(PlanRequest(gpus=4, checkpoint="auto"), DeviceTarget())),
    (
        ["--gpus", "4", "--memory", "20GiB", "--schedule", "1f1b", "--microbatches", "8"],
        Placement(
            PlanRequest(
                gpus=4,
                memory_per_device=20 * 2**30,
                schedule="1f1b",
                microbatches=8,
                checkpoint="auto",
            ),
            DeviceTarget(),
        ),
    ),  # fmt: skip
    (
        ["--gpus", "4", "--device", "a100-80gb:2,v100-32gb:2"],
        Placement(
            PlanRequest(gpus=4, checkpoint="auto"), resolve_devices("a100-80gb:2,v100-32gb:2")
        ),
    ),
    (
        ["--gpus", "8", "--data-parallel", "2"],
        Placement(PlanRequest(gpus=8, checkpoint="auto"), DeviceTarget(), replicas=2),
    ),
    (
        ["--gpus", "4", "--tensor-parallel", "2", "--shard", "none"],
        Placement(
            PlanRequest(
                gpus=4, checkpoint="auto", tensor_parallel=2, data_parallel="auto", shard="none"
            ),
            DeviceTarget(),
        ),
    ),
]


@pytest.mark.parametrize(
    ("flags", "placement"), CASES, ids=lambda c: " ".join(c) if isinstance(c, list) else ""
)
def test_python_api_makes_the_cli_plan(
    a100_profile: Profile,
    flags: list[str],
    placement: Placement,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    saved = tmp_path / "a100.json"
    a100_profile.save(saved)
    cli = _cli_plan(capsys, str(saved), *flags)
    api = _api_plan(Profile.load(saved), placement)
    assert api == cli  # the whole plan: stages, times, memory, the request it records


def test_python_api_profiles_a_model_file_as_the_cli_does(
    a100_profile: Profile, capsys: pytest.CaptureFixture[str]
) -> None:
    """``autopipe plan MODEL.py --device NAME`` = profile_model_file + plan_on_devices."""
    devices = resolve_devices("a100-80gb")
    placement = Placement(PlanRequest(gpus=4, checkpoint="auto"), devices)
    cli = _cli_plan(capsys, GPT, "--gpus", "4", "--device", "a100-80gb", "--dtype", "float16")
    assert _api_plan(a100_profile, placement) == cli
    assert autopipe.plan_on_devices is plan_on_devices  # exported at the top


def test_the_cli_resolves_the_device_flags_once(
    a100_profile: Profile,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import autopipe.device_target as devices

    calls: list[tuple[Any, ...]] = []
    resolve = devices.resolve_devices

    def counted(*args: Any) -> DeviceTarget:
        calls.append(args)
        return resolve(*args)

    monkeypatch.setattr(devices, "resolve_devices", counted)
    saved = tmp_path / "a100.json"
    a100_profile.save(saved)
    mixed = "a100-80gb:2,v100-32gb:2"
    _cli_plan(capsys, str(saved), "--gpus", "4", "--device", mixed, "--scaling")
    assert calls == [(mixed, None)]
    calls.clear()
    _cli_plan(capsys, GPT, "--gpus", "2", "--device", "a100-80gb", "--dtype", "float16")
    assert calls == [("a100-80gb", None)]


def test_a_request_with_its_own_cluster_is_planned_on_it(a100_profile: Profile) -> None:
    """No devices resolved: the request's own cluster is kept (a shared host added to it)."""
    from autopipe.core.cluster import Cluster

    cluster = Cluster.from_catalog("v100-32gb", 3)
    request = PlanRequest(cluster=cluster, checkpoint="auto")
    placed = plan_on_devices(a100_profile, Placement(request))
    assert placed.to_dict() == autopipe.plan(a100_profile, request).to_dict()
    assert placed.num_stages == 3 and {s.device for s in placed.stages} == {"V100-32GB"}
    shared = plan_on_devices(a100_profile, Placement(request, host_throughput=1.5))
    assert shared.request.cluster is not None and shared.request.cluster.host_throughput == 1.5

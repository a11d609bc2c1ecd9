"""Device and cluster resolution as a library (``autopipe.device_target``, ``Cluster.from_catalog``):
the Python API does what ``--device`` / ``--device-spec`` do, and the CLI is a thin caller."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopipe.core.catalog import DeviceListError, DeviceSpecError, get_device
from autopipe.core.cluster import Cluster, Device
from autopipe.core.profile import Profile
from autopipe.device_target import (
    DeviceTarget,
    cluster_for,
    device_counts,
    relative_speed,
    reprice_for,
    resolve_devices,
)

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "examples" / "gpt.py")


@pytest.fixture(scope="module")
def a100_profile() -> Profile:
    """examples/gpt.py counted for an A100 in float16 (which a V100 can re-price)."""
    from autopipe.profiler.analytic import profile_analytic
    from autopipe.profiler.options import AnalyticOptions

    from autopipe.modelfile import load_model_file

    mf = load_model_file(GPT)
    profile = profile_analytic(
        mf.build(device="meta"),
        mf.inputs(mf.default_batch_size()),
        "a100-80gb",
        AnalyticOptions(dtype="float16"),
        loss_fn=mf.loss_fn,
    )
    profile.model = mf.label
    return profile


def test_resolve_every_form(tmp_path: Path) -> None:
    assert resolve_devices() == DeviceTarget()
    assert resolve_devices("cpu") == DeviceTarget(measure_on="cpu")
    assert resolve_devices("cuda:1").measure_on == "cuda:1"  # existence is the caller's check
    one = resolve_devices("a100")
    assert one.analytic and one.counted_on == get_device("a100-80gb") and not one.pipeline
    mixed = resolve_devices("a100-80gb:4,v100-32gb:4")
    assert mixed.counted_on == get_device("a100-80gb")  # counted on the first kind
    assert [(s.name, n) for s, n in mixed.pipeline] == [("A100-80GB", 4), ("V100-32GB", 4)]
    assert mixed.listed_devices == 8 and one.listed_devices is None
    spec = tmp_path / "my.yaml"
    spec.write_text("base: a100-80gb\nname: my-gpu\nmemory_bytes: 40e9\n")
    mine = resolve_devices(device_spec=spec)
    assert mine.counted_on is not None and mine.counted_on.name == "my-gpu"
    assert resolve_devices(device_spec=mine.counted_on) == mine


def test_device_lists_and_their_errors() -> None:
    assert device_counts("a100-80gb:2,v100-32gb") == [("a100-80gb", 2), ("v100-32gb", 1)]
    assert device_counts("a100-80gb:1") == [("a100-80gb", 1)]  # a list of one
    assert device_counts("a100-80gb") is None and device_counts("cuda:1") is None
    with pytest.raises(DeviceListError, match=r"^'a100:x': expected NAME\[:COUNT\]"):
        device_counts("a100:x")
    with pytest.raises(DeviceListError):  # form is checked before names are looked up
        resolve_devices("tpu-v9:2,a100:0")
    with pytest.raises(DeviceSpecError, match="unknown device 'tpu-v9'"):
        resolve_devices("a100:2,tpu-v9:2")


def test_cluster_from_catalog_forms() -> None:
    pairs = Cluster.from_catalog([("a100-80gb", 2), ("v100-32gb", 1)], memory_bytes=10**9)
    text = Cluster.from_catalog("a100-80gb:2,v100-32gb:1", memory_bytes=10**9)
    assert pairs == text
    assert [d.name for d in text.devices] == ["A100-80GB", "A100-80GB", "V100-32GB"]
    assert all(d.memory_bytes == 10**9 for d in text.devices)
    assert text.devices[0] is not text.devices[1]  # one Device per stage
    fast = Cluster.from_catalog("h100", 2, speeds={"H100-SXM-80GB": 3.0})
    assert [d.speed for d in fast.devices] == [3.0, 3.0]
    assert Cluster.from_catalog(get_device("l4")).devices == [Device.from_spec("l4")]
    with pytest.raises(DeviceSpecError, match="carries its counts"):
        Cluster.from_catalog("a100:2", 2)


def test_python_api_plans_a_mixed_cluster_as_the_cli_does(
    a100_profile: Profile, capsys: pytest.CaptureFixture[str]
) -> None:
    import autopipe
    from autopipe.cli import main

    devices = "a100-80gb:2,v100-32gb:2"
    cluster = cluster_for(a100_profile, 4, devices)
    assert cluster is not None
    speeds = [d.speed for d in cluster.devices]
    assert speeds[:2] == [1.0, 1.0] and 0 < speeds[2] == speeds[3] < 1
    assert speeds[2] == pytest.approx(relative_speed(a100_profile, "v100-32gb"))
    api = autopipe.plan(a100_profile, autopipe.PlanRequest(cluster=cluster, checkpoint="auto"))

    assert main(["plan", GPT, "--gpus", "4", "--device", devices, "--dtype", "float16"]
                + ["--json", "-q"]) == 0  # fmt: skip
    cli = json.loads(capsys.readouterr().out)
    assert [s.device for s in api.stages] == [s["device"] for s in cli["stages"]]
    assert [s.units for s in api.stages] == [s["units"] for s in cli["stages"]]
    assert api.iteration_time_s == pytest.approx(cli["report"]["iteration_time_s"], rel=1e-9)


def test_cluster_for_one_kind_and_measured_profiles(a100_profile: Profile) -> None:
    same = cluster_for(a100_profile, 3)  # the catalog device the profile was counted for
    assert same == Cluster.from_catalog("a100-80gb", 3)
    capped = cluster_for(a100_profile, 2, memory_bytes=10**9)
    assert capped is not None and all(d.memory_bytes == 10**9 for d in capped.devices)
    assert reprice_for(a100_profile, "a100") is a100_profile
    assert reprice_for(a100_profile, "v100").device == "V100-32GB"
    measured = Profile.from_dict({**a100_profile.to_dict(), "mode": "measured", "device": "cpu"})
    assert cluster_for(measured, 2) is None
    with pytest.raises(DeviceSpecError, match="needs analytic costs"):
        cluster_for(measured, 2, "a100:1,v100:1")
    with pytest.raises(DeviceSpecError, match="names 2 devices but gpus is 3"):
        cluster_for(a100_profile, 3, "a100:1,v100:1")


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({}, DeviceTarget()),
        ({"device": "cpu"}, DeviceTarget(measure_on="cpu")),
        ({"device": "cuda:3"}, DeviceTarget(measure_on="cuda:3")),  # checked when measured on
        ({"device": "a100"}, DeviceTarget(counted_on=get_device("a100-80gb"))),
        (
            {"device": "a100-80gb:2,v100-32gb:1"},
            DeviceTarget(
                counted_on=get_device("a100-80gb"),
                pipeline=((get_device("a100-80gb"), 2), (get_device("v100-32gb"), 1)),
            ),
        ),
    ],
)
def test_the_cli_resolves_every_device_flag_form_in_one_place(
    flags: dict[str, str], expected: DeviceTarget
) -> None:
    """``autopipe.cli.common.device_flags`` is the CLI's one resolver of ``--device`` /
    ``--device-spec``: what ``resolve_devices`` says, and every refusal a UsageError."""
    import argparse

    from autopipe.cli.common import UsageError, device_flags

    args = argparse.Namespace(device=flags.get("device"), device_spec=flags.get("device_spec"))
    assert device_flags(args) == expected == resolve_devices(args.device, args.device_spec)
    with pytest.raises(UsageError, match=r"^--device 'a100:x': expected NAME\[:COUNT\]"):
        device_flags(argparse.Namespace(device="a100:x", device_spec=None))
    with pytest.raises(UsageError, match="unknown device 'tpu-v9'"):
        device_flags(argparse.Namespace(device="a100:2,tpu-v9:2", device_spec=None))


def test_a_spec_file_and_a_list_resolve_together(tmp_path: Path) -> None:
    """``--device-spec FILE`` is counted on; a ``--device`` list beside it gives the kinds."""
    import argparse

    from autopipe.cli.common import UsageError, device_flags

    spec = tmp_path / "my.yaml"
    spec.write_text("base: a100-80gb\nname: my-gpu\nmemory_bytes: 40e9\n")
    both = device_flags(argparse.Namespace(device="a100:2,v100:2", device_spec=str(spec)))
    assert both.counted_on is not None and both.counted_on.name == "my-gpu"
    assert [(s.name, n) for s, n in both.pipeline] == [("A100-80GB", 2), ("V100-32GB", 2)]
    assert both.gpus_per_node is None  # a list of kinds has no one node size
    mine = device_flags(argparse.Namespace(device=None, device_spec=str(spec)))
    assert mine.counted_on is not None and mine.gpus_per_node == mine.counted_on.gpus_per_node
    with pytest.raises(UsageError):
        device_flags(argparse.Namespace(device=None, device_spec=str(tmp_path / "none.yaml")))


def test_profiled_on_names_the_measured_device_or_the_counted_one(a100_profile: Profile) -> None:
    from autopipe.device_target import profiled_on

    assert profiled_on(a100_profile, "a100") and profiled_on(a100_profile, "a100-80gb")
    assert not profiled_on(a100_profile, "h100") and not profiled_on(a100_profile, "tpu-v9")
    measured = Profile.from_dict({**a100_profile.to_dict(), "mode": "measured", "device": "cpu"})
    assert profiled_on(measured, "cpu") and not profiled_on(measured, "cuda:0")

"""Device and cluster resolution as a library (``autopipe.devices``, ``Cluster.from_catalog``):
the Python API does what ``--device`` / ``--device-spec`` do, and the CLI is a thin caller."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from autopipe.core.catalog import DeviceListError, DeviceSpecError, get_device
from autopipe.core.cluster import Cluster, Device
from autopipe.core.profile import Profile
from autopipe.devices import (
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

    from autopipe.modelfile import load_model_file

    mf = load_model_file(GPT)
    profile = profile_analytic(
        mf.build(device="meta"),
        mf.inputs(mf.default_batch_size()),
        "a100-80gb",
        dtype="float16",
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
    assert api.iteration_time_s == pytest.approx(cli["iteration_time_s"], rel=1e-9)


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


def test_layers_point_one_way() -> None:
    """The catalog holds specs only (it does not import the planner); autopipe.devices and
    the planner stay torch-free."""
    code = (
        "import sys; import autopipe.core.catalog;"
        "assert 'autopipe.planner' not in sys.modules, 'catalog imported the planner';"
        "import autopipe.devices, autopipe.planner; autopipe.planner.Cluster.from_catalog('a100', 2);"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr


def test_cli_commands_import_only_common() -> None:
    """Each command module imports ``autopipe.cli.common`` and the library, never another
    command or the package that dispatches to them."""
    folder = ROOT / "autopipe" / "cli"
    for path in folder.glob("*.py"):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "autopipe.cli":
                assert [a.name for a in node.names] == ["common"], path.name
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "autopipe.cli."
            ):
                assert node.module == "autopipe.cli.common", (path.name, node.module)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith("autopipe.cli"), (path.name, alias.name)

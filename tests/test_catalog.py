"""Device catalog: lookups, aliases, datasheet figures, spec files and their errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from autopipe.core.catalog import (
    CATALOG,
    DeviceSpec,
    DeviceSpecError,
    device_names,
    format_catalog,
    get_device,
    is_catalog_device,
    load_device_spec,
)
from autopipe.core.cluster import Cluster, Device

REQUIRED = [
    "V100-32GB",
    "A100-40GB",
    "A100-80GB",
    "H100-SXM-80GB",
    "H100-PCIe-80GB",
    "H200-141GB",
    "H800-SXM-80GB",
    "L4-24GB",
    "L40S-48GB",
    "RTX-4090-24GB",
    "MI300X-192GB",
    "cpu",
]


def test_catalog_has_required_devices_with_sources() -> None:
    assert set(REQUIRED) <= set(device_names())
    for name in REQUIRED[:-1]:
        spec = CATALOG[name]
        assert spec.source.startswith("https://"), name
        assert spec.memory_bytes > 10e9 and spec.memory_bandwidth_bytes_per_s > 100e9
        assert spec.link_name and spec.link_bandwidth_bytes_per_s > 0
        # tensor-core half precision is at least 2x plain FP32 on all of these parts
        assert spec.peak_for("float16") >= 2 * spec.peak_for("float32")


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [
        ("h100-sxm", "H100-SXM-80GB"),
        ("H100", "H100-SXM-80GB"),
        ("h100_pcie", "H100-PCIe-80GB"),
        ("a100-80gb", "A100-80GB"),
        ("a100", "A100-80GB"),
        ("A100-40GB", "A100-40GB"),
        ("mi300x", "MI300X-192GB"),
        ("RTX 4090", "RTX-4090-24GB"),
        ("h200", "H200-141GB"),
        ("l40s", "L40S-48GB"),
        ("CPU", "cpu"),
    ],
)
def test_aliases_are_case_insensitive(alias: str, canonical: str) -> None:
    assert get_device(alias).name == canonical


def test_is_catalog_device() -> None:
    assert is_catalog_device("H100-sxm") and is_catalog_device("cpu")
    assert not is_catalog_device("cuda") and not is_catalog_device("cuda:0")


def test_unknown_device_lists_valid_names() -> None:
    with pytest.raises(DeviceSpecError, match="unknown device 'b300'.*A100-80GB.*MI300X-192GB"):
        get_device("b300")
    assert issubclass(DeviceSpecError, ValueError)


def test_dense_datasheet_figures() -> None:
    # Dense (not 2:4-sparse) peaks, straight from the datasheets cited in catalog.py.
    assert get_device("a100").peak_for("bf16") == pytest.approx(312e12)
    assert get_device("a100").peak_for("fp32") == pytest.approx(19.5e12)
    assert get_device("a100").peak_for("fp32", allow_tf32=True) == pytest.approx(156e12)
    assert get_device("h100-sxm").peak_for("bfloat16") == pytest.approx(989.4e12)
    assert get_device("h100-pcie").peak_for("bfloat16") == pytest.approx(756e12)
    assert get_device("mi300x").peak_for("bf16") == pytest.approx(1307.4e12)
    assert get_device("a100-80gb").memory_bandwidth_bytes_per_s == pytest.approx(2039e9)
    assert get_device("h200").memory_bytes == 141 * 10**9
    # NVLink figures are bidirectional totals; the spec stores one direction.
    assert get_device("h100-sxm").link_bandwidth_bytes_per_s == pytest.approx(450e9)


def test_v100_has_no_bfloat16() -> None:
    with pytest.raises(DeviceSpecError, match="V100-32GB has no bfloat16 peak"):
        get_device("v100").peak_for("bf16")
    with pytest.raises(DeviceSpecError, match="unknown dtype"):
        get_device("v100").peak_for("int4")


def test_catalog_import_is_torch_free() -> None:
    code = (
        "import sys; import autopipe.core.catalog as c; c.get_device('a100'); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_load_yaml_spec(tmp_path) -> None:
    path = tmp_path / "gpu.yaml"
    path.write_text(
        "name: MyGPU\n"
        "peak_flops_per_s: {bf16: 100e12, fp32: '20e12'}\n"
        "memory_bandwidth_bytes_per_s: 1.5e12\n"
        "memory_bytes: 48e9\n"
        "link_bandwidth_bytes_per_s: 25e9\n"
        "compute_efficiency: 0.5\n"
    )
    spec = load_device_spec(path)
    assert spec.name == "MyGPU"
    assert spec.peak_for("bfloat16") == 100e12 and spec.peak_for("float32") == 20e12
    assert spec.memory_bytes == 48 * 10**9 and spec.compute_efficiency == 0.5
    assert spec.memory_efficiency == CATALOG["A100-80GB"].memory_efficiency


def test_load_json_spec_with_base(tmp_path) -> None:
    path = tmp_path / "gpu.json"
    path.write_text(
        json.dumps(
            {"base": "a100-80gb", "name": "A100-slow-link", "link_bandwidth_bytes_per_s": 16e9}
        )
    )
    spec = load_device_spec(path)
    assert spec.name == "A100-slow-link"
    assert spec.link_bandwidth_bytes_per_s == 16e9
    assert spec.peak_for("bf16") == 312e12


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("name: X\nmemory_bytes: 1e9\n", "missing required field.*peak_flops_per_s"),
        (
            "name: X\npeak_flops_per_s: {bf16: fast}\nmemory_bandwidth_bytes_per_s: 1\n"
            "memory_bytes: 1\nlink_bandwidth_bytes_per_s: 1\n",
            "peak_flops_per_s.bf16 must be a number",
        ),
        (
            "name: X\npeak_flops_per_s: {bf16: 1e12}\nmemory_bandwidth_bytes_per_s: -1\n"
            "memory_bytes: 1\nlink_bandwidth_bytes_per_s: 1\n",
            "memory_bandwidth_bytes_per_s must be positive",
        ),
        (
            "base: a100\nname: X\ncompute_efficiency: 1.5\n",
            r"compute_efficiency must be in \(0, 1\]",
        ),
        ("base: a100\nname: X\nlink_latency_s: nan\n", "link_latency_s must be >= 0"),
        ("base: a100\nname: X\nflops: 3\n", "unknown field.*flops"),
        ("base: a100\npeak_flops_per_s: {int3: 1}\n", "unknown dtype 'int3'"),
        ("- just\n- a list\n", "expected a mapping"),
        ("name: [unclosed\n", "not valid YAML"),
        ("base: tpu-v9\n", "unknown device 'tpu-v9'"),
    ],
)
def test_spec_file_errors(tmp_path, text: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(DeviceSpecError, match=message):
        load_device_spec(path)


def test_spec_file_missing_and_bad_json(tmp_path) -> None:
    with pytest.raises(DeviceSpecError, match="cannot read device spec"):
        load_device_spec(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DeviceSpecError, match="not valid JSON"):
        load_device_spec(bad)


def test_planner_device_and_cluster() -> None:
    device = Device.from_spec("a100-80gb")
    assert isinstance(device, Device)
    assert device.memory_bytes == 81920 * 2**20  # the driver-reported total (REPORTED_MIB)
    assert device.link_bandwidth_bytes_per_s == 300e9
    cluster = Cluster.from_catalog("h100-sxm", 8, memory_bytes=70 * 10**9)
    assert isinstance(cluster, Cluster) and len(cluster) == 8
    assert all(d.memory_bytes == 70 * 10**9 for d in cluster.devices)
    with pytest.raises(DeviceSpecError, match="count must be >= 1"):
        Cluster.from_catalog("a100", 0)


def test_with_efficiency_validates() -> None:
    spec = get_device("l4").with_efficiency(compute=0.5, memory=0.9)
    assert isinstance(spec, DeviceSpec) and spec.compute_efficiency == 0.5
    assert get_device("l4").compute_efficiency != 0.5  # the catalog entry is untouched
    with pytest.raises(DeviceSpecError, match="memory_efficiency must be in"):
        get_device("l4").with_efficiency(memory=0)


def test_format_catalog_lists_every_device() -> None:
    text = format_catalog()
    lines = text.splitlines()
    assert lines[0].split()[0] == "device"
    for name in REQUIRED:
        assert any(line.startswith(name + " ") for line in lines), name
    h100 = next(line for line in lines if line.startswith("H100-SXM-80GB "))
    assert "989.4" in h100 and "3350" in h100 and "450" in h100
    v100 = next(line for line in lines if line.startswith("V100-32GB "))
    assert v100.split()[1] == "-"  # no bf16 on Volta


def test_spec_quantities_are_written_as_the_flags_take_them(tmp_path) -> None:
    """Before, ``memory_bytes: 48GiB`` was refused although ``--memory 48GiB`` is taken."""
    path = tmp_path / "gpu.yaml"
    path.write_text(
        "base: a100-80gb\nname: X\nmemory_bytes: 48GiB\n"
        "memory_bandwidth_bytes_per_s: 2TB/s\nlink_bandwidth_bytes_per_s: '25e9'\n"
        "peak_flops_per_s: {bf16: '100e12'}\n"
    )
    spec = load_device_spec(path)
    assert spec.memory_bytes == 48 * 2**30 and isinstance(spec.memory_bytes, int)
    assert spec.memory_bandwidth_bytes_per_s == 2e12
    assert spec.link_bandwidth_bytes_per_s == 25e9
    assert spec.peak_flops_per_s == {"bfloat16": 100e12}
    path.write_text("base: a100-80gb\nname: X\nmemory_bytes: 48GiB/s\ncompute_efficiency: 70%\n")
    with pytest.raises(DeviceSpecError) as info:
        load_device_spec(path)
    assert str(info.value) == (
        f"{path}: 2 problems: (1) compute_efficiency must be a number, e.g. 0.7, got '70%'; "
        "(2) memory_bytes must be a size, e.g. 48GiB, 80GB or 48e9, got '48GiB/s'"
    )


def test_spec_bandwidths_tell_bits_from_bytes(tmp_path) -> None:
    """Before, ``400Gb/s`` in a spec file read as 400 GB/s (the unit lower-cased), 8x."""
    path = tmp_path / "gpu.yaml"
    path.write_text(
        "base: a100-80gb\nname: X\nlink_bandwidth_bytes_per_s: 200Gbit/s\n"
        "inter_node_bandwidth_bytes_per_s: 400Gb/s\nmemory_bandwidth_bytes_per_s: 2TB\n"
    )
    spec = load_device_spec(path)
    assert spec.link_bandwidth_bytes_per_s == 25e9
    assert spec.inter_node_bandwidth_bytes_per_s == 50e9
    assert spec.memory_bandwidth_bytes_per_s == 2e12
    path.write_text("base: a100-80gb\nname: X\ninter_node_bandwidth_bytes_per_s: 400gb/s\n")
    with pytest.raises(DeviceSpecError, match="ambiguous or unknown bandwidth unit 'gb/s'") as info:
        load_device_spec(path)
    assert "\n" not in str(info.value)
    # Before: "link_bandwidth_bytes_per_s must be a size" for a value of the wrong type.
    path.write_text("base: a100-80gb\nname: X\nlink_bandwidth_bytes_per_s: [1, 2]\n")
    with pytest.raises(DeviceSpecError) as info:
        load_device_spec(path)
    assert str(info.value).endswith(
        "link_bandwidth_bytes_per_s must be a bandwidth, e.g. 900GB/s or 9e11, got [1, 2]"
    )

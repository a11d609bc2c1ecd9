"""benchmarks/gpu_check.py --dry-run: the GPU check's code path on the CPU, so it does not rot
before a GPU runs it."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def test_gpu_check_dry_run_produces_every_row(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    spec = importlib.util.spec_from_file_location("_gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gpu_check  # dataclasses look their module up
    spec.loader.exec_module(gpu_check)
    out = tmp_path / "rows.json"
    code = gpu_check.main(["--dry-run", "--json", str(out)])
    table = capsys.readouterr().out
    rows = {r["check"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == [
        "profile sum vs whole",
        "unit peak memory",
        "whole-model peak memory",
        "analytic vs measured",
        "parallelize 2 stages",
        "parallelize memory",
        "copy-stream overlap",
        "context parallel attention",
    ]
    assert all(r["status"] != "error" for r in rows.values()), table
    # what the CPU can do is computed and judged; what needs CUDA says why it skipped
    for name in ("profile sum vs whole", "analytic vs measured", "parallelize 2 stages"):
        assert rows[name]["status"] in ("pass", "fail") and math.isfinite(rows[name]["error"])
    for name in ("unit peak memory", "whole-model peak memory", "parallelize memory"):
        assert (
            rows[name]["status"] == "skip"
            and "CPU" in rows[name]["note"]
            or "cuda" in rows[name]["note"]
        )
    assert rows["copy-stream overlap"]["note"] == "skipped: needs two GPUs"
    cp = rows["context parallel attention"]  # 2 gloo ranks: the runtime's CP step, exact
    assert cp["status"] == "pass" and cp["error"] < 1e-12, cp
    assert code == (0 if all(r["status"] in ("pass", "skip") for r in rows.values()) else 1)
    assert "autopipe GPU check on CPU dry run" in table and "PASS" in table


def test_gpu_check_finds_the_catalog_entry_by_device_name(monkeypatch) -> None:  # noqa: ANN001
    import torch

    spec = importlib.util.spec_from_file_location("_gpu_check_names", SCRIPT)
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gpu_check
    spec.loader.exec_module(gpu_check)
    cuda = torch.device("cuda", 0)
    expected = {
        "NVIDIA H200": "H200-141GB",
        "NVIDIA H100 80GB HBM3": "H100-SXM-80GB",
        "NVIDIA H100 PCIe": "H100-PCIe-80GB",
        "NVIDIA A100-SXM4-40GB": "A100-40GB",
        "NVIDIA A100 80GB PCIe": "A100-80GB",
        "Tesla V100-SXM2-32GB": "V100-32GB",
        "NVIDIA GeForce RTX 4090": "RTX-4090-24GB",
        "NVIDIA L40S": "L40S-48GB",
        "NVIDIA L4": "L4-24GB",
    }
    for name, entry in expected.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        found, how = gpu_check.catalog_entry(cuda)
        assert found.name.lower() == entry.lower(), (name, found.name)
        assert "matched" in how

    class Props:
        total_memory = 24 * 10**9

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA RTX A5000")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: Props())
    found, how = gpu_check.catalog_entry(cuda)
    assert "nearest in memory" in how and found.memory_bytes == 24 * 10**9

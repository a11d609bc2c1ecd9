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
    assert code == (0 if all(r["status"] in ("pass", "skip") for r in rows.values()) else 1)
    assert "autopipe GPU check on CPU dry run" in table and "PASS" in table

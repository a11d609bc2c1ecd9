"""The mesh zoo (issue 33): Hugging Face families with a tensor-parallel plan, each planned by
autopipe for four 4-process meshes and trained 3 steps under its distributed runtime, every
parameter compared with one process.

Families (tests/mesh_zoo_models.py, tiny configs, random seeded weights): Llama, a
tied-embedding Llama, a large-vocabulary Llama (cut before its head), Mistral, Qwen2, Qwen3
(q/k norms), Granite, OLMo-2, Phi-3, GLM-4, Gemma-2, Gemma-3, Cohere with q/k norms,
Mixtral, Qwen3-MoE and DeepSeek-V3. Meshes (tests/mesh_zoo_run.py ``MESHES``): PP 2 x TP 2
(1F1B), TP 2 x FSDP2 2, PP 2 x D 2 with ZeRO-1, PP 2 x TP 2 interleaved 1F1B (2 chunks per
rank). Each case trains SGD, then AdamW from the same weights, in float64 (why: the
``DTYPE`` note in mesh_zoo_run.py), and compares the update over lr of every parameter with
the plain model trained on the same global batch (rtol 1e-4, atol 1e-5). :data:`BF16_CASES`
train in bfloat16 parameters against one process in bfloat16, SGD with labels, within a
bound set by bfloat16's rounding (``BF16_GRADIENT_RTOL`` in mesh_zoo_run.py says why; rtol
1e-4 is below bfloat16's resolution, 2^-8).

All cases share one torchrun launch of 4 gloo processes (start-up is the cost); a case that
fails or hangs does not take the rest with it (bounded timeouts, a fresh process group after
an asymmetric failure, and here a fresh launch for the cases after one that killed the
launch). :data:`EXPECTED` is today's outcome of every case that is not ``equal``: the bug
list of issue 33. A fix that makes a case equal fails this test until its row is deleted,
so the table stays true. ``pytest -s`` prints the whole table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mesh_zoo_models  # noqa: E402
import mesh_zoo_run  # noqa: E402
from distributed_cases import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "tests" / "mesh_zoo_run.py"
FAMILIES = [
    "llama",
    "llama_tied",
    "llama_big_vocab",
    "mistral",
    "qwen2",
    "qwen3",
    "granite",
    "olmo2",
    "phi3",
    "glm4",
    "gemma2",
    "gemma3",
    "cohere_qk_norm",
    "mixtral",
    "qwen3_moe",
    "deepseek_v3",
]
MESHES = list(mesh_zoo_run.MESHES)
BF16_CASES = [
    "llama:pp2d2zero1:bfloat16",
    "qwen3:pp2tp2:bfloat16",
    "cohere_qk_norm:tp2fsdp2:bfloat16",
    "cohere_qk_norm:pp2v2tp2:bfloat16",
]
"""bfloat16 parameters (mesh and one process alike), one case per mesh, in the same launch:
SGD at lr 1 within mesh_zoo_run.py's ``BF16_GRADIENT_RTOL`` (why that bound, and why not
AdamW: its docstring)."""
CASES = [f"{family}:{mesh}" for family in FAMILIES for mesh in MESHES] + BF16_CASES
LAUNCH_TIMEOUT_S = 1800
"""One launch's limit; a launch that runs past it is killed and the rest relaunched."""

EXPECTED: dict[str, tuple[str, str]] = {}
"""Case -> (outcome, a phrase of its reason) for every case that is not ``equal`` today.
Outcomes (mesh_zoo_run.py): ``differs`` (silently wrong), ``refused-plan`` (the planner
refuses: acceptable), ``refused-start`` (the runtime refuses after the planner planned),
``fails-start`` / ``fails-step`` (an error building / training)."""


def _launch(out: Path, cases: list[str]) -> subprocess.CompletedProcess[str] | None:
    """One torchrun launch of ``cases``; None when it ran past :data:`LAUNCH_TIMEOUT_S`."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
        "--master-port", str(free_port()), str(RUN), str(out), *cases,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONHASHSEED": "0", "AUTOPIPE_CACHE_DIR": str(out / "cache")}
    try:
        return subprocess.run(
            command, capture_output=True, text=True, cwd=ROOT, timeout=LAUNCH_TIMEOUT_S, env=env
        )
    except subprocess.TimeoutExpired:
        return None


def run_cases(out: Path, cases: list[str]) -> tuple[dict[str, dict[str, Any]], float]:
    """Every case's result, and the wall time of the launches. A launch that dies or hangs
    marks the first case without a result ``fails-launch`` and the rest are launched again."""
    results: dict[str, dict[str, Any]] = {}
    todo = list(cases)
    t0 = time.monotonic()
    launch = 0
    while todo:
        launch += 1
        done = _launch(out, todo)
        log = "" if done is None else done.stdout + done.stderr
        (out / f"launch{launch}.log").write_text(log)
        for case in list(todo):
            path = mesh_zoo_run.result_path(out, case)
            if not path.exists():
                break
            results[case] = json.loads(path.read_text())
            todo.remove(case)
        if todo:
            # The launch ended (or hung) inside todo[0]: that case's root cause is the log's.
            case = todo.pop(0)
            tail = [line for line in log.splitlines() if line.strip()][-1:] or ["(no output)"]
            why = "hung past the launch timeout" if done is None else tail[0]
            results[case] = {"case": case, "outcome": "fails-launch", "reason": why[:300]}
    return results, time.monotonic() - t0


def table(results: dict[str, dict[str, Any]]) -> str:
    """Family x mesh -> outcome (reason), as markdown."""
    lines = ["| family | " + " | ".join(MESHES) + " |", "|---" * (len(MESHES) + 1) + "|"]
    for family in FAMILIES:
        cells = []
        for mesh in MESHES:
            r = results.get(f"{family}:{mesh}", {"outcome": "not run"})
            cell = r["outcome"] + (f" ({r['reason']})" if r.get("reason") else "")
            cells.append(cell.replace("|", "/"))
        lines.append(f"| {family} | " + " | ".join(cells) + " |")
    for case in BF16_CASES:
        r = results.get(case, {"outcome": "not run"})
        sgd = r.get("sgd", {})
        figures = (
            f"SGD: error up to {sgd['max_relative']:.3g} of a parameter's largest update, "
            f"{sgd['gradient_relative']:.3g} beyond its own bf16 roundings"
            if sgd
            else r.get("reason") or ""
        )
        lines.append(f"| {case} | {r['outcome']} ({figures}) |")
    return "\n".join(lines)


@pytest.mark.slow
def test_every_mesh_case_has_its_expected_outcome(tmp_path: Path) -> None:
    results, wall_s = run_cases(tmp_path, CASES)
    (tmp_path / "table.md").write_text(table(results))
    print(f"\nmesh zoo: {len(CASES)} cases in {wall_s:.0f} s\n{table(results)}")
    wrong = []
    for case in CASES:
        got = results[case]
        outcome, phrase = EXPECTED.get(case, ("equal", ""))
        if got["outcome"] != outcome or phrase not in (got.get("reason") or ""):
            wrong.append(
                f"{case}: expected {outcome} ({phrase}), got {got['outcome']} ({got.get('reason')})"
            )
    assert not wrong, "\n".join(wrong)


def test_the_zoo_is_the_issues() -> None:
    """At least 15 families, each with a Hugging Face TP plan T = 2 divides, and the table's
    rows name real cases."""
    assert len(FAMILIES) >= 15 and set(FAMILIES) <= set(mesh_zoo_models.FAMILIES)
    for family in FAMILIES:
        config: Any = mesh_zoo_models.build(family).config
        assert config.base_model_tp_plan, family
        assert config.num_attention_heads % 2 == 0, family
    assert set(EXPECTED) <= set(CASES)
    assert all(outcome != "equal" for outcome, _ in EXPECTED.values())

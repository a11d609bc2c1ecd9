"""Under torchrun, a rank's one-line error also ends torchrun's own failure summary.

torchrun's agent prints a summary (``ChildFailedError``) after every worker has exited, so
nothing a worker prints can come below it. ``autopipe run`` writes its line to the error
file torchrun gives each worker (``TORCHELASTIC_ERROR_FILE``), which the summary shows as
the root cause's ``traceback :`` line, its last line of text.
"""

from __future__ import annotations

from pathlib import Path

from distributed_cases import tiny_gpt_files, torchrun_drill

MISMATCH = "autopipe run: error: the plan has 2 stages but 1 processes were launched"


def test_the_error_line_ends_torchruns_failure_summary(tmp_path: Path) -> None:
    model, plan = tiny_gpt_files(tmp_path)  # a 2-stage plan, launched on 1 process
    drill = torchrun_drill(1, [str(model), "--plan", str(plan), "--timeout", "30"])
    assert drill.code != 0, drill.output
    lines = [line.strip() for line in drill.output.splitlines() if line.strip()]
    # The rank's own line, as before ...
    assert any(line.startswith(f"[rank 0] {MISMATCH}") for line in lines), drill.output
    # ... and, after the agent's traceback, the summary's root cause names it, instead of
    # torch's "To enable traceback see: ..." hint.
    root = max(i for i, line in enumerate(lines) if line.startswith("Root Cause"))
    assert lines[-1].strip("=") == "", lines[-3:]  # the summary's closing rule
    assert lines[-2].startswith(f"traceback : {MISMATCH}"), lines[root:]
    assert not any("To enable traceback" in line for line in lines[root:]), lines[root:]

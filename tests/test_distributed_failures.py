"""`autopipe run` ends with a clear error on every rank, never a hang: plan/world-size mismatch,
a killed rank, a stuck rank (process-group timeout).

Ranks are started directly with torchrun's environment variables (no torchrun agent that
would kill the survivors for us), so these tests check the runtime's own behaviour.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from distributed_cases import free_port, make_plan, rank_env, tiny_gpt_files

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def files(tmp_path: Path) -> tuple[Path, Path]:
    return tiny_gpt_files(tmp_path)


def _launch(
    world_size: int, argv: list[str], env_extra: dict | None = None
) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, **rank_env(rank, world_size, port), OMP_NUM_THREADS="1")
        env.update(env_extra or {})
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "autopipe.cli_run", "run", *argv],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=ROOT,
            )
        )
    return procs


def _finish(proc: subprocess.Popen, timeout_s: float) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"rank did not exit within {timeout_s} s (hang)")
    return proc.returncode, out, err


def _wait_for_step(proc: subprocess.Popen, step: int, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(f"step {step}/"):
            return
        if time.monotonic() > deadline:
            break
    pytest.fail(f"the last stage never printed step {step}")


def test_plan_world_size_mismatch_fails_on_every_rank(files: tuple[Path, Path]) -> None:
    model, plan = files
    procs = _launch(3, [str(model), "--plan", str(plan), "--timeout", "30"])
    for rank, proc in enumerate(procs):
        code, _, err = _finish(proc, 60)
        assert code == 2, err
        assert f"rank {rank}: the plan has 2 stages but 3 processes were launched" in err
        assert "Traceback" not in err


def test_killed_rank_ends_the_survivor_with_a_clear_error(files: tuple[Path, Path]) -> None:
    model, plan = files
    procs = _launch(2, [str(model), "--plan", str(plan), "--steps", "100000", "--timeout", "30"])
    try:
        _wait_for_step(procs[1], 2)
        killed = time.monotonic()
        procs[1].kill()
        code, _, err = _finish(procs[0], 30)
        elapsed = time.monotonic() - killed
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    assert code == 1, err
    assert "rank 0 (stage 0, replica 0): the pipeline broke in step" in err
    assert "a peer rank failed" in err
    assert elapsed < 30  # the closed connection is noticed at once, well before the timeout


@pytest.mark.slow
def test_stuck_rank_times_out_instead_of_hanging(files: tuple[Path, Path]) -> None:
    model, plan = files
    timeout_s = 5
    procs = _launch(
        2, [str(model), "--plan", str(plan), "--steps", "100000", "--timeout", str(timeout_s)]
    )
    try:
        _wait_for_step(procs[1], 2)
        procs[0].send_signal(signal.SIGSTOP)  # alive but silent
        stopped = time.monotonic()
        code, _, err = _finish(procs[1], 60)
        elapsed = time.monotonic() - stopped
    finally:
        for p in procs:
            p.kill()  # SIGKILL also ends a stopped process
            p.communicate()
    assert code == 1, err
    assert "rank 1 (stage 1, replica 0): the pipeline broke" in err
    assert "timed out" in err.lower()
    assert timeout_s - 1 <= elapsed < timeout_s + 30


FAILING_MODEL = """\
import torch
from torch import nn

calls = [0]


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))


def example_inputs(batch_size=4):
    return torch.randn(batch_size, 4, generator=torch.Generator().manual_seed(0))


def loss_fn(output, inputs):
    calls[0] += 1
    if calls[0] == 4:  # in step 2 (step 1 also runs the loss once to infer shapes)
        raise ValueError("the loss broke on purpose")
    return output.pow(2).mean()
"""


@pytest.mark.slow
def test_error_in_a_stage_is_reported_by_that_rank_and_its_peer(tmp_path: Path) -> None:
    model = tmp_path / "breaks.py"
    model.write_text(FAILING_MODEL)
    plan = tmp_path / "plan.json"
    make_plan([["0", "1"], ["2"]], 1, 4).save(plan)
    procs = _launch(2, [str(model), "--plan", str(plan), "--steps", "10", "--timeout", "30"])
    (code0, _, err0), (code1, _, err1) = [_finish(p, 60) for p in procs]
    assert code1 == 1 and "ValueError: the loss broke on purpose" in err1, err1
    assert code0 == 1 and "rank 0 (stage 0, replica 0): the pipeline broke" in err0, err0

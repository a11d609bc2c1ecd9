"""`autopipe run` ends with a clear error on every rank, never a hang: plan/world-size mismatch,
a plan made for another model, a killed rank, an error in a stage. (Stuck ranks, with and without data parallelism, are
drilled under torchrun in test_faults_drills.py: torchrun cannot end a hang, so those drills
check the runtime's own timeouts.)

Ranks are started directly with torchrun's environment variables (no torchrun agent that
would kill the survivors for us), so these tests check the runtime's own behaviour.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
from distributed_cases import finish, launch_ranks, make_plan, tiny_gpt_files, wait_for_step


@pytest.fixture()
def files(tmp_path: Path) -> tuple[Path, Path]:
    return tiny_gpt_files(tmp_path)


TIMEOUT_S = 60.0
"""--timeout of these runs: every fault here needs no waiting, so each rank must end well
within half of it (``finish`` waits twice it before calling the rank hung)."""


def test_plan_world_size_mismatch_fails_on_every_rank(files: tuple[Path, Path]) -> None:
    model, plan = files
    procs = launch_ranks(3, [str(model), "--plan", str(plan), "--timeout", f"{TIMEOUT_S:g}"])
    for rank, proc in enumerate(procs):
        code, _, err = finish(proc, 2 * TIMEOUT_S)
        assert code == 2, err
        assert (
            f"[rank {rank}] autopipe run: error: the plan has 2 stages but 3 processes were "
            "launched" in err
        )
        assert "Traceback" not in err


SIX_LINEAR = """\
import torch
from torch import nn

WIDTH = {width}


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(6)))


def example_inputs(batch_size=8):
    return torch.randn(batch_size, WIDTH, generator=torch.Generator().manual_seed(0))
"""


def test_plan_of_another_model_with_the_same_units_fails_on_every_rank(tmp_path: Path) -> None:
    """`autopipe run six_wide.py --plan <plan of six.py>`: the same unit names, 16x the
    parameters. Before, it trained (exit 0); now every rank refuses before building a
    stage, in one line naming the first unit whose parameters differ (exit 2)."""
    from autopipe import cli

    six, wide = tmp_path / "six.py", tmp_path / "six_wide.py"
    six.write_text(SIX_LINEAR.format(width=8))
    wide.write_text(SIX_LINEAR.format(width=32))
    plan = tmp_path / "six.plan.json"
    code = cli.main(
        ["plan", str(six), "--gpus", "2", "--batch-size", "8", "--microbatches", "2"]
        + ["--json", str(plan), "-q", "--no-cache"]
    )
    assert code == 0
    procs = launch_ranks(2, [str(wide), "--plan", str(plan), "--timeout", f"{TIMEOUT_S:g}", "-q"])
    for rank, proc in enumerate(procs):
        code, out, err = finish(proc, 2 * TIMEOUT_S)
        assert code == 2, err
        assert err == (
            f"[rank {rank}] autopipe run: error: the plan (made for six.py:build_model) is "
            "not for this model: unit '0' has 72 parameters in the plan but 1,056 in this "
            "model (Sequential); re-run `autopipe plan` on this model\n"
        )
        assert "step" not in out


def test_killed_rank_ends_the_survivor_with_a_clear_error(files: tuple[Path, Path]) -> None:
    model, plan = files
    procs = launch_ranks(
        2, [str(model), "--plan", str(plan), "--steps", "100000", "--timeout", f"{TIMEOUT_S:g}"]
    )
    try:
        wait_for_step(procs[1], 2)
        killed = time.monotonic()
        procs[1].kill()
        code, _, err = finish(procs[0], 2 * TIMEOUT_S)
        elapsed = time.monotonic() - killed
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    assert code == 1, err
    assert "rank 0 (stage 0, replica 0): the pipeline broke in step" in err
    assert "a peer rank failed" in err
    # The closed connection is noticed at once, not after the timeout.
    assert elapsed < TIMEOUT_S / 2, elapsed


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
    argv = [str(model), "--plan", str(plan), "--steps", "10", "--timeout", f"{TIMEOUT_S:g}"]
    procs = launch_ranks(2, argv)
    (code0, _, err0), (code1, _, err1) = [finish(p, 2 * TIMEOUT_S) for p in procs]
    assert code1 == 1 and "ValueError: the loss broke on purpose" in err1, err1
    assert code0 == 1 and "rank 0 (stage 0, replica 0): the pipeline broke" in err0, err0
    # the root cause, from the store rank 0 holds (no torchrun agent here)
    assert re.search(
        r"rank 1 \(stage 1, replica 0\) failed in step \d+: ValueError: the loss broke", err0
    )


def test_unreachable_master_ends_within_the_timeout_in_one_line(files: tuple[Path, Path]) -> None:
    """Rank 1 of 2 and nobody on the master's port. Before, c10d's TCPStore client retried
    for 1.6-2.3 x --timeout and printed 30-38 lines of C++ frames. The start-up before the
    wait (imports, the model file) is measured alike, not guessed: a rank outside the world
    ends right after it."""
    import os
    import subprocess
    import sys

    from distributed_cases import ROOT, free_port, rank_env

    timeout_s = 10.0
    model, plan = files

    def run(rank: int) -> tuple[subprocess.CompletedProcess[str], float]:
        env = dict(os.environ, **rank_env(rank, 2, free_port()), OMP_NUM_THREADS="1")
        start = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-m", "autopipe", "run", str(model), "--plan", str(plan),
             "--timeout", f"{timeout_s:g}"],
            env=env, capture_output=True, text=True, cwd=ROOT, timeout=10 * timeout_s,
        )  # fmt: skip
        return out, time.monotonic() - start

    outside, startup_s = run(5)
    assert outside.returncode == 2 and "RANK" in outside.stderr, outside.stderr
    out, elapsed_s = run(1)
    assert out.returncode == 1, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(
        "[rank 1] autopipe run: error: could not join the process group within 10 s: the "
        "master 127.0.0.1:"
    ), lines
    assert "is rank 0 running" in lines[0]
    assert timeout_s <= elapsed_s <= 1.5 * timeout_s + 2 * startup_s, (elapsed_s, startup_s)


def test_state_dict_of_another_model_fails_on_every_rank(
    files: tuple[Path, Path], tmp_path: Path
) -> None:
    """`autopipe run --state-dict` with the weights of a wider model. Before, the rank
    holding the tensor printed only torch's first line ("Error(s) in loading state_dict
    for Stage1:"); now every rank names the first entry that differs and both shapes."""
    import torch

    from autopipe.modelfile import load_model_file

    model, plan = files
    weights = load_model_file(str(model)).build().state_dict()
    n = weights["ln_f.weight"].shape[0]
    weights["ln_f.weight"] = torch.ones(2 * n)
    saved = tmp_path / "other.pt"
    torch.save(weights, saved)
    argv = [str(model), "--plan", str(plan), "--state-dict", str(saved), "-q"]
    procs = launch_ranks(2, [*argv, "--timeout", f"{TIMEOUT_S:g}"])
    for rank, proc in enumerate(procs):
        code, out, err = finish(proc, 2 * TIMEOUT_S)
        assert code == 2, err
        assert err == (
            f"[rank {rank}] autopipe run: error: the state_dict's 'ln_f.weight' has shape "
            f"[{2 * n}] but the model's is [{n}]; save it from the same model with "
            "model.state_dict()\n"
        )


def _wait_for_fault(proc: Any, timeout_s: float = 2 * TIMEOUT_S) -> None:
    """Read ``proc``'s stdout until the fault model says its fault fired."""
    from distributed_cases import FAULT_MARK

    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    for line in proc.stdout:
        if FAULT_MARK in line:
            return
        if time.monotonic() > deadline:
            break
    raise AssertionError("the fault never fired")


def test_sigterm_in_a_ranks_own_error_path_lets_its_line_out(tmp_path: Path) -> None:
    """torchrun stops the other ranks (SIGTERM) as soon as one exits. A rank that is
    reporting its own error when the signal comes finishes: its own line, exit 1. Before,
    the signal killed it silently (exit -15): the raising-rank drill once saw only its
    peer's "a peer rank failed" line."""
    import signal

    from distributed_cases import fault_files

    model, plan = fault_files(tmp_path)
    argv = [str(model), "--plan", str(plan), "--steps", "50", "--timeout", f"{TIMEOUT_S:g}"]
    procs = launch_ranks(2, argv, {"AUTOPIPE_FAULT": "slowraise@0", "AUTOPIPE_FAULT_SLOW_S": "3"})
    try:
        _wait_for_fault(procs[0])
        procs[0].send_signal(signal.SIGTERM)  # while its error's message is being made
        code, _, err = finish(procs[0], 2 * TIMEOUT_S)
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    assert code == 1, err
    assert err == "[rank 0] autopipe run: error: SlowError: injected fault\n"


def test_sigterm_ends_a_rank_that_is_not_failing_in_one_line(tmp_path: Path) -> None:
    """A hung rank that torchrun stops says so in one line (exit 1) within
    TERMINATION_GRACE_S, well before --timeout; before, it died silently (exit -15)."""
    import signal

    from distributed_cases import fault_files

    from autopipe.cli.run import TERMINATION_GRACE_S

    model, plan = fault_files(tmp_path)
    argv = [str(model), "--plan", str(plan), "--steps", "50", "--timeout", f"{TIMEOUT_S:g}"]
    procs = launch_ranks(2, argv, {"AUTOPIPE_FAULT": "hang@1"})
    try:
        _wait_for_fault(procs[1])
        stopped = time.monotonic()
        procs[1].send_signal(signal.SIGTERM)
        code, _, err = finish(procs[1], 2 * TIMEOUT_S)
        elapsed_s = time.monotonic() - stopped
        code0, _, err0 = finish(procs[0], 2 * TIMEOUT_S)
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    assert code == 1, err
    assert err == (
        "[rank 1] autopipe run: error: stopped by SIGTERM (torchrun stops every rank once one "
        "exits): another rank's error says why\n"
    )
    assert TERMINATION_GRACE_S <= elapsed_s < TIMEOUT_S / 2, elapsed_s
    assert code0 == 1 and "the pipeline broke in step 2" in err0, err0

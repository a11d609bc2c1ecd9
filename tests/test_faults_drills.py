"""Fault drills under torchrun: a rank hangs (with and without data parallelism), dies,
raises, produces NaN, loads another plan, or traces another graph. Each drill asserts torchrun's exit code, the
one-line message of the rank that reports it (every line carries its rank) and the time to
exit, with short timeouts so the suite stays fast.

torchrun ends the other ranks once one exits, but it cannot see a hang: the hang drills
pass only if the runtime's own timeouts end the job (issue 11, item 1: the data-parallel
groups used to wait torch's 30-minute default). The fault is injected by FAULT_MODEL
(tests/distributed_cases.py), which prints FAULT_MARK when it fires; times to exit are
measured from that line.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from distributed_cases import (
    Drill,
    fault_files,
    hash_seeds_with_other_set_orders,
    multi_stage_fault_files,
    set_order_files,
    torchrun_drill,
)

HANG_TIMEOUT_S = 5.0
"""--timeout of the drills that wait it out (a hung rank): a silent peer is an error after
this long."""

AT_ONCE_TIMEOUT_S = 60.0
"""--timeout of the drills whose fault needs no waiting (a rank dies, raises, a NaN, a
mismatch at start-up): they must end in well under half of it."""


def hang_ends_by(timeout_s: float) -> float:
    """Seconds after the fault by which a job with a hung rank has ended: the timeout, then
    reporting and torchrun stopping the others (each rank it stops has
    ``TERMINATION_GRACE_S`` to report its own error), bounded by twice the timeout again,
    never a tight figure (the suite shares 2 cores with others)."""
    return 3 * timeout_s


def at_once(timeout_s: float) -> float:
    """The bound for a fault that needs no waiting: half the timeout (a job that waited the
    timeout out would take longer than the timeout itself)."""
    return timeout_s / 2


def _run_args(
    model: Path, plan: Path, *extra: str, timeout_s: float = AT_ONCE_TIMEOUT_S
) -> list[str]:
    return [
        str(model), "--plan", str(plan), "--steps", "50", "--threads", "1",
        "--timeout", f"{timeout_s:g}", *extra,
    ]  # fmt: skip


def _error_lines(drill_output: str) -> list[str]:
    """The ranks' own error lines (torchrun's summary below them is its own)."""
    return re.findall(r"^\[rank \d+\] autopipe run: error: .*$", drill_output, re.M)


def _one_line_per_live_rank(drill: Drill, world: int, killed: Sequence[int] = ()) -> None:
    """Every rank but the ``killed`` ones ended in exactly one error line of its own (none
    was stopped silently by torchrun's SIGTERM), and nothing else of a rank's says error:
    no torch log record (``[rankN]:E...``, e.g. a schedule's action table), no traceback."""
    errors = _error_lines(drill.output)
    ranks = sorted(int(re.match(r"\[rank (\d+)\]", e).group(1)) for e in errors)  # type: ignore[union-attr]
    assert ranks == [r for r in range(world) if r not in killed], drill.output
    assert not re.search(r"^\[rank\d+\]:E", drill.output, re.M), drill.output
    ranks_own = [line for line in drill.output.splitlines() if line.startswith("[rank")]
    assert not any("Traceback" in line for line in ranks_own), drill.output


@pytest.mark.parametrize(
    ("replicas", "fault"),
    [(1, "hang@1"), (2, "hang@3")],
    ids=["K2", "K2xD2"],
)
def test_hung_rank_ends_the_job_within_the_timeout(
    tmp_path: Path, replicas: int, fault: str
) -> None:
    model, plan = fault_files(tmp_path, replicas=replicas)
    drill = torchrun_drill(
        2 * replicas,
        _run_args(model, plan, timeout_s=HANG_TIMEOUT_S),
        {"AUTOPIPE_FAULT": fault},
        deadline_s=hang_ends_by(HANG_TIMEOUT_S) + 60,
    )
    assert drill.code == 1, drill.output
    errors = _error_lines(drill.output)
    assert errors, drill.output
    assert any(
        "the pipeline broke in step 2" in e and "within the process-group timeout" in e
        for e in errors
    ), errors
    _one_line_per_live_rank(drill, 2 * replicas)
    assert drill.after_fault_s is not None
    assert 0.8 * HANG_TIMEOUT_S <= drill.after_fault_s <= hang_ends_by(HANG_TIMEOUT_S), (
        drill.after_fault_s
    )


def test_killed_rank_ends_the_job_at_once(tmp_path: Path) -> None:
    model, plan = fault_files(tmp_path)
    drill = torchrun_drill(2, _run_args(model, plan), {"AUTOPIPE_FAULT": "kill@0"})
    assert drill.code == 1, drill.output
    assert re.search(r"exitcode\s*:\s*-9", drill.output), drill.output
    _one_line_per_live_rank(drill, 2, killed=[0])
    assert drill.after_fault_s is not None
    assert drill.after_fault_s < at_once(AT_ONCE_TIMEOUT_S), drill.after_fault_s


@pytest.mark.parametrize("rank", [0, 1])
def test_raising_rank_reports_its_error_and_every_peer_names_it(tmp_path: Path, rank: int) -> None:
    """A rank's stage raises in step 2: it prints its own error, and its peer's one line
    names that rank and its error (read from the store torchrun's agent holds), whether the
    peer found the pipeline broken or was stopped by torchrun. Before, the peer said only
    "a peer rank failed or did not answer" (or "another rank's error says why")."""
    model, plan = fault_files(tmp_path)
    drill = torchrun_drill(2, _run_args(model, plan), {"AUTOPIPE_FAULT": f"raise@{rank}"})
    assert drill.code == 1, drill.output
    errors = _error_lines(drill.output)
    assert f"[rank {rank}] autopipe run: error: ValueError: injected fault" in errors
    assert "Traceback" not in "".join(drill.lines(f"[rank {rank}]"))
    _one_line_per_live_rank(drill, 2)
    peer = 1 - rank
    (line,) = [e for e in errors if e.startswith(f"[rank {peer}]")]
    assert line.endswith(
        f"rank {rank} (stage {rank}, replica 0) failed in step 2: ValueError: injected fault"
    ), line
    assert drill.after_fault_s is not None
    assert drill.after_fault_s < at_once(AT_ONCE_TIMEOUT_S), drill.after_fault_s


@pytest.mark.parametrize(
    ("schedule", "fault"),
    [
        ("interleaved-1f1b", "raise@0"),
        ("zbv", "kill@1"),
        pytest.param("interleaved-zb", "raise@1", marks=pytest.mark.slow),
        pytest.param("looped-bfs", "hang@1", marks=pytest.mark.slow),
    ],
)
def test_multi_stage_schedule_failure_is_one_line_per_rank(
    tmp_path: Path, schedule: str, fault: str
) -> None:
    """A rank raises, dies or hangs under a schedule with 2 chunks per rank. Before, every
    surviving rank printed torch's error record and the schedule's 27-line action table
    (48 lines for the two ranks) besides its own line."""
    model, plan = multi_stage_fault_files(tmp_path, schedule)
    hang = fault.startswith("hang")
    timeout_s = HANG_TIMEOUT_S if hang else AT_ONCE_TIMEOUT_S
    drill = torchrun_drill(
        2,
        _run_args(model, plan, timeout_s=timeout_s),
        {"AUTOPIPE_FAULT": fault},
        deadline_s=timeout_s + 60,
    )
    assert drill.code == 1, drill.output
    kind, _, rank = fault.partition("@")
    _one_line_per_live_rank(drill, 2, killed=[int(rank)] if kind == "kill" else [])
    assert "Step 00:" not in drill.output and "Full Schedule" not in drill.output
    errors = _error_lines(drill.output)
    if kind == "raise":
        assert f"[rank {rank}] autopipe run: error: ValueError: injected fault" in errors
    peer = 1 - int(rank)
    assert any(
        e.startswith(
            f"[rank {peer}] autopipe run: error: rank {peer} (stage {peer}, replica 0): "
            "the pipeline broke in step "
        )
        for e in errors
    ), errors
    assert drill.after_fault_s is not None
    bound = hang_ends_by(timeout_s) if hang else at_once(timeout_s)
    assert drill.after_fault_s < bound, drill.after_fault_s


def test_rank_with_another_plan_fails_every_rank_at_once(tmp_path: Path) -> None:
    """Rank 1 reads a plan with another cut and another M. Before, another cut alone trained
    another model and exited 0, another M waited out the timeout and blamed a peer; now
    every rank names the difference at start-up, in seconds."""
    model, plan0 = fault_files(tmp_path)
    _, plan1 = fault_files(tmp_path, stage_units=[["0"], ["1", "2"]], m=1)
    # One plan file per rank, as on nodes with their own copies: rank r reads plan_r.json.
    (tmp_path / "plan_0.json").write_text(plan0.read_text())
    (tmp_path / "plan_1.json").write_text(plan1.read_text())
    timeout_s = 300.0  # the default: start-up under load is far below half of it
    command = [
        "exec", shlex.quote(sys.executable), "-m", "autopipe", "run", str(model),
        "--plan", f"{tmp_path}/plan_$RANK.json", "--steps", "3", "--timeout", f"{timeout_s:g}",
    ]  # fmt: skip
    drill = torchrun_drill(2, command, shell=True, deadline_s=timeout_s + 60)
    assert drill.code == 1, drill.output  # torchrun's code; each rank exits 2 (bad input)
    errors = _error_lines(drill.output)
    assert errors, drill.output
    for line in errors:
        assert (
            "the ranks loaded different plans: microbatches is 1 on rank 1 but 2 on rank 0" in line
        ), line
        assert "stages[0].units" in line and "give every rank the same --plan file" in line
    _one_line_per_live_rank(drill, 2)
    assert drill.total_s < at_once(timeout_s), drill.total_s  # start-up, not the timeout


def test_ranks_that_trace_different_graphs_fail_every_rank_at_once(tmp_path: Path) -> None:
    """The same model file and plan on both ranks, but another PYTHONHASHSEED on each (a
    value the user set, which `python -m autopipe run` keeps): the model's forward iterates a
    set of strings, so the ranks trace different graphs. Before, plan and model fingerprints
    agreed and the run trained with the products swapped across the cut (exit 0, other
    losses than one process); now every rank refuses at start-up, well within --timeout."""
    timeout_s = 300.0  # the default: start-up under load is far below half of it
    model, plan = set_order_files(tmp_path)
    seed0, seed1 = hash_seeds_with_other_set_orders()
    command = [
        f'[ "$RANK" = 0 ] && export PYTHONHASHSEED={seed0} || export PYTHONHASHSEED={seed1};',
        "exec", shlex.quote(sys.executable), "-m", "autopipe", "run", str(model),
        "--plan", str(plan), "--steps", "3", "--timeout", f"{timeout_s:g}",
    ]  # fmt: skip
    drill = torchrun_drill(2, command, shell=True, deadline_s=timeout_s + 60)
    assert drill.code == 1, drill.output  # torchrun's code; each rank exits 2 (bad input)
    errors = _error_lines(drill.output)
    assert sorted(e[:8] for e in errors) == ["[rank 0]", "[rank 1]"], drill.output
    for line in errors:
        assert "rank 1 traced a different graph of the model than rank 0 (stage " in line, line
        assert line.endswith("set the same PYTHONHASHSEED on every rank"), line
    assert "step 1/" not in drill.output
    assert drill.total_s < at_once(timeout_s), drill.total_s  # start-up, not the timeout


def test_nan_loss_stops_every_rank_naming_the_step(tmp_path: Path) -> None:
    model, plan = fault_files(tmp_path)
    drill = torchrun_drill(2, _run_args(model, plan), {"AUTOPIPE_FAULT": "nan@0"})
    assert drill.code == 1, drill.output
    errors = _error_lines(drill.output)
    assert errors, drill.output
    assert all("the loss is nan in step 2; stopped before the optimizer step" in e for e in errors)
    assert "--allow-nonfinite" in errors[0]
    _one_line_per_live_rank(drill, 2)
    assert drill.after_fault_s is not None
    assert drill.after_fault_s < at_once(AT_ONCE_TIMEOUT_S), drill.after_fault_s


def test_allow_nonfinite_keeps_going_and_writes_strict_json(tmp_path: Path) -> None:
    model, plan = fault_files(tmp_path)
    log = tmp_path / "steps.json"
    drill = torchrun_drill(
        2,
        [*_run_args(model, plan), "--steps", "3", "--allow-nonfinite", "--json", str(log)],
        {"AUTOPIPE_FAULT": "nan@0"},
    )
    assert drill.code == 0, drill.output
    assert re.search(r"^\[rank 1\] step 3/3  loss nan", drill.output, re.M), drill.output
    text = log.read_text()
    assert "NaN" not in text
    steps = json.loads(text)["steps"]
    assert [s["loss"] is None for s in steps] == [False, True, True]


def _checkpoint(directory: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The weights saved in a torch.distributed.checkpoint folder."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(directory, tmp / "weights.pt")
    return torch.load(tmp / "weights.pt", weights_only=True)


@pytest.mark.parametrize("fault", ["kill-save@1", "hang-save@1"])
def test_rank_lost_mid_save_leaves_the_earlier_checkpoint_whole(tmp_path: Path, fault: str) -> None:
    """Rank 1 dies (or hangs) when torch.distributed.checkpoint asks it to write its files,
    over an earlier checkpoint in DIR. Before, rank 0 had already written its file in place
    and DIR loaded without error as a mix: rank 0's tensors new, rank 1's old."""
    model, plan = fault_files(tmp_path)
    ckpt = tmp_path / "ckpt"
    first = torchrun_drill(2, [*_run_args(model, plan, "--steps", "1"), "--save", str(ckpt)])
    assert first.code == 0, first.output
    old = _checkpoint(ckpt, tmp_path)
    assert len(old) == 4  # two Linear layers, one on each stage
    drill = torchrun_drill(
        2,
        [*_run_args(model, plan, "--steps", "3", timeout_s=HANG_TIMEOUT_S), "--save", str(ckpt)],
        {"AUTOPIPE_FAULT": fault},
        deadline_s=hang_ends_by(HANG_TIMEOUT_S) + 60,
    )
    assert drill.code == 1, drill.output
    _one_line_per_live_rank(drill, 2, killed=[1] if fault.startswith("kill") else [])
    assert drill.after_fault_s is not None
    assert drill.after_fault_s <= hang_ends_by(HANG_TIMEOUT_S), drill.after_fault_s
    if fault.startswith("hang"):  # rank 0 waits out the timeout and says so itself
        assert any(
            e.startswith("[rank 0] autopipe run: error: the checkpoint was not saved (")
            and e.endswith(f"{ckpt} is as it was")
            for e in _error_lines(drill.output)
        ), drill.output
    after = _checkpoint(ckpt, tmp_path)
    assert sorted(after) == sorted(old)
    assert all(torch.equal(after[name], old[name]) for name in old)
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".ckpt."))
    # Only a killed rank 0 could leave its (hidden) staging folder behind; rank 0 lived.
    assert leftovers == [], leftovers


def test_save_replaces_an_earlier_checkpoint_whole(tmp_path: Path) -> None:
    model, plan = fault_files(tmp_path)
    ckpt = tmp_path / "ckpt"
    for steps in ("1", "3"):
        drill = torchrun_drill(2, [*_run_args(model, plan, "--steps", steps), "--save", str(ckpt)])
        assert drill.code == 0, drill.output
        if steps == "1":
            old = _checkpoint(ckpt, tmp_path)
    new = _checkpoint(ckpt, tmp_path)
    assert sorted(new) == sorted(old)
    assert all(not torch.equal(new[name], old[name]) for name in old)  # every tensor trained
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".ckpt")) == []


def test_save_never_writes_through_planted_symlinks(tmp_path: Path) -> None:
    """Links planted in DIR under the names torch.distributed.checkpoint writes. Before, the
    save wrote through them into the files they point at."""
    model, plan = fault_files(tmp_path)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    victims = {
        name: tmp_path / f"victim{i}" for i, name in enumerate(("__1_0.distcp", ".metadata.tmp"))
    }
    for name, victim in victims.items():
        victim.write_text("precious")
        (ckpt / name).symlink_to(victim)
    drill = torchrun_drill(2, [*_run_args(model, plan, "--steps", "1"), "--save", str(ckpt)])
    assert drill.code == 0, drill.output
    assert all(v.read_text() == "precious" for v in victims.values())
    assert not any(p.is_symlink() for p in ckpt.iterdir())
    assert len(_checkpoint(ckpt, tmp_path)) == 4

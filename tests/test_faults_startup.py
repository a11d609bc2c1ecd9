"""Fault drills of ``autopipe run``'s start-up (issue 33): one rank fails between joining the
process group and the first step (its model factory raises, a process group cannot be
made), and every other rank's one error line names that rank and its cause, read from the
default group's c10d store, instead of "a peer rank failed" or torchrun's SIGTERM.

Under torchrun the store is its agent's, so a failing rank 0 is named like any other. Ranks
started directly with torchrun's variables (``launch_ranks``: no agent) meet on the store
rank 0 holds: when rank 0 is the rank that failed, the others say that rank 0, the store's
host, is gone (its own line names the cause), in one line of its own.

Times are bounded by ``--timeout``: every rank ends within half of it, a rank waiting for
the failed one in a new group's rendezvous included (c10d cannot interrupt that wait: a
thread watching the store ends it, ``autopipe.training.stuck_exit``).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from distributed_cases import Drill, launch_ranks, make_plan, torchrun_drill

STARTUP_TIMEOUT_S = 300.0
"""--timeout of the drills whose fault needs no waiting: the default, as start-up under
load (two ranks tracing on shared cores) is far below half of it."""

GROUP_TIMEOUT_S = 60.0
"""--timeout of the drills whose survivor waits in a group's rendezvous: it must end well
within half of it (a rank that waited it out would take longer)."""

FACTORY_ERROR = "boom.py:build_model: the factory raised RuntimeError: the factory broke on purpose"

BOOM_MODEL = """\
import os

import torch
from torch import nn

# BOOM_RANK=R: the factory raises on rank R (building the model, before tracing).
# GROUP_BOOM_RANK=R: rank R cannot make a process group (torch.distributed.new_group
# raises), after the ranks agreed on the plan, while its peers wait for it in the group's
# rendezvous. IMPORT_BOOM_RANK=R: importing this file fails on rank R, before any group.
if os.environ.get("IMPORT_BOOM_RANK") == os.environ.get("RANK"):
    raise ImportError("the model file broke on purpose")
if os.environ.get("GROUP_BOOM_RANK") == os.environ.get("RANK"):
    import torch.distributed as dist

    def _new_group(*args, **kwargs):
        raise RuntimeError("new_group broke on purpose")

    dist.new_group = _new_group


# GONE_STORE_RANK=R: rank R's factory waits until rank 0's c10d store refuses connections
# (rank 0 exited), then calls it: what a peer reading the failure board does when rank 0
# exits between its probe and its call, made certain.
def _call_the_store_once_its_host_is_gone():
    import socket
    import time

    import torch.distributed as dist

    address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            socket.create_connection(address, timeout=1.0).close()
        except OSError:
            break
        time.sleep(0.05)
    try:
        dist.distributed_c10d._get_default_store().check(["autopipe/failure/0"])
    except Exception:
        pass
    raise RuntimeError("the store was called after its host exited")


def build_model():
    if os.environ.get("BOOM_RANK") == os.environ.get("RANK"):
        raise RuntimeError("the factory broke on purpose")
    if os.environ.get("GONE_STORE_RANK") == os.environ.get("RANK"):
        _call_the_store_once_its_host_is_gone()
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))


def example_inputs(batch_size=4):
    return torch.randn(batch_size, 4, generator=torch.Generator().manual_seed(0))


def loss_fn(output, inputs):
    return output.pow(2).mean()
"""


def test_a_run_board_is_the_board_of_every_pipeline_built_in_it() -> None:
    """A rank that fails before its pipeline exists (building the model) and a peer already
    building its pipeline (which opens a board of its own outside a run) meet on one key."""
    from autopipe.runtime.distributed import failures

    with failures.run_board() as key:
        assert failures.failure_board() == key
        assert failures.failure_board() == key
    after = failures.failure_board()
    assert after != key and failures.failure_board() != after


def test_a_store_whose_host_has_exited_is_gone_before_any_store_call() -> None:
    """The probe that keeps c10d's client from printing C++ frames for a store whose host
    (rank 0 without torchrun's agent) is gone: a live TCPStore answers, a closed one does
    not, through the PrefixStore chain the default group wraps it in."""
    import gc

    import torch.distributed as dist
    from autopipe.runtime.distributed.failures import (
        _store_gone,
        on_every_rank,
        raised_on_every_rank,
    )

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False)
    chain = dist.PrefixStore("a", dist.PrefixStore("b", client))
    assert not _store_gone(chain)
    del server
    gc.collect()
    assert _store_gone(chain)
    # And what every rank raised alike is never written there, through the chain of causes.
    try:
        try:
            raise on_every_rank(ValueError("the same on every rank"))
        except ValueError as exc:
            raise RuntimeError("wrapped") from exc
    except RuntimeError as outer:
        assert raised_on_every_rank(outer)
    assert not raised_on_every_rank(RuntimeError("this rank's own"))


def _files(directory: Path, replicas: int = 1) -> tuple[Path, Path]:
    """(BOOM_MODEL file, plan): 2 stages x 1 replica, or 1 stage x 2 replicas (whose
    data-parallel group each rank makes with new_group)."""
    model = directory / "boom.py"
    model.write_text(BOOM_MODEL)
    units = [["0", "1"], ["2"]] if replicas == 1 else [["0", "1", "2"]]
    plan = make_plan(units, 2, 4)
    plan.data_parallel = replicas
    path = directory / f"plan_d{replicas}.json"
    plan.save(path)
    return model, path


def _argv(model: Path, plan: Path, timeout_s: float) -> list[str]:
    return [str(model), "--plan", str(plan), "--steps", "3", "--timeout", f"{timeout_s:g}"]


def _error_line(drill: Drill, rank: int) -> str:
    (line,) = [
        line for line in drill.lines(f"[rank {rank}] autopipe run: error: ") if line[0] == "["
    ]
    return line.rstrip("\n")


@pytest.mark.parametrize("failing", [1, 0])
def test_a_ranks_build_failure_is_named_on_every_rank(tmp_path: Path, failing: int) -> None:
    """The factory raises on one rank under torchrun. Before, the other rank said "could not
    compare plans with the other ranks: a peer rank failed or did not answer ... (Connection
    closed by peer ...)", and torchrun's summary took that line for the root cause when it
    came first."""
    model, plan = _files(tmp_path)
    drill = torchrun_drill(
        2,
        _argv(model, plan, STARTUP_TIMEOUT_S),
        {"BOOM_RANK": str(failing)},
        deadline_s=STARTUP_TIMEOUT_S + 60,
    )
    assert drill.code == 1, drill.output
    assert _error_line(drill, failing) == (
        f"[rank {failing}] autopipe run: error: {FACTORY_ERROR}"
    ), drill.output
    peer = 1 - failing
    line = _error_line(drill, peer)
    # Its peer was stopped at once, either by the closed connection or by torchrun's SIGTERM.
    assert line.startswith(f"[rank {peer}] autopipe run: error: "), line
    assert line.endswith(f"rank {failing} failed while building the model: {FACTORY_ERROR}"), line
    assert "a peer rank failed" not in line
    assert "step 1/" not in drill.output
    assert drill.total_s < STARTUP_TIMEOUT_S / 2, drill.total_s  # start-up, not the timeout


def _launch(
    tmp_path: Path, env: dict[str, str], timeout_s: float, replicas: int = 1
) -> list[tuple[int, str, float]]:
    """Two ranks without torchrun's agent (rank 0 holds the store): per rank (exit code,
    stderr, seconds from launch to its exit)."""
    model, plan = _files(tmp_path, replicas)
    return _wait(launch_ranks(2, _argv(model, plan, timeout_s), env), timeout_s)


def _wait(procs: list[subprocess.Popen[str]], timeout_s: float) -> list[tuple[int, str, float]]:
    """Per rank of ``procs`` (exit code, stderr, seconds from now to its exit); an
    AssertionError naming the ranks still running long past ``timeout_s``."""
    start = time.monotonic()
    ended: dict[int, float] = {}
    try:
        while len(ended) < len(procs):
            for rank, proc in enumerate(procs):
                if rank not in ended and proc.poll() is not None:
                    ended[rank] = time.monotonic() - start
            if time.monotonic() - start > 4 * timeout_s + 120:
                raise AssertionError(f"ranks {sorted(set(range(2)) - set(ended))} hang")
            time.sleep(0.05)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    results = []
    for rank, proc in enumerate(procs):
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # pragma: no cover - the pipes are closed by now
            err = ""
        results.append((proc.returncode, err, ended[rank]))
    return results


def test_rank_0_the_store_host_failing_ends_its_peer_in_one_clear_line(tmp_path: Path) -> None:
    """Rank 0 (which holds the c10d store without torchrun's agent) fails building the
    model: its peer cannot read the cause and says that rank 0, the store's host, is gone,
    in one line, well within the timeout. Before it said
    only "a peer rank failed or did not answer within the process-group timeout"."""
    (code0, err0, _), (code1, err1, end1_s) = _launch(
        tmp_path, {"BOOM_RANK": "0"}, STARTUP_TIMEOUT_S
    )
    assert code0 == 2 and err0 == f"[rank 0] autopipe run: error: {FACTORY_ERROR}\n", err0
    assert code1 == 1, err1
    # Its only output: c10d's C++ frames, printed for a store call when rank 0 exits between
    # rank 1's probe of the store and the call (1 launch in about 8), are below autopipe
    # run's C++ log level without torchrun's agent (the drill below makes that call certain).
    assert err1 == (
        "[rank 1] autopipe run: error: rank 1 stopped while building its pipeline stage: "
        "rank 0 is gone, and with it the c10d store it held, so its cause cannot be read "
        "here: rank 0's own error line (and the launcher's report) names it\n"
    ), err1
    assert end1_s < STARTUP_TIMEOUT_S / 2, end1_s


def test_a_call_to_the_store_after_its_host_exited_prints_no_cpp_frames(
    tmp_path: Path,
) -> None:
    """The race of the drill above made certain: rank 0 (the store's host, no torchrun agent)
    fails and exits, and rank 1 then calls the store (as its board reading does when rank 0
    exits between the probe and the call). c10d's client logs a warning with ~20 lines of
    C++ frames for that call; ``autopipe run`` sets torch's C++ log level to ERROR when rank
    0 holds the store, so rank 1's one line stays its only output. Before, the frames came
    above it (the drill above, about 1 launch in 8)."""
    (code0, err0, _), (code1, err1, end1_s) = _launch(
        tmp_path, {"BOOM_RANK": "0", "GONE_STORE_RANK": "1"}, STARTUP_TIMEOUT_S
    )
    assert code0 == 2 and err0 == f"[rank 0] autopipe run: error: {FACTORY_ERROR}\n", err0
    assert code1 == 2, err1
    assert err1 == (
        "[rank 1] autopipe run: error: boom.py:build_model: the factory raised RuntimeError: "
        "the store was called after its host exited\n"
    ), err1
    assert end1_s < STARTUP_TIMEOUT_S / 2, end1_s


def test_rank_1_failing_is_named_by_rank_0_without_torchruns_agent(tmp_path: Path) -> None:
    """The same fault on rank 1: rank 0, which holds the store, reads rank 1's line."""
    (code0, err0, end0_s), (code1, err1, _) = _launch(
        tmp_path, {"BOOM_RANK": "1"}, STARTUP_TIMEOUT_S
    )
    assert code1 == 2 and err1 == f"[rank 1] autopipe run: error: {FACTORY_ERROR}\n", err1
    assert code0 == 1, err0
    assert err0 == (
        "[rank 0] autopipe run: error: rank 0 stopped while building its pipeline stage: "
        f"rank 1 failed while building the model: {FACTORY_ERROR}\n"
    )
    assert end0_s < STARTUP_TIMEOUT_S / 2, end0_s


GROUP_ERROR = (
    "rank 1 failed while building its pipeline stage: RuntimeError: new_group broke on purpose"
)


def test_a_rank_that_cannot_make_its_group_is_named_by_the_rank_waiting_for_it(
    tmp_path: Path,
) -> None:
    """Rank 1 of a 1 x 2 data-parallel plan fails making its data-parallel group, after the
    plan agreement, while rank 0 waits for it in the group's rendezvous, inside c10d, which
    nothing interrupts. A thread watching the board ends rank 0 with rank 1's cause within
    seconds. Before, rank 0 waited out --timeout, printed c10d's socket warnings, and named
    no cause."""
    (code0, err0, end0_s), (code1, err1, end1_s) = _launch(
        tmp_path, {"GROUP_BOOM_RANK": "1"}, GROUP_TIMEOUT_S, replicas=2
    )
    assert code1 == 1, err1
    assert err1 == "[rank 1] autopipe run: error: RuntimeError: new_group broke on purpose\n"
    assert code0 == 1, err0
    assert err0 == (
        "[rank 0] autopipe run: error: rank 0 stopped while building its pipeline stage: "
        f"{GROUP_ERROR}\n"
    )
    assert end0_s - end1_s < GROUP_TIMEOUT_S / 2, (end0_s, end1_s)


def test_under_torchrun_a_rank_stuck_in_a_rendezvous_names_the_cause(tmp_path: Path) -> None:
    """The same under torchrun, whose SIGTERM cannot reach a rank waiting inside c10d
    (Python runs signal handlers between bytecodes). Before, torchrun killed rank 0 with
    SIGKILL 30 s after rank 1 exited: no line of its own, "Signal 9" in the summary."""
    model, plan = _files(tmp_path, replicas=2)
    drill = torchrun_drill(
        2,
        _argv(model, plan, GROUP_TIMEOUT_S),
        {"GROUP_BOOM_RANK": "1"},
        deadline_s=2 * GROUP_TIMEOUT_S + 60,
    )
    assert drill.code == 1, drill.output
    assert _error_line(drill, 1) == (
        "[rank 1] autopipe run: error: RuntimeError: new_group broke on purpose"
    )
    assert _error_line(drill, 0).endswith(
        f"stopped while building its pipeline stage: {GROUP_ERROR}"
    )
    assert "SIGKILL" not in drill.output, drill.output


def test_rank_0_raising_in_a_step_without_the_agent_is_named_as_the_store_host(
    tmp_path: Path,
) -> None:
    """The steps share the start-up's reading of the store: rank 0 (the store's host without
    torchrun's agent) raises in step 2, and rank 1's line says rank 0 is gone with the store.
    Before, it said only "a peer rank failed or did not answer within the process-group
    timeout (Connection closed by peer ...)"."""
    from distributed_cases import fault_files, finish

    model, plan = fault_files(tmp_path)
    argv = [str(model), "--plan", str(plan), "--steps", "50", "--timeout", "60", "-q"]
    procs = launch_ranks(2, argv, {"AUTOPIPE_FAULT": "raise@0"})
    (code0, _, err0), (code1, _, err1) = [finish(p, 120) for p in procs]
    assert code0 == 1 and err0 == "[rank 0] autopipe run: error: ValueError: injected fault\n"
    assert code1 == 1, err1
    # Its only output (no C++ frames of c10d's client: see the start-up drill above).
    assert err1 == (
        "[rank 1] autopipe run: error: rank 1 (stage 1, replica 0): the pipeline broke in step "
        "2: rank 0 is gone, and with it the c10d store it held, so its cause cannot be read "
        "here: rank 0's own error line (and the launcher's report) names it\n"
    ), err1


def test_a_rank_that_exits_before_joining_the_group_is_named_under_torchrun(
    tmp_path: Path,
) -> None:
    """Rank 1's model file fails to import, before any process group: no store to publish
    on. torchrun's agent stops rank 0 (SIGTERM) while it waits inside c10d for rank 1 to
    join, where Python runs no signal handler: a thread woken by the signal ends it with a
    line saying what can be known, a few seconds later. Before, torchrun killed it with
    SIGKILL 30 s after rank 1 exited: no line of its own, "Signal 9" in the summary."""
    model, plan = _files(tmp_path)
    drill = torchrun_drill(
        2,
        _argv(model, plan, GROUP_TIMEOUT_S),
        {"IMPORT_BOOM_RANK": "1"},
        deadline_s=2 * GROUP_TIMEOUT_S + 60,
    )
    assert drill.code == 1, drill.output
    assert _error_line(drill, 1) == (
        f"[rank 1] autopipe run: error: importing {model} failed: ImportError: the model file "
        "broke on purpose"
    ), drill.output
    assert _error_line(drill, 0) == (
        "[rank 0] autopipe run: error: stopped by SIGTERM (torchrun stops every rank once one "
        "exits) before the process group was joined: a rank exited before joining it, and "
        "its own error line says why"
    ), drill.output
    assert "SIGKILL" not in drill.output, drill.output
    assert drill.total_s < GROUP_TIMEOUT_S, drill.total_s


TRAIN_SCRIPT = """\
import sys

import autopipe
from autopipe.modelfile import load_model_file

model, plan = load_model_file(sys.argv[1]), autopipe.load_plan(sys.argv[2])
autopipe.train(autopipe.TrainRequest(model, plan, steps=3, timeout_s=float(sys.argv[3])))
"""


def test_a_script_calling_train_is_not_left_in_a_rendezvous_by_a_failed_peer(
    tmp_path: Path,
) -> None:
    """A script calling ``autopipe.train`` (the public API, not ``autopipe run``), its ranks
    started with torchrun's variables by a launcher of its own (no agent sends SIGTERM):
    rank 1 cannot make its data-parallel group while rank 0 waits for it in the group's
    rendezvous. The same watching thread as ``autopipe run``'s ends rank 0 with rank 1's
    cause. Before, only ``autopipe run`` started it: rank 0 waited out the timeout."""
    import sys

    from distributed_cases import ROOT, free_port, rank_env

    model, plan = _files(tmp_path, replicas=2)
    script = tmp_path / "train_script.py"
    script.write_text(TRAIN_SCRIPT)
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(model), str(plan), f"{GROUP_TIMEOUT_S:g}"],
            env={
                **os.environ,
                **rank_env(rank, 2, port),
                "OMP_NUM_THREADS": "1",
                "GROUP_BOOM_RANK": "1",
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for rank in range(2)
    ]
    (code0, err0, end0_s), (code1, err1, end1_s) = _wait(procs, GROUP_TIMEOUT_S)
    assert code1 != 0 and err1.splitlines()[-1].endswith("RuntimeError: new_group broke on purpose")
    assert code0 == 1, err0
    assert err0 == (f"rank 0 stopped while building its pipeline stage: {GROUP_ERROR}\n"), err0
    assert end0_s - end1_s < GROUP_TIMEOUT_S / 2, (end0_s, end1_s)

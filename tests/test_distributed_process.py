"""Joining the torchrun-launched process group (autopipe.runtime.distributed.process): the
launch environment checked in one line before c10d would wait, without launching anything."""

from __future__ import annotations

import socket
import time

import pytest
import torch.distributed as dist
from autopipe.runtime.distributed.process import (
    LaunchError,
    _wait_for_master,
    check_launch_env,
    group_timeout,
    init_distributed,
)

GOOD = {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.fixture
def launch_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name, value in GOOD.items():
        monkeypatch.setenv(name, value)
    return monkeypatch


def test_a_good_environment_passes(launch_env: pytest.MonkeyPatch) -> None:
    check_launch_env()


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("WORLD_SIZE", "two", "WORLD_SIZE='two' is not an integer"),
        ("WORLD_SIZE", "0", "WORLD_SIZE=0: there must be at least one process"),
        ("RANK", "2", "RANK=2 is not a rank of a world of 2 (0 to 1)"),
        ("MASTER_PORT", "70000", "MASTER_PORT=70000 is not a TCP port (1 to 65535)"),
        ("MASTER_ADDR", " ", "MASTER_ADDR is empty: give the host of rank 0"),
    ],
)
def test_each_bad_variable_is_named(
    launch_env: pytest.MonkeyPatch, name: str, value: str, message: str
) -> None:
    launch_env.setenv(name, value)
    with pytest.raises(LaunchError) as caught:
        check_launch_env()
    assert str(caught.value) == message


def test_missing_variables_are_named_before_any_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert not dist.is_initialized()
    monkeypatch.setenv("RANK", "0")
    for name in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(LaunchError, match="^WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set: start"):
        init_distributed(timeout_s=1)
    assert not dist.is_initialized()
    assert group_timeout() is None  # no world: torch's default


def test_waiting_for_the_master_returns_once_it_listens_and_times_out_otherwise() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        _wait_for_master("127.0.0.1", port, time.monotonic() + 5)
    with pytest.raises(TimeoutError, match=rf"the master 127.0.0.1:{port} \(MASTER_ADDR"):
        _wait_for_master("127.0.0.1", port, time.monotonic() - 1)


@pytest.mark.parametrize("launched", [True, False])
def test_the_console_script_leaves_a_torchrun_rank_without_teardown(
    launched: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torchrun rank ends through exit_process (os._exit after flushing) with main's code:
    Python's teardown aborted ranks (SIGABRT) after clean runs. Outside torchrun the console
    script exits as usual (SystemExit)."""
    from autopipe.runtime.distributed import process

    import autopipe.cli as cli

    left: list[int] = []

    def record(code: int) -> None:
        left.append(code)
        raise SystemExit(code)  # stands in for os._exit, which would end pytest

    monkeypatch.setattr(process, "exit_process", record)
    monkeypatch.setattr(cli, "main", lambda: 3)
    if launched:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "drill")
    else:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with pytest.raises(SystemExit) as ended:
        cli.console()
    assert ended.value.code == 3
    assert left == ([3] if launched else [])

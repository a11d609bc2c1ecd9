"""Join the torchrun-launched process group, with a timeout so failures end instead of hanging."""

from __future__ import annotations

import os
import socket
import sys
import time
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from autopipe.core.errors import UsageError

DEFAULT_TIMEOUT_S = 300.0
"""Process-group timeout: a peer silent for this long makes every collective/recv raise."""

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

_world_timeout: timedelta | None = None


class LaunchError(UsageError, RuntimeError):
    """The process was not started by torchrun (or an equivalent launcher)."""


def init_distributed(
    timeout_s: float = DEFAULT_TIMEOUT_S, backend: str | None = None
) -> tuple[int, int]:
    """Initialise ``torch.distributed`` from torchrun's environment; returns ``(rank, world_size)``.

    ``backend`` defaults to ``nccl`` when CUDA is available (each rank then uses
    ``cuda:LOCAL_RANK``), else ``gloo``. ``timeout_s`` bounds the rendezvous and every later
    collective and point-to-point operation, so a dead or stuck rank yields an error on the
    others within that time rather than a hang. A no-op if already initialised.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    missing = [v for v in _LAUNCH_VARS if v not in os.environ]
    if missing:
        raise LaunchError(
            f"{', '.join(missing)} not set: start this under torchrun, e.g. "
            "`torchrun --nproc-per-node K $(which autopipe) run MODEL.py --plan plan.json`"
        )
    check_launch_env()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    global _world_timeout
    deadline = time.monotonic() + timeout_s
    if os.environ["RANK"] != "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # A client of the store: c10d's TCPStore client retries a master that does not
        # answer for up to about twice the timeout, printing C++ frames as it goes. Wait
        # for the master's port to accept within the timeout first, then let c10d connect.
        _wait_for_master(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), deadline)
    _world_timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend, timeout=_world_timeout)
    return dist.get_rank(), dist.get_world_size()


def check_launch_env() -> None:
    """``LaunchError`` (one line) unless torchrun's variables make sense: ``WORLD_SIZE`` an
    integer >= 1, ``RANK`` one in ``[0, WORLD_SIZE)``, ``MASTER_PORT`` one in 1..65535
    (else c10d would only fail at connect time, after the timeout)."""
    values: dict[str, int] = {}
    for name in ("WORLD_SIZE", "RANK", "MASTER_PORT"):
        text = os.environ[name]
        try:
            values[name] = int(text)
        except ValueError:
            raise LaunchError(f"{name}={text!r} is not an integer") from None
    world, rank, port = values["WORLD_SIZE"], values["RANK"], values["MASTER_PORT"]
    if world < 1:
        raise LaunchError(f"WORLD_SIZE={world}: there must be at least one process")
    if not 0 <= rank < world:
        raise LaunchError(f"RANK={rank} is not a rank of a world of {world} (0 to {world - 1})")
    if not 1 <= port <= 65535:
        raise LaunchError(f"MASTER_PORT={port} is not a TCP port (1 to 65535)")
    if not os.environ["MASTER_ADDR"].strip():
        raise LaunchError("MASTER_ADDR is empty: give the host of rank 0")


def _wait_for_master(host: str, port: int, deadline: float) -> None:
    """Return once ``host:port`` (the c10d store of rank 0 or of torchrun's agent) accepts a
    TCP connection; ``TimeoutError`` (one line) if it has not by ``deadline``
    (``time.monotonic()`` seconds). The probe connection is closed at once, unused."""
    last = "no answer"
    while True:
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            raise TimeoutError(
                f"the master {host}:{port} (MASTER_ADDR:MASTER_PORT) does not answer ({last}): "
                "is rank 0 running, and are the address and port right?"
            )
        try:
            with socket.create_connection((host, port), timeout=min(left_s, 1.0)):
                return
        except OSError as exc:
            last = exc.strerror or str(exc) or type(exc).__name__
        time.sleep(min(0.1, max(deadline - time.monotonic(), 0.0)))


def group_timeout() -> timedelta | None:
    """The timeout to give every ``new_group``: the world's.

    ``new_group`` does not inherit it: without ``timeout=`` a sub-group waits torch's
    default (30 minutes for gloo), so one stuck rank would hang a data-parallel job far past
    ``--timeout``. From :func:`init_distributed`, else read from the default group (private
    torch API, so best effort); None (torch's default) when neither is known.
    """
    if _world_timeout is not None:
        return _world_timeout
    try:
        world = dist.distributed_c10d._get_default_group()
        device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
        timeout = world._get_backend(device).options._timeout
    except Exception:  # another torch version or backend: fall back to torch's default
        return None
    return timeout if isinstance(timeout, timedelta) else None


def shutdown() -> None:
    """Leave the process group (after a successful run; on failure just exit)."""
    global _world_timeout
    if dist.is_initialized():
        dist.destroy_process_group()
    _world_timeout = None


def exit_process(code: int) -> NoReturn:
    """End this rank's process with ``code`` now, skipping Python's teardown.

    After a failed distributed run the process group is left running (destroying it could
    wait on a dead peer), and Python's teardown then destroys its C++ threads while they are
    still joinable: C++ aborts the process (SIGABRT, "terminate called without an active
    exception") instead of exiting with ``code``. Successful torchrun ranks abort the same
    way at exit, after ``destroy_process_group``, in a few launches in a hundred on a loaded
    machine (seen in CI on a 2-rank FSDP2 run; cause inside torch not found). Call it last:
    stdout and stderr are flushed here, every other output must be written and closed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

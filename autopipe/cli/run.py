"""``autopipe run``: train a few steps of a plan on torch.distributed, launched by torchrun.

Every rank loads the model file and the plan and calls :func:`autopipe.training.train`
(builds only its own stage and runs the plan's schedule); the last stage prints loss and step
time. What is about processes and the terminal stays here: each line names its rank, one
error line per rank, the error handed to torchrun's summary, the hash seed.
``python -m autopipe run ...`` is ``autopipe run ...``.

Started as a program (not ``main([...])`` from Python), ``autopipe run`` first fixes
Python's string hash seed (:func:`fix_hash_seed`): with ``PYTHONHASHSEED`` unset every
process gets its own, and a model whose ``forward`` iterates a set of strings (Hugging Face
Gemma-3's ``set(config.layer_types)``) traces into another graph on each rank.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from autopipe import training
from autopipe.cli import common
from autopipe.outputs import inside_folder_problem
from autopipe.saving import save_dir_problem
from autopipe.training import INIT_MODES, MAX_TIMEOUT_S, TrainRequest, TrainResult, train

EPILOG = """\
examples (K = the plan's stages; K x D processes give D data-parallel replicas):
  autopipe plan examples/gpt.py --gpus 2 --json plan.json
  torchrun --nproc-per-node 2 -m autopipe run examples/gpt.py --plan plan.json --steps 5
  # two nodes, 4 GPUs each, a K = 8 plan; run on every node:
  torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
      --rdzv-endpoint HOST0:29500 --rdzv-id job1 \\
      -m autopipe run examples/gpt.py --plan plan.json --steps 100
  (or: torchrun ... $(which autopipe) run ...)
A plan with tensor parallelism T or sharded training state (fields tensor_parallel, shard)
runs on a (pp, dp, tp) DeviceMesh of K x D x T processes: TP by parallelize_module, FSDP2,
or ZeRO-1 (docs/distributed.md).
Every rank traces the model itself; so that all trace the same graph (a forward that
iterates a set of strings depends on Python's hash seed), autopipe run re-executes itself
with PYTHONHASHSEED=0 when PYTHONHASHSEED is unset. A value you set is kept: set the same
one on every rank (ranks that trace different graphs are refused at start-up).
"""

HASH_SEED = "0"
"""The ``PYTHONHASHSEED`` that ``autopipe run`` sets when it is unset (0: no randomisation)."""


def fix_hash_seed(argv: Sequence[str]) -> None:
    """Re-execute this process with ``PYTHONHASHSEED`` = :data:`HASH_SEED` when ``argv`` (this
    process's own arguments, without the program) is an ``autopipe run`` and the variable is
    unset, so every rank that torchrun starts hashes strings, and so iterates sets, alike.

    ``os.execve`` replaces the program in the same process (torchrun keeps watching its
    pid), with the same command line (``sys.orig_argv``), before any process group exists.
    A value the user set is kept, even one that differs between ranks: the start-up
    agreement (:func:`autopipe.runtime.distributed.agree.check_same_plan`) then refuses
    graphs that differ. Nothing happens where the variable would not take effect or the
    process cannot be replaced alike: outside POSIX, under ``python -E``/``-I``, or once
    torch.distributed is initialised."""
    if not argv or argv[0] != "run" or "PYTHONHASHSEED" in os.environ:
        return
    if os.name != "posix" or sys.flags.ignore_environment or not sys.executable:
        return
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, {**os.environ, "PYTHONHASHSEED": HASH_SEED})


def record_error_for_torchrun(line: str) -> None:
    """Hand this rank's one-line error to torchrun's failure summary.

    torchrun's agent sets ``TORCHELASTIC_ERROR_FILE`` for every worker and, after the workers
    exit, prints a summary whose root cause shows that file's ``message`` as ``traceback :``
    (``torch.distributed.elastic.multiprocessing.errors``; without a file it says "To enable
    traceback see: ..."). The summary comes from the agent after every worker has exited, so
    no worker can print below it: writing the file puts the line at its end instead. The
    record has the layout torch's own ``ErrorHandler.record_exception`` writes, without the
    Python call stack (the line is the whole error; ``-v`` prints the traceback to stderr)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}}}
    try:
        Path(path).write_text(json.dumps(record))
    except OSError:
        pass  # the line is on stderr already; the summary then shows torch's own hint


def register(sub: common.Subparsers) -> None:
    """Add ``autopipe run MODEL.py --plan PLAN.json [--steps N]`` to the CLI's subparsers."""
    p = sub.add_parser(
        "run",
        help="train a plan for a few steps on torch.distributed (launch under torchrun)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Run a plan with torch.distributed.pipelining on K x D processes started by "
            "torchrun (gloo on CPU, NCCL on GPUs): each rank builds only its stage."
        ),
        epilog=EPILOG,
    )
    common.model_and_plan_args(p)
    _training_flags(p)
    _process_flags(p)
    _output_flags(p)
    common.add_common_flags(p)
    p.set_defaults(func=cmd_run)


def _training_flags(p: argparse.ArgumentParser) -> None:
    """``--steps``, ``--lr``, ``--save``, ``--init``, ``--state-dict``: what is trained,
    from which weights, and where the weights go."""
    p.add_argument(
        "--steps", type=common.positive_int, default=5, help="training steps (default 5)"
    )
    p.add_argument(
        "--lr",
        type=common.positive_float("a learning rate > 0"),
        default=1e-3,
        help="learning rate of the optimizer the plan was made for (the plan's optimizer: "
        "sgd, sgd-momentum, or AdamW for the adam family) (default 1e-3)",
    )
    p.add_argument(
        "--save",
        metavar="DIR",
        help="after training, save the weights as a torch.distributed.checkpoint in DIR "
        "(every rank writes its stage under the model's own parameter names)",
    )
    p.add_argument(
        "--init",
        choices=list(INIT_MODES),
        default="replicate",
        help="replicate: every rank builds the whole model with the factory's seed and keeps "
        "its stage (exact weights); meta: build on the meta device and initialise only this "
        "stage with reset_parameters() (low memory, default init) (default: replicate)",
    )
    p.add_argument(
        "--state-dict",
        metavar="PATH",
        help="load weights from a torch.save(model.state_dict()) file; implies a meta build",
    )


def _process_flags(p: argparse.ArgumentParser) -> None:
    """``--timeout``, ``--threads``, ``--allow-nonfinite``: how each rank's process runs and
    when it stops."""
    p.add_argument(
        "--timeout",
        type=common.positive_float("a timeout in seconds > 0", at_most=MAX_TIMEOUT_S),
        default=300.0,
        metavar="SECONDS",
        help="process-group timeout: a dead or stuck rank ends the run with an error after "
        "this long (default 300)",
    )
    p.add_argument("--threads", type=common.positive_int, help="torch threads per process")
    p.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="keep training when the loss is NaN or infinite (default: every rank stops with "
        "an error naming the step, before the optimizer step)",
    )


def _output_flags(p: argparse.ArgumentParser) -> None:
    """``--trace`` and ``--json``: what the run writes besides its log."""
    p.add_argument(
        "--trace",
        metavar="PATH",
        help="write what every rank ran and when (each chunk's forward and backward per "
        "micro-batch, the loss, each step, the optimizer step) as a Chrome trace to PATH, "
        "for Perfetto and for `autopipe replay PATH --plan PLAN`",
    )
    common.json_option(
        p, "write per-step losses and times (last stage) to PATH (stdout if no PATH)"
    )


CPP_LOG_LEVEL = "ERROR"
"""torch's C++ log level (``TORCH_CPP_LOG_LEVEL``) of an ``autopipe run`` rank whose c10d
store is rank 0's (no torchrun agent), unless set: warnings (c10d's included) are dropped."""


def quiet_store_client_warnings() -> None:
    """Set ``TORCH_CPP_LOG_LEVEL`` to :data:`CPP_LOG_LEVEL` when rank 0 holds the c10d store
    (started without torchrun's agent), the variable is unset and torch is not loaded yet
    (c10 reads it once, when torch loads; torch has no call to change it later).

    When rank 0, the store's host, fails and exits, a peer reading the failure board can
    meet the store as it goes: c10d's client then logs a warning with a C++ stack trace
    (about 20 lines) for the call, above the peer's own line, which already says that rank 0
    is gone with the store. A probe before each call narrows that window but cannot close
    it (the host exits between the probe and the call: about 1 launch in 8 on 2 loaded
    cores), and no order of the ranks closes it without delaying the failing host's exit for
    peers that may never read. Under torchrun the store is its agent's and outlives every
    rank, and nothing is changed. A value you set is kept (``TORCH_CPP_LOG_LEVEL=WARNING``
    shows the warnings)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or "torch" in sys.modules:
        return
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", CPP_LOG_LEVEL)


def cmd_run(args: argparse.Namespace) -> int:
    quiet_store_client_warnings()
    if os.environ.get("RANK", "").isdigit():
        # torchrun interleaves every rank's output: each line says whose it is.
        common.set_line_prefix(f"[rank {os.environ['RANK']}] ")
    previous, training.stuck_exit = training.stuck_exit, _exit_stuck
    try:
        with one_line_per_rank(verbose=args.verbose):
            return _run(args)
    finally:
        training.stuck_exit = previous


def _exit_stuck(message: str) -> None:
    """End this rank at once with its error line (``message``), from the thread that found
    its start-up stuck in c10d after a peer failed (:data:`autopipe.training.stuck_exit`):
    the main thread cannot be reached, and nothing is written yet that needs closing."""
    line = f"autopipe run: error: {message}"
    sys.stderr.write(f"{common.line_prefix()}{line}\n")
    sys.stderr.flush()
    sys.stdout.flush()
    record_error_for_torchrun(line)
    os._exit(common.EXIT_FAILURE)


class Terminated(BaseException):
    """torchrun stopped this rank (SIGTERM) while it was not failing itself. A
    BaseException, as KeyboardInterrupt, so that no ``except Exception`` swallows it."""


TERMINATION_GRACE_S = 2.0
"""How long a rank that torchrun stops (SIGTERM) keeps going before it ends with a line
saying so: long enough for a rank a moment from its own error (the peers of a rank that
failed at start-up fail alike an instant later) to report that instead."""


UNHEARD_SIGNAL_S = TERMINATION_GRACE_S + training.STUCK_GRACE_S
"""How long a SIGTERM (or the SIGALRM that follows it) may wait for its Python handler
before the rank is taken as stuck inside C++, where Python runs no handler, and is ended
by the thread watching for the signals (5 s). Longer than the start-up watcher takes
(:data:`~autopipe.training.STUCK_GRACE_S` after the peer's line, which the peer writes
before it exits, so before torchrun's SIGTERM, plus a poll of 0.5 s): a rank stuck in its
start-up ends with that watcher's line, which names its phase."""


def _joined() -> bool:
    """Whether this process has joined its process group (torch.distributed is imported by
    then; it is not imported here for the question)."""
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def stopped_by_sigterm(cause: str | None) -> str:
    """The line of a rank torchrun stopped (SIGTERM) without an error of its own: after
    ``cause`` (the line a failing rank published on the failure board), else what can be
    known: before the group is joined no rank can have published one, and the rank that
    exited first says why in its own output."""
    head = "stopped by SIGTERM (torchrun stops every rank once one exits)"
    if cause is not None:
        return f"{head}: after {cause}"
    if not _joined():
        return (
            f"{head} before the process group was joined: a rank exited before joining it, "
            "and its own error line says why"
        )
    return f"{head}: another rank's error says why"


def _watch_sigterm(
    heard: Callable[[], int], settled: threading.Event, lock: threading.Lock
) -> Callable[[], None]:
    """Start a daemon thread that sees SIGTERM and SIGALRM arrive through Python's signal
    wakeup fd (written by the C-level handler even while the main thread waits inside C++)
    and, when one has waited :data:`UNHEARD_SIGNAL_S` for its Python handler (``heard()``:
    how many the handler has run for) and ``settled`` is not set (the main thread reports
    its own error, or the block ended), ends the rank with :func:`stopped_by_sigterm`'s
    line. A main thread that runs Python, even slowly in its own error path, hears every
    signal and is left alone. The cause is read on a connection of its own (the default
    store's client waits as long as the main thread does). Returns the function that stops
    the watch. Main thread only."""
    wake, signalled = socket.socketpair()
    signalled.setblocking(False)  # set_wakeup_fd's requirement: the handler must not block
    before = signal.set_wakeup_fd(signalled.fileno(), warn_on_full_buffer=False)
    watched = (signal.SIGTERM, signal.SIGALRM)

    def end_rank() -> None:
        read = None
        if _joined():  # torch.distributed is loaded: reading the board loads no more
            from autopipe.runtime.distributed.failures import board_reader

            read = board_reader()
        line = stopped_by_sigterm(read() if read is not None else None)
        with lock:  # the main thread, reporting by itself, sets settled under it
            if not settled.is_set():
                _exit_stuck(line)

    def watch() -> None:
        received, unheard_since = 0, 0.0
        with wake:
            while not settled.is_set():
                if received > heard():
                    left_s = unheard_since + UNHEARD_SIGNAL_S - time.monotonic()
                    if left_s <= 0:
                        end_rank()
                        return
                    wake.settimeout(left_s)
                else:
                    wake.settimeout(None)
                try:
                    got = wake.recv(64)
                except TimeoutError:
                    continue
                except OSError:
                    return
                if not got:
                    return  # the watch was stopped
                arrived = sum(got.count(s) for s in watched)
                if arrived and received <= heard():
                    unheard_since = time.monotonic()
                received += arrived

    threading.Thread(target=watch, name="autopipe-signal-watch", daemon=True).start()

    def stop() -> None:
        signal.set_wakeup_fd(before)
        signalled.close()  # the thread's recv returns b"" and it ends

    return stop


@contextlib.contextmanager
def one_line_per_rank(verbose: bool = False) -> Iterator[None]:
    """While training, every rank ends in exactly one error line of its own:

    - torch.distributed.pipelining's multi-stage schedules log an error and the whole
      action table (48 lines for 2 ranks x 2 chunks) before re-raising a stage's exception,
      which this rank reports in one line anyway: those log records are dropped (kept with
      ``-v``).
    - torchrun sends SIGTERM to the other ranks as soon as one exits; its default action
      kills a rank silently, even one a moment from printing its own error. Here a rank
      already raising its own error ignores the signal, so that its line gets out (it
      exits right after; torchrun sends SIGKILL 30 s later anyway), and any other rank
      ends :data:`TERMINATION_GRACE_S` later (SIGALRM) with a line saying it was stopped,
      unless its own error comes first. Once an error leaves this block the signals stay
      ignored: the CLI prints the error after it, then the process exits.
    - A rank waiting inside C++ (joining the process group while a peer that exited before
      joining it never comes, a new group's rendezvous) runs no Python signal handler, so
      torchrun would SIGKILL it silently 30 s later: a thread woken by the signal itself
      (:func:`_watch_sigterm`) ends it with the same line, once the signal has waited
      :data:`UNHEARD_SIGNAL_S` for its handler.
    """
    schedules = logging.getLogger("torch.distributed.pipelining.schedules")

    def table(record: logging.LogRecord) -> bool:
        return verbose or record.levelno < logging.ERROR

    failing = False
    settled, lock = threading.Event(), threading.Lock()  # set: the stuck watch stands down
    heard = [0]  # signals whose handler ran: the main thread runs Python

    def on_signal(signum: int, frame: Any) -> None:
        heard[0] += 1
        if failing or sys.exc_info()[1] is not None:
            return  # this rank is reporting its own error (and exits right after)
        if signum == signal.SIGTERM:
            signal.setitimer(signal.ITIMER_REAL, TERMINATION_GRACE_S)
            return
        raise Terminated

    schedules.addFilter(table)
    handled = (signal.SIGTERM, signal.SIGALRM)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = [signal.signal(s, on_signal) for s in handled] if main_thread else []
    stop_watch = _watch_sigterm(lambda: heard[0], settled, lock) if main_thread else None
    try:
        yield
    except BaseException as exc:
        # The handlers stay, ignoring the signals, until the process has printed this
        # error (in the CLI's main, after this block) and exited.
        failing = True
        with lock:  # this rank reports by itself: the stuck watch stands down
            settled.set()
        if isinstance(exc, Terminated):
            from autopipe.runtime.distributed.failures import failure_cause

            # The rank that failed first wrote its line to the store torchrun's agent holds.
            raise common.Failure(stopped_by_sigterm(failure_cause())) from None
        raise
    finally:
        schedules.removeFilter(table)
        with lock:
            settled.set()
        if stop_watch is not None:
            stop_watch()
        if main_thread:
            signal.setitimer(signal.ITIMER_REAL, 0)
            if not failing:
                for s, handler in zip(handled, previous, strict=True):
                    signal.signal(s, signal.SIG_DFL if handler is None else handler)


def _run(args: argparse.Namespace) -> int:
    """The flags checked before any work, the files loaded, then the one call."""
    common.check_output_path(args.json, "--json", inputs=[args.model, args.plan, args.state_dict])
    common.check_output_path(
        args.trace, "--trace", inputs=[args.model, args.plan, args.state_dict, args.json]
    )
    if args.save is not None:
        check_save_dir(args.save)
        for path, flag in ((args.trace, "--trace"), (args.json, "--json")):
            if path and path != "-":
                problem = inside_folder_problem(path, flag, args.save, "--save")
                if problem is not None:
                    raise common.UsageError(problem)
    plan = common.load_plan_file(args.plan)
    request = TrainRequest(
        model=common.load_model_arg(args.model),
        plan=plan,
        steps=args.steps,
        lr=args.lr,
        init=args.init,
        state_dict_path=args.state_dict or None,
        save_dir=args.save,
        trace_path=args.trace,
        timeout_s=args.timeout,
        threads=args.threads,
        allow_nonfinite=args.allow_nonfinite,
    )

    def say(line: str) -> None:
        common.say(args, line)
        sys.stdout.flush()  # torchrun pipes the output: a step's line shows when it ends

    def write_json(result: TrainResult) -> None:
        if result.steps:
            steps = [dataclasses.asdict(s) for s in result.steps]
            common.emit_json(
                {"steps": steps, "optimizer": result.optimizer, "received": result.received_shapes},
                args.json,
            )

    train(request, say, write_json)
    return common.EXIT_OK


def check_save_dir(path: str) -> None:
    """Refuse a ``--save DIR`` that cannot be written or replaced, before any work (exit 2):
    :func:`autopipe.saving.save_dir_problem` (the folder above must take new entries)."""
    problem = save_dir_problem(path)
    if problem is not None:
        raise common.UsageError(problem)

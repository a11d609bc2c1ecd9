"""``autopipe run``: train a few steps of a plan on torch.distributed, launched by torchrun.

Every rank loads the model file and the plan, builds only its own stage and runs the plan's
schedule; the last stage prints loss and step time. ``python -m autopipe run ...`` is
``autopipe run ...``.

Started as a program (not ``main([...])`` from Python), ``autopipe run`` first fixes
Python's string hash seed (:func:`fix_hash_seed`): with ``PYTHONHASHSEED`` unset every
process gets its own, and a model whose ``forward`` iterates a set of strings (Hugging Face
Gemma-3's ``set(config.layer_types)``) traces into another graph on each rank.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import stat
import statistics
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autopipe.cli import common

if TYPE_CHECKING:
    from autopipe.core.plan import Plan
    from autopipe.modelfile import ModelFile

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

MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""The longest ``--timeout``: a week (c10d keeps timeouts as integer milliseconds, and a
process group silent for longer is stuck, not slow)."""


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
    import json
    import time

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
        choices=["replicate", "meta"],
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
    common.add_common_flags(p)
    p.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    if os.environ.get("RANK", "").isdigit():
        # torchrun interleaves every rank's output: each line says whose it is.
        common.set_line_prefix(f"[rank {os.environ['RANK']}] ")
    with one_line_per_rank(verbose=args.verbose):
        return _run(args)


class Terminated(BaseException):
    """torchrun stopped this rank (SIGTERM) while it was not failing itself. A
    BaseException, as KeyboardInterrupt, so that no ``except Exception`` swallows it."""


TERMINATION_GRACE_S = 2.0
"""How long a rank that torchrun stops (SIGTERM) keeps going before it ends with a line
saying so: long enough for a rank a moment from its own error (the peers of a rank that
failed at start-up fail alike an instant later) to report that instead."""


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
    """
    import logging
    import signal

    schedules = logging.getLogger("torch.distributed.pipelining.schedules")

    def table(record: logging.LogRecord) -> bool:
        return verbose or record.levelno < logging.ERROR

    failing = False

    def on_signal(signum: int, frame: Any) -> None:
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
    try:
        yield
    except BaseException as exc:
        # The handlers stay, ignoring the signals, until the process has printed this
        # error (in the CLI's main, after this block) and exited.
        failing = True
        if isinstance(exc, Terminated):
            raise common.Failure(
                "stopped by SIGTERM (torchrun stops every rank once one exits): another "
                "rank's error says why"
            ) from None
        raise
    finally:
        schedules.removeFilter(table)
        if main_thread:
            signal.setitimer(signal.ITIMER_REAL, 0)
            if not failing:
                for s, handler in zip(handled, previous, strict=True):
                    signal.signal(s, signal.SIG_DFL if handler is None else handler)


def _run(args: argparse.Namespace) -> int:
    from autopipe.runtime.distributed.process import LaunchError, init_distributed

    common.check_output_path(args.json, "--json", inputs=[args.model, args.plan, args.state_dict])
    common.check_output_path(
        args.trace, "--trace", inputs=[args.model, args.plan, args.state_dict, args.json]
    )
    if args.save is not None:
        check_save_dir(args.save)
    plan = common.load_plan_file(args.plan)
    mf = common.load_model_arg(args.model)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        import torch.distributed as dist

        # A process group the caller made (a script running several plans) stays theirs.
        args._owns_group = not dist.is_initialized()
        rank, world = init_distributed(timeout_s=args.timeout)
    except LaunchError as exc:
        raise common.UsageError(str(exc)) from exc
    except Exception as exc:  # rendezvous failure or timeout
        raise common.Failure(
            f"could not join the process group within {args.timeout:g} s: {exc}"
        ) from exc
    from autopipe.runtime.distributed.layout import PlanWorldSizeError, rank_layout
    from autopipe.runtime.distributed.mesh import mesh_size_problem, uses_mesh

    try:
        if uses_mesh(plan):
            problem = mesh_size_problem(plan, world)
            if problem is not None:
                raise PlanWorldSizeError(problem)
        else:
            rank_layout(rank, world, plan.num_stages, plan.replicas)
    except PlanWorldSizeError as exc:
        # Every rank finds the same mismatch: meet at a barrier so all of them report it
        # before the first exit makes torchrun stop the others.
        _barrier_quietly()
        raise common.UsageError(str(exc)) from exc
    return _train(args, plan, mf, rank, world)


def _barrier_quietly() -> None:
    import torch.distributed as dist

    try:
        dist.barrier()
    except Exception:  # a peer is gone: report our own error anyway
        pass


def _train(args: argparse.Namespace, plan: Plan, mf: ModelFile, rank: int, world: int) -> int:
    import torch
    import torch.distributed as dist

    from autopipe.modelfile import ModelFileError
    from autopipe.runtime.distributed.agree import nonfinite
    from autopipe.runtime.distributed.failures import PipelineRankError
    from autopipe.runtime.distributed.layout import PlanWorldSizeError
    from autopipe.runtime.distributed.mesh import uses_mesh
    from autopipe.runtime.distributed.pipeline import DistributedPipeline
    from autopipe.runtime.distributed.process import shutdown
    from autopipe.runtime.split import StageSplitError

    state_dict = None
    if args.state_dict:
        if not Path(args.state_dict).is_file():
            raise common.UsageError(f"state_dict file not found: {args.state_dict}")
        state_dict = torch.load(args.state_dict, map_location="cpu", mmap=True, weights_only=True)
    meta = args.init == "meta" or state_dict is not None
    try:
        model = mf.build(device="meta" if meta else None)
        replicas = (
            plan.replicas
            if uses_mesh(plan)
            else (world // plan.num_stages if world % plan.num_stages == 0 else 1)
        )
        inputs = mf.inputs(plan.batch_size * replicas)
        pipe = DistributedPipeline(model, plan, inputs, mf.loss_fn, state_dict=state_dict)
    except (ModelFileError, PlanWorldSizeError, StageSplitError, ValueError, TypeError) as exc:
        raise common.UsageError(str(exc)) from exc
    except PipelineRankError as exc:
        raise common.Failure(str(exc)) from exc
    del model
    layout = pipe.layout
    # The rank running the last chunk computes the loss (rank 0 in a V-shape).
    reporter = pipe.holds_last and layout.replica == 0
    replicas = pipe.data_parallel_size
    if rank == 0:
        mesh_note = (f" x TP {plan.tensor_parallel}" if plan.tensor_parallel > 1 else "") + (
            f", shard {plan.shard}" if plan.shard != "none" else ""
        )
        common.say(
            args,
            f"autopipe run: {plan.num_stages} stages x {replicas} replicas{mesh_note} on "
            f"{world} processes ({dist.get_backend()}), schedule {plan.schedule}, "
            + (f"{plan.virtual_stages} chunks per rank, " if plan.virtual_stages > 1 else "")
            + f"{plan.microbatches} micro-batches of {plan.batch_size // plan.microbatches}, "
            f"global batch {plan.batch_size * replicas}",
        )
    optimizer = make_optimizer(plan, pipe.parameters(), args.lr, group=pipe.replica_group)
    local = pipe.local_batch(inputs)
    trace = None
    if args.trace:
        from autopipe.runtime.distributed.recorder import PipelineTrace

        trace = PipelineTrace(pipe)
    records: list[dict[str, float]] = []
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        try:
            loss = pipe.step(local if pipe.holds_first or pipe.holds_last else None)
        except PipelineRankError as exc:
            raise common.Failure(str(exc)) from exc
        if not args.allow_nonfinite:
            bad = nonfinite(pipe.last_loss)
            if bad is not None:  # before optimizer.step(): the weights stay as they were
                raise common.Failure(
                    f"the loss is {bad} in step {step + 1}; stopped before the optimizer step "
                    "(lower --lr, check the data, or pass --allow-nonfinite to keep going)"
                )
        with trace.optimizer() if trace is not None else contextlib.nullcontext():
            optimizer.step()
        if reporter and loss is not None:
            records.append({"step": step + 1, "loss": float(loss), "time_s": pipe.last_step_s})
            common.say(
                args,
                f"step {step + 1}/{args.steps}  loss {float(loss):.4f}  "
                f"{pipe.last_step_s * 1e3:.1f} ms",
            )
            sys.stdout.flush()
    if reporter and records:
        # The first step also infers the stage shapes (one extra forward/backward): skip it.
        steady = [r["time_s"] for r in records[1:]] or [records[0]["time_s"]]
        common.say(
            args, f"median step time {statistics.median(steady) * 1e3:.1f} ms (after step 1)"
        )
        # The optimizer's class says what ran: ZeroRedundancyOptimizer for shard optimizer;
        # the shapes this rank's first chunk receives, one TP rank's share under sequence
        # parallelism.
        received = pipe.received_shapes[0] if pipe.received_shapes else []
        common.emit_json(
            {"steps": records, "optimizer": type(optimizer).__name__, "received": received},
            args.json,
        )
    if trace is not None:
        timeline = trace.gather()
        if timeline is not None:
            from autopipe.core.datafile import atomic_write_json
            from autopipe.core.timeline import to_chrome_trace

            atomic_write_json(args.trace, to_chrome_trace(timeline))
            common.say(args, f"wrote the trace of {args.steps} steps to {args.trace}")
    if args.save is not None:
        save_checkpoint(pipe, args.save)
        if rank == 0:
            common.say(
                args, f"saved the trained weights to {args.save} (torch.distributed.checkpoint)"
            )
    if args._owns_group:
        shutdown()
    return common.EXIT_OK


def make_optimizer(plan: Plan, parameters: Any, lr: float, group: Any = None) -> Any:
    """The optimizer whose state the plan's memory figures assume (the planning request's
    ``optimizer``): SGD, SGD with momentum 0.9, else AdamW. With ``shard = optimizer``
    (ZeRO-1) it is wrapped in torch's ``ZeroRedundancyOptimizer`` over the data-parallel
    ``group`` (the stage's replicas; None: the whole world)."""
    import torch

    name = plan.optimizer or "adam"
    parameters = list(parameters)
    if not parameters:
        # A stage of parameter-free layers (an activation, rotary embeddings) still runs.
        return _NothingToOptimize()
    cls: Any
    if name == "sgd":
        cls, options = torch.optim.SGD, {"lr": lr}
    elif name == "sgd-momentum":
        cls, options = torch.optim.SGD, {"lr": lr, "momentum": 0.9}
    else:
        cls, options = torch.optim.AdamW, {"lr": lr}
    if plan.shard == "optimizer":
        from autopipe.runtime.distributed.mesh import make_zero_optimizer

        return make_zero_optimizer(cls, parameters, group, **options)
    return cls(parameters, **options)


class _NothingToOptimize:
    """The optimizer of a stage without parameters."""

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def check_save_dir(path: str) -> None:
    """Refuse a ``--save DIR`` that cannot be written or replaced, before any work (exit 2).

    The checkpoint is written into a fresh sibling of DIR and renamed to DIR at the end
    (:func:`save_checkpoint`), so DIR must name a directory entry (not ``''``, ``.``, ``..``)
    in a folder that takes new entries."""
    if not path.strip():
        raise common.UsageError("--save needs a directory name, got ''")
    target = Path(path)
    if target.name in ("", ".", ".."):
        raise common.UsageError(
            f"--save {path}: name the directory to create or replace (the checkpoint is written "
            "beside it and renamed to it), not the current or a parent folder"
        )
    problem = _replace_problem(target)
    if problem is not None:
        raise common.UsageError(f"--save {path}: {problem}")
    common.check_output_path(str(target.parent), "--save", directory=True)


_CHECKPOINT_ENTRY = re.compile(r"(__\d+)?\.metadata(\.tmp)?|__\d+_\d+\.distcp")
"""The names torch.distributed.checkpoint's FileSystemWriter gives the entries of a
checkpoint folder."""


def _replace_problem(target: Path) -> str | None:
    """Why ``--save target`` must not be replaced by a new checkpoint, or None (``target`` is
    absent, or a folder of nothing but checkpoint files, which the swap deletes)."""
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot look at it ({exc.strerror or exc})"
    if stat.S_ISLNK(st.st_mode):
        return (
            "is a symbolic link; give the directory itself (a link is never followed: "
            "someone else may have planted it)"
        )
    if not stat.S_ISDIR(st.st_mode):
        return "is a file; give a directory"
    if st.st_uid != os.geteuid():
        return (
            f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): it cannot be "
            "replaced safely; give a directory of your own or a new name"
        )
    try:
        foreign = sorted(e for e in os.listdir(target) if not _CHECKPOINT_ENTRY.fullmatch(e))
    except OSError as exc:
        return f"cannot list it ({exc.strerror or exc})"
    if foreign:
        return (
            f"holds {foreign[0]!r}, no part of a checkpoint, and the new checkpoint replaces "
            "the whole folder: give a new or empty directory, or an earlier --save DIR"
        )
    return None


def save_checkpoint(pipe: Any, directory: str) -> None:
    """Every rank's stage weights, under the model's own names, as one distributed checkpoint
    in ``directory`` (replicated entries, e.g. data-parallel copies, are written once).

    All or nothing: rank 0 creates a fresh sibling folder (``mkdtemp``: a new random name,
    mode 0700), every rank writes its part there, and after a barrier rank 0 renames it to
    ``directory`` (an earlier checkpoint there is moved aside first and deleted after). A
    rank that dies or hangs mid-save leaves the earlier checkpoint whole (or none), never a
    mix of old and new files; the others end with :class:`common.Failure` within the
    process-group timeout. Needs a folder every rank sees (as torch.distributed.checkpoint
    does)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from autopipe.runtime.distributed.failures import short_cause

    target = Path(directory)
    rank = dist.get_rank()
    staging: Path | None = None
    message: list[str | None] = [None, None]  # [staging folder name, error]
    if rank == 0:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.saving-"))
            message[0] = staging.name
        except OSError as exc:
            message[1] = f"--save {directory}: cannot create a folder beside it ({exc})"
    try:
        dist.broadcast_object_list(message, src=0)
        if message[1] is not None:
            raise common.Failure(message[1])
        assert message[0] is not None
        staging = target.parent / message[0]
        dcp.save(pipe.state_dict(), checkpoint_id=staging)
        dist.barrier()  # every rank has written its part
    except common.Failure:
        raise
    except Exception as exc:
        if rank == 0 and staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise common.Failure(
            f"the checkpoint was not saved ({short_cause(exc)}); {directory} is as it was"
        ) from exc
    outcome: list[str | None] = [_swap_in(staging, target) if rank == 0 else None]
    try:
        dist.broadcast_object_list(outcome, src=0)
    except Exception as exc:
        raise common.Failure(
            f"rank 0 did not say whether it moved the checkpoint to {directory} "
            f"({short_cause(exc)})"
        ) from exc
    if outcome[0] is not None:
        raise common.Failure(outcome[0])


def _swap_in(staging: Path, target: Path) -> str | None:
    """Rename the complete checkpoint ``staging`` to ``target`` (rank 0, after every rank
    has written); an earlier ``target`` is first moved into a fresh folder of its own and
    deleted after the swap. Returns None, or the one-line error (``staging`` then stays)."""
    from autopipe.core.datafile import created_mode

    problem = _replace_problem(target)  # again: the folder may have changed since start-up
    if problem is not None:
        return f"--save {target}: {problem}; the new checkpoint is in {staging}"
    aside: Path | None = None
    try:
        os.chmod(staging, created_mode(0o777))  # what a plain mkdir would have given
        if os.path.lexists(target):
            aside = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.old-"))
            os.rename(target, aside / "checkpoint")
        os.rename(staging, target)
    except OSError as exc:
        if aside is not None and not os.path.lexists(target):
            with contextlib.suppress(OSError):
                os.rename(aside / "checkpoint", target)
        return (
            f"could not move the new checkpoint to {target} ({exc.strerror or exc}); "
            f"it is in {staging}"
        )
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    return None

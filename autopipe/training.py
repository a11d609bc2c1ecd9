"""Train a plan for a few steps on torch.distributed, as ``autopipe run`` does, for the CLI and
the Python API alike.

Every rank (a process torchrun started) calls :func:`train` with the same
:class:`TrainRequest`: it joins the process group, checks that the world fits the plan,
builds only its own stage, runs the plan's schedule for ``steps`` optimizer steps and, as
asked, writes the trace and saves the weights. The rank that computes the loss gets the
per-step losses and times in its :class:`TrainResult`. A bad request, plan or model is a
``UsageError``; a peer gone or a loss that is not finite is a ``Failure``.

Typical use, in a script that ``torchrun --nproc-per-node 2 script.py`` starts::

    request = TrainRequest(load_model_file("examples/gpt.py"), load_plan("plan.json"), steps=5)
    result = train(request)
    if result.reports_loss:
        print(result.steps[-1].loss)

torch is imported when :func:`train` runs, not with this module (the CLI's parser imports it).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autopipe.core.datafile import atomic_write_json
from autopipe.core.errors import Failure, UsageError
from autopipe.core.mesh_rules import mesh_problems, uses_mesh
from autopipe.core.plan import Plan
from autopipe.core.timeline import to_chrome_trace
from autopipe.modelfile import ModelFile, ModelFileError
from autopipe.outputs import check_output, inside_folder_problem
from autopipe.saving import save_checkpoint, save_dir_problem

if TYPE_CHECKING:
    import torch

    from autopipe.runtime.distributed.pipeline import DistributedPipeline
    from autopipe.runtime.distributed.recorder import PipelineTrace

__all__ = [
    "INIT_MODES",
    "MAX_TIMEOUT_S",
    "StepRecord",
    "TrainRequest",
    "TrainResult",
    "end_stuck_rank",
    "make_optimizer",
    "train",
]

MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""The longest process-group timeout: a week (c10d keeps timeouts as integer milliseconds,
and a process group silent for longer is stuck, not slow)."""

INIT_MODES = ("replicate", "meta")
"""How each rank gets its stage's weights: ``replicate`` builds the whole model with the
factory's seed and keeps its stage (exact weights); ``meta`` builds on the meta device and
initialises only this stage with ``reset_parameters()`` (low memory, default init)."""

Say = Callable[[str], None]
"""Where :func:`train` hands the lines it has for a person (the CLI prints them)."""


@dataclass(frozen=True)
class TrainRequest:
    """What to train and how (the arguments of ``autopipe run``). Checked when made: a bad
    value raises ``UsageError`` with one line naming the field."""

    model: ModelFile
    """The model file (:func:`autopipe.modelfile.load_model_file`), the same on every rank."""
    plan: Plan
    """The plan to run (:func:`autopipe.core.plan.load_plan`): its K stages x D replicas
    (x T tensor-parallel ranks) must equal the world size."""
    steps: int = 5
    """Optimizer steps to train."""
    lr: float = 1e-3
    """Learning rate of the optimizer the plan was made for (:func:`make_optimizer`)."""
    init: str = "replicate"
    """One of :data:`INIT_MODES`."""
    state_dict_path: str | None = None
    """A ``torch.save(model.state_dict())`` file to load the weights from; implies a meta
    build."""
    save_dir: str | None = None
    """After training, save the weights as a torch.distributed.checkpoint folder here
    (:func:`autopipe.saving.save_checkpoint`)."""
    trace_path: str | None = None
    """Write what every rank ran and when as a Chrome trace here (for Perfetto and
    ``autopipe replay``)."""
    timeout_s: float = 300.0
    """Process-group timeout in seconds: a dead or stuck rank ends the run with an error
    after this long; at most :data:`MAX_TIMEOUT_S`."""
    threads: int | None = None
    """torch threads per process (None: torch's default)."""
    allow_nonfinite: bool = False
    """Keep training when the loss is NaN or infinite (otherwise every rank stops with an
    error naming the step, before the optimizer step)."""

    def __post_init__(self) -> None:
        problem = _request_problem(self)
        if problem is not None:
            raise UsageError(f"TrainRequest: {problem}")


def _request_problem(request: TrainRequest) -> str | None:
    """What is wrong with ``request``, as one line, or None."""
    if not isinstance(request.model, ModelFile):
        return "model must be a ModelFile (autopipe.modelfile.load_model_file('MODEL.py'))"
    if not isinstance(request.plan, Plan):
        return "plan must be a Plan (autopipe.load_plan('PLAN.json'))"
    if isinstance(request.steps, bool) or not isinstance(request.steps, int) or request.steps < 1:
        return f"steps must be a whole number >= 1, got {request.steps!r}"
    if not _positive(request.lr):
        return f"lr must be a finite number > 0, got {request.lr!r}"
    if request.init not in INIT_MODES:
        return f"init must be one of {', '.join(INIT_MODES)}, got {request.init!r}"
    if not _positive(request.timeout_s) or request.timeout_s > MAX_TIMEOUT_S:
        return f"timeout_s must be > 0 and at most {MAX_TIMEOUT_S:g} s, got {request.timeout_s!r}"
    threads = request.threads
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)):
        return f"threads must be a whole number >= 1 or None, got {threads!r}"
    if threads is not None and threads < 1:
        return f"threads must be a whole number >= 1 or None, got {threads!r}"
    for field in ("state_dict_path", "save_dir", "trace_path"):
        if getattr(request, field) == "":
            return f"{field} is empty; give a path or None"
    return None


def _positive(value: object) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


@dataclass(frozen=True)
class StepRecord:
    """One training step as the rank computing the loss saw it."""

    step: int
    """1 for the first step."""
    loss: float
    """The step's loss over the whole (global) batch."""
    time_s: float
    """Wall-clock seconds of the step's forward and backward passes (the first step also
    infers the stage shapes: one extra forward/backward)."""


@dataclass(frozen=True)
class TrainResult:
    """What one rank of :func:`train` did."""

    rank: int
    world_size: int
    reports_loss: bool
    """Whether this rank computes the loss (the last chunk's rank of replica 0); only it
    has ``steps``."""
    steps: tuple[StepRecord, ...]
    optimizer: str
    """The class name of the optimizer that ran (``ZeroRedundancyOptimizer`` under
    ``shard = optimizer``)."""
    received_shapes: list[list[int]]
    """The shapes this rank's first chunk receives (one TP rank's share under sequence
    parallelism); empty for the first stage."""

    @property
    def median_step_s(self) -> float | None:
        """The median step time after step 1 (which also infers shapes), None without steps."""
        steady = [s.time_s for s in self.steps[1:]] or [s.time_s for s in self.steps]
        return statistics.median(steady) if steady else None


def train(
    request: TrainRequest,
    say: Say | None = None,
    steps_done: Callable[[TrainResult], None] | None = None,
) -> TrainResult:
    """Train ``request.plan`` on this rank's stage for ``request.steps`` steps; call on every
    rank (started by torchrun; a process group already initialised stays the caller's, one
    made here is destroyed at the end).

    ``say`` gets the lines for a person (the run's shape on rank 0, each step's loss and time
    on the rank computing the loss, what was written). ``steps_done`` is called on every
    rank once the steps are done, before the trace and the checkpoint are written.

    A rank whose start-up waits inside c10d for a peer that failed (a new group's
    rendezvous, where no exception can reach it) is ended by :data:`stuck_exit` with the
    peer's cause :data:`STUCK_GRACE_S` after the peer published it, not after the timeout
    (by default :func:`end_stuck_rank`: the line on stderr, exit 1)."""
    say = say or _silent
    _check_outputs(request)
    owns_group, rank, world = _join_process_group(request)
    from autopipe.runtime.distributed.failures import run_board

    # One failure board from here on: whichever phase a rank fails in, start-up or step,
    # its line reaches the peers, whichever phase they are in.
    with run_board():
        with _start_up(rank) as start:
            start.phase = "checking the plan against the world size"
            _check_world_size(request.plan, rank, world)
            pipe, batch = _build_pipeline(request, world, start)
            if rank == 0:
                say(_shape_line(request.plan, world, pipe.data_parallel_size))
            start.phase = "making the optimizer"
            optimizer = make_optimizer(
                request.plan,
                pipe.parameters(),
                request.lr,
                pipe.replica_group,
                pipe.expert_parameters,
                pipe.expert_replica_group,
            )
            start.phase = "preparing the first step"
            local = pipe.local_batch(batch)
            trace = _pipeline_trace(pipe) if request.trace_path else None
        records = _run_steps(request, pipe, optimizer, local, trace, say)
        result = TrainResult(
            rank=rank,
            world_size=world,
            reports_loss=_reports_loss(pipe),
            steps=tuple(records),
            optimizer=type(optimizer).__name__,
            received_shapes=pipe.received_shapes[0] if pipe.received_shapes else [],
        )
        if result.median_step_s is not None:
            say(f"median step time {result.median_step_s * 1e3:.1f} ms (after step 1)")
        if steps_done is not None:
            steps_done(result)
        _write_outputs(request, pipe, trace, rank, say)
    if owns_group:
        from autopipe.runtime.distributed.process import shutdown

        shutdown()
    return result


def _check_outputs(request: TrainRequest) -> None:
    """Refuse (``UsageError``, before any process group) a trace file or checkpoint folder
    that cannot be written: an input overwritten, a folder that takes no new file, ..."""
    if request.trace_path is not None:
        inputs = (request.model.path, request.state_dict_path)
        check_output(request.trace_path, "trace_path", inputs=inputs)
    if request.save_dir is not None:
        problem = save_dir_problem(request.save_dir)
        if problem is None and request.trace_path is not None:
            problem = inside_folder_problem(
                request.trace_path, "trace_path", request.save_dir, "save_dir"
            )
        if problem is not None:
            raise UsageError(problem)


def _silent(line: str) -> None:
    """The default ``say``: a Python caller reads the TrainResult instead."""


def _join_process_group(request: TrainRequest) -> tuple[bool, int, int]:
    """(whether the group is made here, this rank, the world size): torch's threads set and
    the process group joined (torchrun's variables), within ``request.timeout_s``."""
    import torch
    import torch.distributed as dist

    from autopipe.runtime.distributed.process import LaunchError, init_distributed

    if request.threads:
        torch.set_num_threads(request.threads)
    try:
        # A process group the caller made (a script running several plans) stays theirs.
        owns_group = not dist.is_initialized()
        rank, world = init_distributed(timeout_s=request.timeout_s)
    except LaunchError as exc:
        raise UsageError(str(exc)) from exc
    except Exception as exc:  # rendezvous failure or timeout
        raise Failure(
            f"could not join the process group within {request.timeout_s:g} s: {exc}"
        ) from exc
    return owns_group, rank, world


class _StartUp:
    """Which phase of its start-up this rank is in (one line, after "failed")."""

    def __init__(self) -> None:
        self.phase = "starting"


def end_stuck_rank(message: str) -> None:
    """End this process at once (exit 1) with ``message`` as its one error line on stderr:
    the default :data:`stuck_exit`, for a script calling :func:`train`. Called from the
    watching thread while the main thread waits inside c10d, where no exception reaches
    it; the process group is broken for good by then (a peer is gone), so ending the
    process is what the timeout would have come to, minus the wait."""
    from autopipe.runtime.distributed.process import exit_process

    sys.stderr.write(f"{message}\n")
    exit_process(1)


stuck_exit: Callable[[str], None] | None = end_stuck_rank
"""What ends a rank whose start-up is stuck after a peer failed: :func:`end_stuck_rank`
(print the line, exit 1) for every caller of :func:`train`; ``autopipe run`` sets its own
(the line as its CLI error, handed to torchrun's summary too); None: wait for the timeout.

A peer that fails while this rank waits for it inside c10d (a new group's rendezvous:
``new_group``, a DeviceMesh) leaves it there until ``--timeout``: c10d's wait cannot be
interrupted, not even by torchrun's SIGTERM once a handler is installed (Python runs a
signal handler only between bytecodes), and without torchrun's agent nothing else stops
it. A thread watching the failure board then hands it the peer's line."""

STUCK_GRACE_S = 3.0
"""How long after a peer's line appears a rank still in its start-up is taken as stuck:
a rank that is not stuck notices the peer itself at once (a closed connection, torchrun's
SIGTERM with its :data:`~autopipe.cli.run.TERMINATION_GRACE_S` of 2 s) and reports it."""

_WATCH_POLL_S = 0.5
"""How often the watching thread reads the board (each read also probes that the store
still accepts, one TCP connection)."""


def _watch_peers(rank: int, start: _StartUp, done: threading.Event, lock: threading.Lock) -> None:
    """Start a daemon thread that, once a peer's line is on the board and this rank's
    start-up has not ended :data:`STUCK_GRACE_S` later, calls :data:`stuck_exit` with this
    rank's line naming it. Nothing without ``stuck_exit`` or a board to read."""
    from autopipe.runtime.distributed.failures import board_reader

    act = stuck_exit
    read = board_reader() if act is not None else None
    if act is None or read is None:
        return

    def watch() -> None:
        cause, seen_s = None, 0.0
        while not done.wait(_WATCH_POLL_S):
            if cause is None:
                line = read()
                if line is not None and not line.startswith(f"rank {rank} "):
                    cause, seen_s = line, time.monotonic()
            elif time.monotonic() - seen_s >= STUCK_GRACE_S:
                with lock:  # the main thread, reporting by itself, sets done under it
                    if not done.is_set():
                        act(f"rank {rank} stopped while {start.phase}: {cause}")
                return

    threading.Thread(target=watch, name="autopipe-peer-watch", daemon=True).start()


@contextlib.contextmanager
def _start_up(rank: int) -> Iterator[_StartUp]:
    """The start-up between joining the process group and the first step, whose failures
    reach every rank (issue 33): a rank whose own start-up fails publishes its line (``rank
    R failed while PHASE: ERROR``, the error as its own error line shows it) to the process
    group's c10d store before it raises (:func:`~autopipe.runtime.distributed.failures.
    publish_failure`); a rank that then finds a peer gone (a closed connection in the plan
    agreement, a new group's rendezvous timing out) ends with that line instead of "a peer
    rank failed", or, when the store's host (rank 0 without torchrun's agent) is the rank
    that failed, saying so. torchrun's SIGTERM reads the same line (``autopipe.cli.run``)."""
    from autopipe.runtime.distributed.failures import (
        PUBLISHED_WAIT_S,
        failure_cause,
        publish_failure,
        raised_on_every_rank,
    )

    start = _StartUp()
    done, lock = threading.Event(), threading.Lock()
    _watch_peers(rank, start, done, lock)
    try:
        yield start
    except Exception as exc:
        with lock:  # this rank reports by itself: the watching thread stands down
            done.set()
        if _peer_failed(exc):
            cause = failure_cause(PUBLISHED_WAIT_S)
            if cause is not None:
                raise Failure(f"rank {rank} stopped while {start.phase}: {cause}") from exc
            raise
        if not raised_on_every_rank(exc):  # the peers know that one already
            publish_failure(f"rank {rank} failed while {start.phase}: {_error_text(exc)}")
        raise
    finally:
        with lock:
            done.set()


def _peer_failed(exc: BaseException) -> bool:
    """Whether ``exc`` says a peer is gone or silent rather than what this rank did wrong."""
    from autopipe.runtime.distributed.failures import PipelineRankError, is_comm_failure

    if isinstance(exc, PipelineRankError) or isinstance(exc.__cause__, PipelineRankError):
        return True
    return not isinstance(exc, (UsageError, Failure)) and is_comm_failure(exc)


def _error_text(exc: BaseException) -> str:
    """``exc`` as this rank's own error line shows it (``autopipe.cli``): the message of an
    autopipe error, ``Type: message`` of any other; first line only."""
    text = str(exc).strip()
    if isinstance(exc, (UsageError, Failure, MemoryError)):
        return text.splitlines()[0] if text else type(exc).__name__
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _check_world_size(plan: Plan, rank: int, world: int) -> None:
    """Refuse (UsageError, on every rank alike) a world size the plan does not fit: K x D
    ranks for a pipeline, the mesh's pp x dp x tp for a mesh plan."""
    from autopipe.runtime.distributed.layout import PlanWorldSizeError, rank_layout
    from autopipe.runtime.distributed.mesh import mesh_size_problem

    problems = mesh_problems(plan)  # the same mesh rules emit applies, before any group
    if problems:
        raise UsageError(f"the plan cannot run: {problems[0]}")
    try:
        if uses_mesh(plan):
            problem = mesh_size_problem(plan, world)
            if problem is not None:
                raise PlanWorldSizeError(problem)
        else:
            rank_layout(rank, world, plan.num_stages, plan.data_parallel)
    except PlanWorldSizeError as exc:
        # Every rank finds the same mismatch: meet at a barrier so all of them report it
        # before the first exit makes torchrun stop the others.
        from autopipe.runtime.distributed.failures import on_every_rank

        _barrier_quietly()
        raise UsageError(str(exc)) from on_every_rank(exc)


def _barrier_quietly() -> None:
    import torch.distributed as dist

    try:
        dist.barrier()
    except Exception:  # a peer is gone: report our own error anyway
        pass


def _build_pipeline(
    request: TrainRequest, world: int, start: _StartUp | None = None
) -> tuple[DistributedPipeline, Any]:
    """This rank's part of the pipeline and the global batch of example inputs (the plan's
    batch for each data-parallel replica). What the model file, the plan or the weights do
    not allow is a UsageError; a peer failing meanwhile, a Failure. ``start`` is told each
    phase (for the line a failure publishes)."""
    from autopipe.runtime.distributed.failures import PipelineRankError
    from autopipe.runtime.distributed.layout import PlanWorldSizeError
    from autopipe.runtime.distributed.pipeline import DistributedPipeline
    from autopipe.runtime.split import StageSplitError

    plan, mf = request.plan, request.model
    start = start or _StartUp()
    start.phase = "loading the state dict"
    state_dict = _load_state_dict(request.state_dict_path)
    meta = request.init == "meta" or state_dict is not None
    try:
        start.phase = "building the model"
        model = mf.build(device="meta" if meta else None)
        replicas = (
            plan.data_parallel
            if uses_mesh(plan)
            else (world // plan.num_stages if world % plan.num_stages == 0 else 1)
        )
        inputs = mf.inputs(plan.batch_size * replicas)
        # Tracing, the cut, the plan agreement, the mesh, TP / FSDP, the weights, the stages.
        start.phase = "building its pipeline stage"
        pipe = DistributedPipeline(
            model, plan, inputs, mf.loss_fn, state_dict=state_dict, orders=plan.actions
        )
    except (ModelFileError, PlanWorldSizeError, StageSplitError, ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from exc
    except PipelineRankError as exc:
        raise Failure(str(exc)) from exc
    return pipe, inputs


def _load_state_dict(path: str | None) -> dict[str, torch.Tensor] | None:
    """The weights saved at ``path`` by ``torch.save(model.state_dict())`` (memory-mapped), or
    None without a path."""
    import torch

    if not path:
        return None
    if (Path(path) / ".metadata").is_file():  # what autopipe run --save writes
        raise UsageError(
            f"--state-dict {path} is a torch.distributed.checkpoint folder (autopipe run "
            "--save writes one), not a torch.save file: convert it once with `python -m "
            f"torch.distributed.checkpoint.format_utils dcp_to_torch {path} weights.pt` and "
            "pass --state-dict weights.pt"
        )
    if not Path(path).is_file():
        raise UsageError(f"state_dict file not found: {path}")
    loaded: dict[str, torch.Tensor] = torch.load(
        path, map_location="cpu", mmap=True, weights_only=True
    )
    return loaded


def _shape_line(plan: Plan, world: int, replicas: int) -> str:
    """The run's shape in one line: stages, replicas, mesh, backend, schedule, batches."""
    import torch.distributed as dist

    mesh_note = (
        (f" x TP {plan.tensor_parallel}" if plan.tensor_parallel > 1 else "")
        + (f", experts over EP {plan.expert_parallel}" if plan.expert_parallel > 1 else "")
        + (f", shard {plan.shard}" if plan.shard != "none" else "")
    )
    return (
        f"autopipe run: {plan.num_stages} stages x {replicas} replicas{mesh_note} on "
        f"{world} processes ({dist.get_backend()}), schedule {plan.schedule}, "
        + (f"{plan.virtual_stages} chunks per rank, " if plan.virtual_stages > 1 else "")
        + ("stages torch.compile'd, " if plan.trainer.compile else "")
        + f"{plan.microbatches} micro-batches of {plan.batch_size // plan.microbatches}, "
        f"global batch {plan.batch_size * replicas}"
    )


def _reports_loss(pipe: DistributedPipeline) -> bool:
    """Whether this rank computes the loss: the last chunk's rank (rank 0 in a V-shape), in
    replica 0."""
    return bool(pipe.holds_last and pipe.layout.replica == 0)


def _pipeline_trace(pipe: DistributedPipeline) -> PipelineTrace:
    from autopipe.runtime.distributed.recorder import PipelineTrace

    return PipelineTrace(pipe)


def _run_steps(
    request: TrainRequest,
    pipe: DistributedPipeline,
    optimizer: Any,
    local: Any,
    trace: PipelineTrace | None,
    say: Say,
) -> list[StepRecord]:
    """Train ``request.steps`` steps on this replica's share ``local`` of the batch; the
    records of the rank computing the loss (empty on the others). A loss that is not finite stops every rank before its optimizer step (the
    weights stay as they were) unless ``request.allow_nonfinite``."""
    from autopipe.runtime.distributed.agree import nonfinite
    from autopipe.runtime.distributed.failures import PipelineRankError

    reporter = _reports_loss(pipe)
    records: list[StepRecord] = []
    for step in range(1, request.steps + 1):
        optimizer.zero_grad(set_to_none=True)
        try:
            loss = pipe.step(local if pipe.holds_first or pipe.holds_last else None)
        except PipelineRankError as exc:
            raise Failure(str(exc)) from exc
        bad = None if request.allow_nonfinite else nonfinite(pipe.last_loss)
        if bad is not None:
            raise Failure(
                f"the loss is {bad} in step {step}; stopped before the optimizer step "
                "(lower --lr, check the data, or pass --allow-nonfinite to keep going)"
            )
        with trace.optimizer() if trace is not None else contextlib.nullcontext():
            optimizer.step()
        if reporter and loss is not None:
            records.append(StepRecord(step, float(loss), pipe.last_step_s))
            say(
                f"step {step}/{request.steps}  loss {float(loss):.4f}  "
                f"{pipe.last_step_s * 1e3:.1f} ms"
            )
    return records


def _write_outputs(
    request: TrainRequest,
    pipe: DistributedPipeline,
    trace: PipelineTrace | None,
    rank: int,
    say: Say,
) -> None:
    """The trace (gathered on rank 0) and the checkpoint (every rank its part), as asked."""
    if trace is not None and request.trace_path is not None:
        timeline = trace.gather()
        if timeline is not None:
            atomic_write_json(request.trace_path, to_chrome_trace(timeline))
            say(f"wrote the trace of {request.steps} steps to {request.trace_path}")
    if request.save_dir is not None:
        save_checkpoint(pipe, request.save_dir)
        if rank == 0:
            say(f"saved the trained weights to {request.save_dir} (torch.distributed.checkpoint)")


def make_optimizer(
    plan: Plan,
    parameters: Iterable[torch.nn.Parameter],
    lr: float,
    group: torch.distributed.ProcessGroup | None = None,
    experts: Collection[int] = frozenset(),
    expert_group: torch.distributed.ProcessGroup | None = None,
) -> Any:
    """The optimizer whose state the plan's memory figures assume (the planning request's
    ``optimizer``): SGD, SGD with momentum 0.9, else AdamW. With ``shard = optimizer``
    (ZeRO-1) it is wrapped in torch's ``ZeroRedundancyOptimizer`` over the data-parallel
    ``group`` (the stage's replicas; None: the whole world). ``experts``: ids of the
    expert-parallel shards among ``parameters`` (``DistributedPipeline.expert_parameters``),
    which ZeRO-1 shards apart, over ``expert_group`` (``ExpertZeroOptimizer``)."""
    import torch

    name = plan.optimizer or "adam"
    params = list(parameters)
    if not params:
        # A stage of parameter-free layers (an activation, rotary embeddings) still runs.
        return _NothingToOptimize()
    cls: Any
    if name == "sgd":
        cls, options = torch.optim.SGD, {"lr": lr}
    elif name == "sgd-momentum":
        cls, options = torch.optim.SGD, {"lr": lr, "momentum": 0.9}
    else:
        cls, options = torch.optim.AdamW, {"lr": lr}
    if plan.shard == "optimizer" and experts:
        from autopipe.runtime.distributed.expert_parallel import ExpertZeroOptimizer

        dense = [p for p in params if id(p) not in experts]
        spread = [p for p in params if id(p) in experts]
        return ExpertZeroOptimizer(cls, dense, spread, group, expert_group, **options)
    if plan.shard == "optimizer":
        from autopipe.runtime.distributed.mesh import make_zero_optimizer

        return make_zero_optimizer(cls, params, group, **options)
    return cls(params, **options)


class _NothingToOptimize:
    """The optimizer of a stage without parameters."""

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

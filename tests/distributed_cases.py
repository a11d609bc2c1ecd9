"""Models, plans and a rank entry point shared by the torch.distributed tests and benchmark.

Not a test module itself (no ``test_`` prefix): the spawned ranks import it by name.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import torch
from runtime_helpers import load_example
from torch import nn

from autopipe.core.plan import Plan, StagePlan

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun sets for one rank on one node."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
    }


class SkipNet(nn.Module):
    """Four units; ``a`` skips from unit 0 to unit 3 and the second input ``scale`` is used only
    by the last unit, so both must be relayed through the middle stages."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.f1 = nn.Linear(width, width)
        self.f2 = nn.Linear(width, width)
        self.f3 = nn.Linear(width, width)
        self.f4 = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        a = torch.tanh(self.f1(x))
        b = torch.tanh(self.f2(a))
        c = torch.tanh(self.f3(b))
        return self.f4(c + a) * scale


class InPlaceNet(nn.Module):
    """Units that start by writing into their input: ``act`` is ``nn.ReLU(inplace=True)`` and
    ``f3``'s unit begins with ``h.add_(1)`` (the glue joins the next module's unit), so a cut
    before either hands a stage an input it modifies in place."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.f1 = nn.Linear(width, width)
        self.act = nn.ReLU(inplace=True)
        self.f2 = nn.Linear(width, width)
        self.f3 = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.f2(self.act(self.f1(x)))
        h.add_(1.0)
        return self.f3(h)


def skipnet_inputs(batch_size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch_size, 16, generator=g), torch.rand(batch_size, 1, generator=g) + 0.5


def skipnet_loss(output: torch.Tensor, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return output.pow(2).mean() + 0.1 * (output * inputs[0][:, :4]).mean()


def skipnet_loss_one(output: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    return output.pow(2).mean() + 0.1 * (output * inputs[:, :4]).mean()


def tiny_gpt(tie_weights: bool = False) -> tuple[nn.Module, Any, Any]:
    """(model, inputs, loss_fn): examples/gpt.py at test size, 4 blocks (``tie_weights``: the
    head shares the token embedding, so the first and last stage hold one parameter)."""
    gpt = load_example("gpt")
    cfg = gpt.GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_layer=4, n_head=2)
    model = gpt.build_model(
        vocab_size=64, seq_len=8, d_model=16, n_layer=4, n_head=2, tie_weights=tie_weights
    )
    return model, gpt.example_inputs(8, cfg), gpt.loss_fn


def make_plan(
    stage_units: list[list[str]],
    microbatches: int,
    batch_size: int,
    schedule: str = "gpipe",
    checkpoint: list[bool] | None = None,
    virtual_stages: int = 1,
) -> Plan:
    """A hand-made plan: ``stage_units`` are the K x V chunks in model order, placed on the
    ranks as ``schedule`` places them (loop or V-shape)."""
    from autopipe.core.schedule_rules import chunk_ranks

    checkpoint = checkpoint or [False] * len(stage_units)
    ranks = chunk_ranks(schedule, len(stage_units) // virtual_stages, virtual_stages)
    stages = [
        StagePlan(index=i, device="cpu", units=units, checkpoint=checkpoint[i], rank=ranks[i])
        for i, units in enumerate(stage_units)
    ]
    return Plan(
        num_stages=len(stages) // virtual_stages,
        microbatches=microbatches,
        microbatch_size=batch_size // microbatches,
        batch_size=batch_size,
        stages=stages,
        schedule=schedule,
        virtual_stages=virtual_stages,
    )


class ViewNet(nn.Module):
    """Four units; ``split`` sends on a contiguous view (``unflatten``), and a tensor ``y``
    that its own ``y * gate`` saved for the weight gradient: the zero-bubble input pass
    detaches what a chunk sends in place, which autograd refuses for the view, and which
    breaks the saved ``y`` for the weight pass. ``join`` sums after the cut (an expanded,
    non-contiguous input gradient); ``f1``'s output skips to the last unit."""

    class Split(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.lin = nn.Linear(width, width)
            self.gate = nn.Parameter(torch.linspace(0.5, 1.5, width))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = torch.tanh(self.lin(x))
            return (y * self.gate).unflatten(1, (2, -1)), y

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.f1 = nn.Linear(width, width)
        self.split = self.Split(width)
        self.join = nn.Linear(width // 2, width)
        self.f4 = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.f1(x)
        a, y = self.split(h)
        return self.f4(self.join(a).sum(1) + h + y)


GPT_UNITS = ["tok_emb", "pos_emb", "drop", *(f"blocks.{i}" for i in range(4)), "ln_f", "head"]

SPLITS = {
    # units per chunk -> chunk ends, for each chunk count
    "gpt": {2: [4, 9], 4: [2, 4, 6, 9], 8: [2, 3, 4, 5, 6, 7, 8, 9]},
    # pos_emb alone: its output reaches the chunk's output without meeting an input that
    # needs a gradient (the zero-bubble weight pass would miss it)
    "gpt_leak": {4: [1, 2, 5, 9]},
    "four": {2: [2, 4], 4: [1, 2, 3, 4]},
}


def case(name: str, num_stages: int) -> tuple[nn.Module, Any, Any, list[list[str]]]:
    """(model, inputs, loss_fn, units per chunk) for a named test case cut into
    ``num_stages`` chunks."""
    if name in ("gpt", "gpt_tied", "gpt_leak"):
        model, inputs, loss_fn = tiny_gpt(tie_weights=name == "gpt_tied")
        units = GPT_UNITS
        splits = SPLITS["gpt_leak" if name == "gpt_leak" else "gpt"][num_stages]
    elif name == "inplace":
        torch.manual_seed(0)
        model, inputs, loss_fn = InPlaceNet(), skipnet_inputs(8)[0], skipnet_loss_one
        units = ["f1", "act", "f2", "f3"]
        splits = {2: [1, 4], 4: [1, 2, 3, 4]}[num_stages]
    elif name == "views":
        torch.manual_seed(0)
        model, inputs, loss_fn = ViewNet(), skipnet_inputs(8)[0], skipnet_loss_one
        units = ["f1", "split", "join", "f4"]
        splits = SPLITS["four"][num_stages]
    else:
        torch.manual_seed(0)
        model, inputs, loss_fn = SkipNet(), skipnet_inputs(8), skipnet_loss
        units = ["f1", "f2", "f3", "f4"]
        splits = SPLITS["four"][num_stages]
    starts = [0, *splits[:-1]]
    return model, inputs, loss_fn, [units[a:b] for a, b in zip(starts, splits, strict=True)]


def reference(model: nn.Module, inputs: Any, loss_fn: Any) -> tuple[float, dict[str, torch.Tensor]]:
    """Single-process loss and gradients on the whole batch."""
    model.zero_grad()
    out = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
    loss = loss_fn(out, inputs)
    loss.backward()
    # Every name of a tied parameter maps to its one gradient.
    grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return float(loss.detach()), grads


def run_correctness(rank: int, world_size: int, port: int, out_dir: str, jobs: list[dict]) -> None:
    """Rank entry point: for each job build the pipeline, take 2 SGD steps, compare with the
    single-process model and save ``{job: {loss_err, grad_err, loss2_err}}`` to out_dir."""
    import copy

    os.environ.update(rank_env(rank, world_size, port))
    torch.set_num_threads(1)
    from autopipe.runtime.distributed import (
        DistributedPipeline,
        ScheduleRuleError,
        exit_process,
        init_distributed,
        shutdown,
    )

    init_distributed(timeout_s=60)
    results: dict[str, dict[str, Any]] = {}
    for job in jobs:
        replicas = world_size // job["stages"]
        virtual = job.get("virtual", 1)
        model, inputs, loss_fn, stage_units = case(job["model"], job["stages"] * virtual)
        batch = inputs if isinstance(inputs, tuple) else inputs
        size = (batch[0] if isinstance(batch, tuple) else batch).shape[0]
        ref_model = copy.deepcopy(model)
        ref_loss, ref_grads = reference(ref_model, inputs, loss_fn)
        plan = make_plan(
            stage_units,
            job["microbatches"],
            size // replicas,
            job["schedule"],
            job.get("checkpoint"),
            virtual,
        )
        key = job_key(job, world_size)
        for stage, granularity in zip(plan.stages, job.get("granularity", []), strict=False):
            stage.checkpoint_granularity = granularity
        if "ranks" in job:  # a placement other than the schedule's own
            for stage, r in zip(plan.stages, job["ranks"], strict=True):
                stage.rank = r
        if job.get("refused"):
            # A plan the schedule cannot run: every rank refuses it before talking to a peer.
            try:
                DistributedPipeline(model, plan, inputs, loss_fn)
            except ScheduleRuleError as exc:
                results[key] = {"refused": str(exc)}
            else:
                results[key] = {"refused": ""}
            continue
        # The plan's own actions: torch's schedule is checked against them as `autopipe run` does.
        pipe = DistributedPipeline(model, plan, inputs, loss_fn, orders=plan.actions)
        local = pipe.local_batch(inputs)
        loss = pipe.step(local)
        grads = pipe.module.model_named_parameters()
        # A parameter left without a gradient is an infinite error, not a crash.
        grad_err = max(
            (
                float((p.grad - ref_grads[n]).abs().max()) if p.grad is not None else float("inf")
                for n, p in grads.items()
            ),
            default=0.0,
        )
        # A second step after SGD on both sides: the training curves agree too.
        own = list(pipe.parameters())
        opt = torch.optim.SGD(own or [torch.zeros(1, requires_grad=True)], lr=0.5)
        ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.5)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_loss2, _ = reference(ref_model, inputs, loss_fn)
        loss2 = pipe.step(local)
        results[key] = {
            "grad_err": grad_err,
            "params": float(len(grads)),
            "loss_err": abs(float(loss) - ref_loss) if loss is not None else -1.0,
            "loss2_err": abs(float(loss2) - ref_loss2) if loss2 is not None else -1.0,
            "holds_last": float(pipe.holds_last),
            "unsplit": float(len(pipe.unsplit_chunks)),
            "unit_graphs": float(sum(len(c._units or []) for c in pipe.chunks)),
            "names": sorted(grads),
        }
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    shutdown()
    exit_process(0)  # Python's teardown can abort a rank after a clean run


def job_key(job: dict, world_size: int) -> str:
    """The name of a correctness job's results: model, schedule, K, V and D."""
    replicas = world_size // job["stages"]
    cp = "-ckpt" if any(job.get("checkpoint") or []) else ""
    cp += "-unit" if "unit" in job.get("granularity", []) else ""
    return (
        f"{job['model']}-{job['schedule']}-K{job['stages']}xV{job.get('virtual', 1)}"
        f"xD{replicas}-M{job['microbatches']}{cp}{'-refused' if job.get('refused') else ''}"
    )


def spawn_ranks(fn: Any, world_size: int, args: tuple, timeout_s: float = 120.0) -> None:
    """Run ``fn(rank, *args)`` in ``world_size`` spawned processes; fail instead of hanging."""
    import time

    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=args, nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"{world_size} ranks did not finish within {timeout_s:g} s")


TINY_GPT_FILE = f"""\
import sys
sys.path.insert(0, {str(EXAMPLES)!r})
from gpt import GPTConfig, build_model as _build, example_inputs as _inputs, loss_fn  # noqa: F401

CFG = dict(vocab_size=64, seq_len=8, d_model=16, n_layer=4, n_head=2)


def build_model():
    return _build(**CFG)


def example_inputs(batch_size=8):
    return _inputs(batch_size, GPTConfig(**CFG))
"""
"""A model file for ``autopipe run`` tests: examples/gpt.py at test size (9 units)."""

TINY_GPT_UNITS = ["tok_emb", "pos_emb", "drop", *(f"blocks.{i}" for i in range(4)), "ln_f", "head"]


def tiny_gpt_files(
    directory: Path, schedule: str = "gpipe", virtual_stages: int = 1
) -> tuple[Path, Path]:
    """(model file, plan JSON for 2 ranks: 2 stages, or 4 chunks with ``virtual_stages=2``)
    written to ``directory`` for ``autopipe run`` tests."""
    model = directory / "tiny_gpt.py"
    model.write_text(TINY_GPT_FILE)
    plan = directory / "plan.json"
    units = TINY_GPT_UNITS
    chunks = (
        [units[:5], units[5:]]
        if virtual_stages == 1
        else [units[:2], units[2:4], units[4:6], units[6:]]
    )
    m = 4 if schedule == "dualpipev" else 2
    make_plan(chunks, m, 4, schedule=schedule, virtual_stages=virtual_stages).save(plan)
    return model, plan


# -- launching ranks for fault tests ----------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


def launch_ranks(
    world_size: int, argv: list[str], env_extra: dict[str, str] | None = None
) -> list[Any]:
    """``autopipe run ARGV`` in ``world_size`` processes started directly with torchrun's
    variables: no torchrun agent kills the survivors, so they show the runtime's own
    behaviour. Returns the ``subprocess.Popen`` objects (stdout and stderr piped, text)."""
    import subprocess
    import sys

    port = free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, **rank_env(rank, world_size, port), OMP_NUM_THREADS="1")
        env.update(env_extra or {})
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "autopipe", "run", *argv],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=ROOT,
            )
        )
    return procs


def finish(proc: Any, timeout_s: float) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``proc``; an AssertionError if it outlives ``timeout_s``."""
    import subprocess

    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError(f"rank did not exit within {timeout_s} s (hang)") from None
    return proc.returncode, out, err


def wait_for_step(proc: Any, step: int, timeout_s: float = 90) -> None:
    """Read ``proc``'s stdout until the last stage reports ``step`` (lines carry a rank prefix)."""
    import re
    import time

    pattern = re.compile(rf"^(\[rank \d+\] )?step {step}/")
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    for line in proc.stdout:
        if pattern.match(line):
            return
        if time.monotonic() > deadline:
            break
    raise AssertionError(f"the last stage never printed step {step}")


FAULT_MARK = "FAULT INJECTED"

FAULT_MODEL = f"""\
import os
import signal
import time

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

# AUTOPIPE_FAULT=KIND@RANK: on that rank, after AUTOPIPE_FAULT_AFTER forward calls of its
# Linear layers (step 1 makes 2 on each stage, one per micro-batch; the fake-tensor run that
# works out the stage shapes at start-up does not count), hang, raise, die (SIGKILL) or
# turn the activations into NaN (slowraise: raise an error whose message takes
# AUTOPIPE_FAULT_SLOW_S seconds to make); kill-save@RANK and hang-save@RANK do so in `autopipe run --save`.
KIND, _, RANK = os.environ.get("AUTOPIPE_FAULT", "").partition("@")
AFTER = int(os.environ.get("AUTOPIPE_FAULT_AFTER", "3"))
calls = [0]


class SlowError(ValueError):
    # An error whose message takes AUTOPIPE_FAULT_SLOW_S to make: the rank is inside its
    # own error path for that long (where torchrun's SIGTERM may find it).

    def __str__(self):
        time.sleep(float(os.environ.get("AUTOPIPE_FAULT_SLOW_S", "3")))
        return "injected fault"


def _fault(module, args, output):
    if isinstance(output, FakeTensor):
        return None
    calls[0] += 1
    if calls[0] <= AFTER:
        return None
    if calls[0] == AFTER + 1:
        print("{FAULT_MARK}:", KIND, "on rank", RANK, flush=True)
    if KIND == "hang":
        time.sleep(3600)
    if KIND == "raise":
        raise ValueError("injected fault")
    if KIND == "slowraise":
        raise SlowError()
    if KIND == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if KIND == "nan":
        return output * float("nan")
    return None


def _fault_in_save(self, plan, planner):
    # KIND kill-save / hang-save: torch.distributed.checkpoint asks this rank to write its
    # files; it dies (SIGKILL) or hangs before writing any, as a crash mid-save would.
    print("{FAULT_MARK}:", KIND, "on rank", RANK, flush=True)
    if KIND == "kill-save":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(3600)


if KIND in ("kill-save", "hang-save") and os.environ.get("RANK") == RANK:
    from torch.distributed.checkpoint import FileSystemWriter

    FileSystemWriter.write_data = _fault_in_save


def build_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    if KIND in ("hang", "raise", "slowraise", "kill", "nan") and os.environ.get("RANK") == RANK:
        for layer in model.modules():
            if isinstance(layer, nn.Linear):
                layer.register_forward_hook(_fault)
    return model


def example_inputs(batch_size=4):
    return torch.randn(batch_size, 4, generator=torch.Generator().manual_seed(0))


def loss_fn(output, inputs):
    return output.pow(2).mean()
"""
"""A 3-unit model file (units ``0``, ``1``, ``2``) whose fault is chosen by environment."""


def fault_files(
    directory: Path, replicas: int = 1, stage_units: list[list[str]] | None = None, m: int = 2
) -> tuple[Path, Path]:
    """(FAULT_MODEL file, plan JSON: 2 stages by default, batch 4 per replica in M
    micro-batches)."""
    model = directory / "faulty.py"
    model.write_text(FAULT_MODEL)
    units = stage_units or [["0", "1"], ["2"]]
    plan = make_plan(units, m, 4)
    plan.data_parallel = replicas
    path = directory / f"plan_{'_'.join(''.join(s) for s in units)}_m{m}_d{replicas}.json"
    plan.save(path)
    return model, path


def multi_stage_fault_files(directory: Path, schedule: str) -> tuple[Path, Path]:
    """(FAULT_MODEL with three Linear layers, units ``0`` ... ``4``; a plan of 2 ranks x 2
    chunks under the multi-stage ``schedule``, batch 4 in 2 micro-batches)."""
    model = directory / "faulty5.py"
    two = "nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))"
    three = "nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))"
    assert two in FAULT_MODEL
    model.write_text(FAULT_MODEL.replace(two, three))
    plan = directory / f"plan_{schedule}.json"
    chunks = [["0"], ["1", "2"], ["3"], ["4"]]
    make_plan(chunks, 2, 4, schedule=schedule, virtual_stages=2).save(plan)
    return model, plan


class Drill:
    """One torchrun launch of a fault: exit code, merged output, and timings in seconds."""

    def __init__(self, code: int, output: str, total_s: float, after_fault_s: float | None):
        self.code, self.output = code, output
        self.total_s = total_s
        self.after_fault_s = after_fault_s
        """From the first FAULT_MARK line to torchrun's exit; None if no fault fired."""

    def lines(self, needle: str) -> list[str]:
        return [line for line in self.output.splitlines() if needle in line]


def torchrun_drill(
    nproc: int,
    command: list[str],
    env_extra: dict[str, str] | None = None,
    deadline_s: float = 120.0,
    shell: bool = False,
) -> Drill:
    """Run ``torchrun --nproc-per-node NPROC -m autopipe run COMMAND`` (or, with
    ``shell``, ``COMMAND`` as one ``sh -c`` line per rank, so it can name ``$RANK``), with
    stdout and stderr merged. Past ``deadline_s`` the whole process group is killed and the
    drill fails as a hang."""
    import signal
    import subprocess
    import sys
    import threading
    import time

    launcher = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-port", str(free_port()), "--monitor-interval", "0.2",
    ]  # fmt: skip
    if shell:
        launcher += ["--no-python", "sh", "-c", " ".join(command)]
    else:
        launcher += ["-m", "autopipe", "run", *command]
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    start = time.monotonic()
    proc = subprocess.Popen(
        launcher,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        start_new_session=True,  # so a hang can be ended with every rank
    )
    lines: list[str] = []
    fault_at: list[float] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if FAULT_MARK in line and not fault_at:
                fault_at.append(time.monotonic())
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        reader.join(5)
        raise AssertionError(
            f"torchrun did not exit within {deadline_s:g} s (hang); output:\n" + "".join(lines)
        ) from None
    end = time.monotonic()
    reader.join(5)
    return Drill(code, "".join(lines), end - start, end - fault_at[0] if fault_at else None)


# -- a model whose traced graph depends on the process's string hash seed ----------------------

SET_ORDER_NAMES = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]

SET_ORDER_MODEL = f"""\
import torch
from torch import nn

NAMES = {SET_ORDER_NAMES!r}
SCALE = {{name: 0.5 + 0.25 * i for i, name in enumerate(NAMES)}}


class SetOrderNet(nn.Module):
    \"\"\"Units inp, mid, out. The forward iterates a set of strings, in the order of this
    process's hash seed, to make one product per name: the products are traced in that
    order, so their fx names (mul, mul_1, ...) name other products in another process. The
    products are computed with mid's unit and cross a cut after mid: two ranks with other
    seeds would hand each other the products in other places (and train something else).\"\"\"

    def __init__(self, width=8):
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.mid = nn.Linear(width, width)
        self.out = nn.Linear(width * (len(NAMES) + 1), 4)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        parts = {{}}
        for name in set(NAMES):
            parts[name] = h * SCALE[name]
        return self.out(torch.cat([self.mid(h), *(parts[n] for n in NAMES)], -1))


def build_model():
    torch.manual_seed(0)
    return SetOrderNet()


def example_inputs(batch_size=8):
    return torch.randn(batch_size, 8, generator=torch.Generator().manual_seed(0))


def loss_fn(output, inputs):
    return output.pow(2).mean()
"""
"""A model file (units ``inp``, ``mid``, ``out``) whose traced graph follows PYTHONHASHSEED."""


def set_order_files(directory: Path) -> tuple[Path, Path]:
    """(SET_ORDER_MODEL file, a 2-stage plan ``[inp, mid] | [out]`` at batch 8, M = 2)."""
    model = directory / "set_order.py"
    model.write_text(SET_ORDER_MODEL)
    plan = directory / "set_order_plan.json"
    make_plan([["inp", "mid"], ["out"]], 2, 8).save(plan)
    return model, plan


def hash_seeds_with_other_set_orders() -> tuple[str, str]:
    """Two PYTHONHASHSEED values under which ``set(SET_ORDER_NAMES)`` iterates in different
    orders (checked in child processes, so a test using them can fail)."""
    import subprocess
    import sys

    code = f"print(list(set({SET_ORDER_NAMES!r})))"
    orders: dict[str, str] = {}
    for seed in map(str, range(1, 20)):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        order = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout
        for other, seen in orders.items():
            if seen != order:
                return other, seed
        orders[seed] = order
    raise AssertionError("19 hash seeds gave one set order")

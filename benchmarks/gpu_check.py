"""The GPU check: every CUDA path autopipe has, run once on the GPU(s) of this machine.

One script, a few minutes on one GPU, nothing downloaded (the model is examples/gpt.py at a
GPU size, random weights). It prints one table, each row a measurement against a target:

| check | what is compared | target |
| --- | --- | --- |
| profile sum vs whole | measured profile (CUDA events): sum of unit forward+backward vs the whole model timed in one piece | within 15% |
| unit peak memory | per unit, predicted (analytic saved + output + input-gradient bytes, plus the unit's weight gradients) vs ``max_memory_allocated`` around the unit (median unit; worst shown) | within 25% |
| whole-model peak memory | the planner's one-device memory (parameters, gradients, activations) vs ``max_memory_allocated`` over a real training step | within 25% |
| analytic vs measured | the catalog entry for this GPU (or the nearest by memory) priced per unit vs the measured profile: largest difference in a unit's share of the step; the total ratio is shown | within 10 points |
| parallelize K stages | a K-stage plan run by ``autopipe.parallelize`` with every stage on this GPU: predicted (simulated, stages sharing the device) vs measured iteration | within 20% |
| parallelize memory | the plan's memory summed over its stages vs ``max_memory_allocated`` while it trains | within 30% |
| copy-stream overlap | a device-to-device copy on a side stream during matmuls on the compute stream: the share of the shorter one hidden (two GPUs only) | at least 50% |
| context parallel attention | causal attention split over 2 ranks by the runtime's context-parallel step (torch's ``context_parallel``: ring attention, head-tail load balanced; NCCL, two GPUs only), forward and backward, vs one device: largest error of out, dq, dk, dv over the largest value | within 2e-2 (bf16) |

``--dry-run`` runs the same code on the CPU with a tiny model (the test suite does, so the
script does not rot); rows needing CUDA allocator statistics or two GPUs are skipped there
(the context-parallel row runs on 2 gloo ranks, with gathered k and v: torch has no CPU ring
attention kernel).
Exit status 0 when every row that ran passed, 1 otherwise.

    python benchmarks/gpu_check.py                 # on a GPU machine, after `pip install -e .`
    python benchmarks/gpu_check.py --dry-run       # anywhere
    python benchmarks/gpu_check.py --json gpu_check.json --stages 4
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Row:
    """One line of the table: ``measured`` against ``reference`` as ``error`` vs ``target``."""

    check: str
    measured: str = ""
    reference: str = ""
    error: float | None = None
    """The compared figure (a relative error, a share difference or an overlap fraction)."""
    target: str = ""
    status: str = "skip"
    """``pass``, ``fail``, ``skip`` (cannot run here) or ``error`` (it raised)."""
    note: str = ""
    seconds: float = 0.0


@dataclass
class Setup:
    """What every check uses: the model, its inputs, the device and the profiles."""

    device: torch.device
    dtype: torch.dtype
    gpt: Any
    cfg: Any
    inputs: torch.Tensor
    stages: int
    dry_run: bool
    extra: dict[str, Any] = field(default_factory=dict)

    def model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        return self.gpt.build_model(**vars(self.cfg)).to(self.device, self.dtype)


def _gpt() -> Any:
    sys.path.insert(0, str(ROOT / "examples"))
    import gpt

    return gpt


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms"


def relative(measured: float, reference: float) -> float:
    return (measured - reference) / reference if reference else math.inf


def _judge(row: Row, limit: float, *, at_least: bool = False) -> Row:
    assert row.error is not None
    ok = row.error >= limit if at_least else abs(row.error) <= limit
    row.status = "pass" if ok else "fail"
    return row


@contextmanager
def cuda_peak(device: torch.device) -> Iterator[dict[str, int]]:
    """``{"peak": bytes}`` filled with ``max_memory_allocated`` over the block (CUDA only)."""
    out: dict[str, int] = {}
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    yield out
    torch.cuda.synchronize(device)
    out["peak"] = torch.cuda.max_memory_allocated(device)


# -- the checks ---------------------------------------------------------------------------


def measured_profile(s: Setup) -> Any:
    from autopipe.profiler.measure import profile
    from autopipe.profiler.options import MeasureOptions

    if "measured" not in s.extra:
        s.extra["measured"] = profile(s.model(), s.inputs, MeasureOptions(reference=True, warmup=2, repeat=5), loss_fn=s.gpt.loss_fn, progress=False)  # fmt: skip
    return s.extra["measured"]


def analytic_profile(s: Setup) -> Any:
    from autopipe.profiler.analytic import profile_analytic
    from autopipe.profiler.options import AnalyticOptions

    if "analytic" not in s.extra:
        spec, how = catalog_entry(s.device)
        s.extra["spec_note"] = how
        s.extra["analytic"] = profile_analytic(
            lambda: s.gpt.build_model(**vars(s.cfg)), s.inputs, spec,
            AnalyticOptions(dtype=str(s.dtype).removeprefix("torch.")), loss_fn=s.gpt.loss_fn,
        )  # fmt: skip
    return s.extra["analytic"]


def catalog_entry(device: torch.device) -> tuple[Any, str]:
    """The catalog spec for this device: by name (longest alias found in the CUDA device
    name), else the GPU entry nearest in memory; ``"cpu"`` on the CPU."""
    from autopipe.core.catalog import CATALOG, get_device

    if device.type != "cuda":
        return get_device("cpu"), "cpu (nominal)"
    name = torch.cuda.get_device_name(device).lower().replace(" ", "-")
    matches = [
        (len(alias), spec)
        for spec in CATALOG.values()
        for alias in (spec.name.lower(), *spec.aliases)
        if alias.replace("-", "") and alias.replace("-", "") in name.replace("-", "")
    ]
    if matches:
        spec = max(matches, key=lambda m: m[0])[1]
        return spec, f"{spec.name} (matched {torch.cuda.get_device_name(device)!r})"
    total = torch.cuda.get_device_properties(device).total_memory
    gpus = [spec for spec in CATALOG.values() if spec.name.lower() != "cpu"]
    spec = min(gpus, key=lambda g: abs(g.memory_bytes - total))
    return spec, f"{spec.name} (nearest in memory to {torch.cuda.get_device_name(device)!r})"


def check_profile_sum(s: Setup) -> Row:
    p = measured_profile(s)
    units = sum(u.forward_s + u.backward_s for u in p.units)
    whole = p.total_forward_s + p.total_backward_s
    row = Row(
        "profile sum vs whole",
        measured=f"units {_ms(units)}",
        reference=f"whole {_ms(whole)}",
        error=relative(units, whole),
        target="|err| <= 15%",
        note=f"clock {p.measurement.clock if p.measurement else '?'}, {len(p.units)} units, "
        f"{len(p.units) - sum(len(g) - 1 for g in p.shared_groups().values())} measured",
    )
    return _judge(row, 0.15)


def check_unit_peaks(s: Setup) -> Row:
    p, a = measured_profile(s), analytic_profile(s)
    errors = []
    for m, u in zip(p.units, a.units, strict=True):
        predicted = u.peak_bytes + m.gradient_bytes
        if m.peak_bytes > 0 and predicted > 0:
            errors.append((relative(predicted, m.peak_bytes), m.name))
    row = Row("unit peak memory", target="median |err| <= 25%")
    if s.device.type != "cuda":
        row.note = "skipped: no allocator statistics on CPU (the profile's peaks are estimates)"
        row.measured = f"{len(errors)} units compared (estimate vs estimate)"
        return row
    worst = max(errors, key=lambda e: abs(e[0]))
    row.error = statistics.median(abs(e) for e, _ in errors)
    row.measured = "max_memory_allocated per unit"
    row.reference = "saved + out + input grads + weight grads"
    row.note = f"worst {worst[1]} {worst[0]:+.0%}"
    return _judge(row, 0.25)


def check_whole_memory(s: Setup) -> Row:
    from autopipe.planner import plan

    from autopipe.core.request import PlanRequest

    p = measured_profile(s)
    one = plan(
        p, PlanRequest(gpus=1, microbatches=1, checkpoint="never", optimizer="sgd", baselines=False)
    )
    predicted = one.stages[0].memory_bytes
    row = Row("whole-model peak memory", target="|err| <= 25%", reference=_mib(predicted))
    if s.device.type != "cuda":
        row.note = "skipped: needs torch.cuda.max_memory_allocated"
        return row
    model = s.model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(2):  # the second step: gradients and kernels' workspaces exist
        optimizer.zero_grad(set_to_none=True)
        with cuda_peak(s.device) as peak:
            s.gpt.loss_fn(model(s.inputs), s.inputs).backward()
            optimizer.step()
    row.measured = _mib(peak["peak"])
    row.error = relative(predicted, peak["peak"])
    row.note = "SGD step, params + grads + saved activations predicted"
    return _judge(row, 0.25)


def check_analytic(s: Setup) -> Row:
    p, a = measured_profile(s), analytic_profile(s)

    def shares(prof: Any) -> list[float]:
        total = sum(u.forward_s + u.backward_s for u in prof.units)
        return [(u.forward_s + u.backward_s) / total for u in prof.units]

    diffs = [x - y for x, y in zip(shares(a), shares(p), strict=True)]
    worst = max(range(len(diffs)), key=lambda i: abs(diffs[i]))
    total_a = sum(u.forward_s + u.backward_s for u in a.units)
    total_m = sum(u.forward_s + u.backward_s for u in p.units)
    row = Row(
        "analytic vs measured",
        measured=f"{p.units[worst].name} share {shares(p)[worst]:.1%}",
        reference=f"analytic {shares(a)[worst]:.1%}",
        error=diffs[worst],
        target="|share diff| <= 10 pts",
        note=f"{s.extra['spec_note']}; step analytic/measured {total_a / total_m:.2f}x",
    )
    return _judge(row, 0.10)


def check_parallelize(s: Setup) -> tuple[Row, Row]:
    from autopipe.planner import plan

    from autopipe.bench_report import run_bench
    from autopipe.core.request import PlanRequest

    p = measured_profile(s)
    k = min(s.stages, len(p.units))
    k_plan = plan(
        p,
        PlanRequest(
            gpus=k, microbatches=2 * k, checkpoint="never", optimizer="sgd", baselines=False
        ),
    )
    devices = [str(s.device)] * k
    memory = Row("parallelize memory", target="|err| <= 30%")
    predicted_memory = sum(st.memory_bytes for st in k_plan.stages)
    memory.reference = _mib(predicted_memory)
    if s.device.type == "cuda":
        with cuda_peak(s.device) as peak:
            result = run_bench(s.model(), s.inputs, k_plan, devices=devices, steps=3,
                               loss_fn=s.gpt.loss_fn)  # fmt: skip
        memory.measured = _mib(peak["peak"])
        memory.error = relative(predicted_memory, peak["peak"])
        memory.note = f"{k} stages x M={k_plan.microbatches}, all on {s.device}"
        _judge(memory, 0.30)
    else:
        result = run_bench(s.model(), s.inputs, k_plan, devices=devices, steps=3,
                           loss_fn=s.gpt.loss_fn)  # fmt: skip
        memory.note = "skipped: needs torch.cuda.max_memory_allocated"
    iteration = Row(
        f"parallelize {k} stages",
        measured=_ms(result.iteration_measured_s),
        reference=f"predicted {_ms(result.iteration_predicted_s)}",
        error=relative(result.iteration_predicted_s, result.iteration_measured_s),
        target="|err| <= 20%",
        note=f"M={k_plan.microbatches}, clock {result.clock}, worst stage "
        f"{result.max_stage_error:+.0%}",
    )
    return _judge(iteration, 0.20), memory


def check_overlap(s: Setup) -> Row:
    row = Row("copy-stream overlap", target="hidden >= 50%")
    if s.device.type != "cuda" or torch.cuda.device_count() < 2:
        row.note = "skipped: needs two GPUs"
        return row
    d0, d1 = torch.device("cuda", 0), torch.device("cuda", 1)
    a = torch.randn(4096, 4096, device=d0, dtype=s.dtype)
    src = torch.empty(256 * 2**20, dtype=torch.uint8, device=d0)
    dst = torch.empty(256 * 2**20, dtype=torch.uint8, device=d1)
    copy_stream = torch.cuda.Stream(d0)

    def compute() -> None:
        for _ in range(20):
            a @ a

    def copy() -> None:
        with torch.cuda.stream(copy_stream):
            dst.copy_(src, non_blocking=True)

    def timed(*fns: Callable[[], None]) -> float:
        samples = []
        for _ in range(5):
            torch.cuda.synchronize(d0)
            torch.cuda.synchronize(d1)
            t0 = time.perf_counter()
            for fn in fns:
                fn()
            torch.cuda.synchronize(d0)
            torch.cuda.synchronize(d1)
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples[1:])

    t_compute, t_copy, t_both = timed(compute), timed(copy), timed(copy, compute)
    row.error = (t_compute + t_copy - t_both) / min(t_compute, t_copy)
    row.measured = f"both {_ms(t_both)}"
    row.reference = f"compute {_ms(t_compute)} + copy {_ms(t_copy)}"
    row.note = "the single-process executor does not use copy streams yet"
    return _judge(row, 0.5, at_least=True)


CP_TOLERANCE = {"cuda": 2e-2, "cpu": 1e-5}
"""Largest error of context-parallel attention against one device, relative to the largest
value: bf16 ring attention on CUDA (its partial results merged in float32), float64 on the
CPU dry run."""


def cp_worker() -> None:
    """One rank of :func:`check_context_parallel` (under torchrun, 2 processes): causal
    attention of a ``[2, 4, 1024, 64]`` q, k, v (64 on the CPU) split over the 2 ranks by
    autopipe's context-parallel step (``sharded_step``: torch's ``context_parallel``, ring
    attention with the head-tail load balancer on CUDA), forward and backward, gathered back
    (``context_parallel_unshard``) and compared on rank 0 with one device's; prints one
    JSON line."""
    import torch.distributed as dist
    from autopipe.runtime.distributed.context_parallel import causal_attention, sharded_step
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    cuda = torch.cuda.is_available()
    kind = "cuda" if cuda else "cpu"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float64
    seq = 1024 if cuda else 64
    mesh = init_device_mesh(kind, (2,), mesh_dim_names=("cp",))
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, dout = (torch.randn(2, 4, seq, 64, generator=g).to(device, dtype) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = causal_attention(*leaves)
    (want * dout).sum().backward()
    wanted = [want.detach(), *(t.grad for t in leaves)]
    shards = [t.clone() for t in (q, k, v, dout)]
    t0 = time.perf_counter()
    with sharded_step(mesh["cp"], shards, kind, seq_dims=[2] * 4):  # [b, heads, s, d]
        local = [t.detach().requires_grad_() for t in shards[:3]]
        out = causal_attention(*local)
        (out * shards[3]).sum().backward()  # d(out . dout): dout is out's gradient
        # Inside the block: the load balancer that shards is the one that unshards.
        got = [out.detach(), *(t.grad for t in local)]
        got = context_parallel_unshard(mesh, [t.contiguous() for t in got], [2] * 4)
    seconds = time.perf_counter() - t0
    errors = [
        float((a.double() - b.double()).abs().max() / b.double().abs().max())
        for a, b in zip(got, wanted, strict=True)
    ]
    if rank == 0:
        print(json.dumps({"errors": errors, "seconds": seconds, "kind": kind, "seq": seq}))
    dist.destroy_process_group()


def check_context_parallel(s: Setup) -> Row:
    import subprocess

    row = Row("context parallel attention", target="")
    kind = "cpu" if s.dry_run else "cuda"
    row.target = f"max error <= {CP_TOLERANCE[kind]:g}"
    if not s.dry_run and torch.cuda.device_count() < 2:
        row.note = "skipped: needs two GPUs"
        return row
    import socket

    with socket.socket() as sock:  # a free port for the 2 ranks' rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(port), str(Path(__file__).resolve()), "--cp-worker",
    ]  # fmt: skip
    env = None if not s.dry_run else {**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the 2-rank context-parallel run failed: {tail}")
    found = json.loads(lines[-1])
    worst = max(found["errors"])
    row.error = worst
    row.measured = "out/dq/dk/dv " + " ".join(f"{e:.1e}" for e in found["errors"])
    row.reference = "one device"
    how = "ring attention, load-balanced" if kind == "cuda" else "gathered k/v (no CPU ring kernel)"
    row.note = f"2 ranks, s={found['seq']}, {how}, {_ms(found['seconds'])}"
    row.status = "pass" if worst <= CP_TOLERANCE[kind] else "fail"
    return row


# -- running ------------------------------------------------------------------------------


def setup(dry_run: bool, device: str | None, stages: int) -> Setup:
    gpt = _gpt()
    if dry_run:
        # one thread, as the profiler measures on CPU: the bench then reads thread CPU time
        torch.set_num_threads(1)
        dev = torch.device("cpu")
        cfg = gpt.GPTConfig(vocab_size=512, seq_len=32, d_model=64, n_layer=4, n_head=4)
        return Setup(dev, torch.float32, gpt, cfg, gpt.example_inputs(8, cfg), min(stages, 2), True)
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run to exercise the script on the CPU")
    dev = torch.device(device or "cuda:0")
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    cfg = gpt.GPTConfig(vocab_size=32000, seq_len=1024, d_model=1024, n_layer=12, n_head=16)
    inputs = gpt.example_inputs(8, cfg).to(dev)
    return Setup(dev, dtype, gpt, cfg, inputs, stages, False)


def run_checks(s: Setup) -> list[Row]:
    rows: list[Row] = []
    checks: list[tuple[str, Callable[[Setup], Any]]] = [
        ("profile sum vs whole", check_profile_sum),
        ("unit peak memory", check_unit_peaks),
        ("whole-model peak memory", check_whole_memory),
        ("analytic vs measured", check_analytic),
        ("parallelize", check_parallelize),
        ("copy-stream overlap", check_overlap),
        ("context parallel attention", check_context_parallel),
    ]
    for name, check in checks:
        started = time.perf_counter()
        try:
            out = check(s)
            produced = list(out) if isinstance(out, tuple) else [out]
        except Exception as exc:  # one broken path must not hide the others
            text = str(exc).strip().splitlines()
            produced = [
                Row(name, status="error", note=f"{type(exc).__name__}: {text[0] if text else ''}")
            ]
            traceback.print_exc(file=sys.stderr)
        elapsed = time.perf_counter() - started
        for row in produced:
            row.seconds = elapsed / len(produced)
        rows.extend(produced)
    return rows


def format_rows(rows: list[Row], header: str) -> str:
    cells = [["check", "measured", "reference", "error", "target", "status", "s", "note"]]
    for r in rows:
        err = "" if r.error is None else f"{r.error:+.1%}"
        cells.append(
            [
                r.check,
                r.measured,
                r.reference,
                err,
                r.target,
                r.status.upper(),
                f"{r.seconds:.1f}",
                r.note,
            ]
        )
    widths = [max(len(c[i]) for c in cells) for i in range(len(cells[0]))]
    lines = [header, ""]
    for i, c in enumerate(cells):
        lines.append("  ".join(x.ljust(w) for x, w in zip(c, widths, strict=True)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="run on the CPU with a tiny model")
    parser.add_argument("--device", help="the CUDA device to check (default cuda:0)")
    parser.add_argument("--stages", type=int, default=4, help="K for the parallelize check")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--cp-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cp_worker:  # one rank of the context-parallel check
        cp_worker()
        return 0
    started = time.perf_counter()
    s = setup(args.dry_run, args.device, args.stages)
    where = "CPU dry run" if s.dry_run else torch.cuda.get_device_name(s.device)
    rows = run_checks(s)
    header = (
        f"autopipe GPU check on {where} ({s.device}, {str(s.dtype).removeprefix('torch.')}, "
        f"torch {torch.__version__}, {torch.cuda.device_count()} CUDA devices): "
        f"{time.perf_counter() - started:.0f} s"
    )
    print(format_rows(rows, header))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"header": header, "rows": [asdict(r) for r in rows]}, indent=2)
        )
    return 0 if all(r.status in ("pass", "skip") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

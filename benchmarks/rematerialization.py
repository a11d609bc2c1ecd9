"""Re-materialization per stage against per unit, on the one-process executor (CPU).

    .venv/bin/python benchmarks/rematerialization.py [--iters 7] [--threads 1]

examples/gpt.py (d_model 128, 8 blocks, seq 128, vocab 256, dropout 0.1: a small vocabulary, so the
logits and the loss outside the stage do not dominate the peak), batch 16 in M = 4
micro-batches, the whole model on one stage (K = 1), so every micro-batch's forward runs
before any backward (GPipe) and the kept inputs add up. For each of: activations kept (no
re-materialization), re-materialized per stage, and per unit, in one run, interleaved:

- peak bytes: the most bytes of tensor storage allocated during one training step and alive
  at once (:class:`PeakBytes`, a dispatch mode; parameters and their gradients excluded),
  beside what the cost model predicts (``planner/costs.py``: kept ``A x M``, per stage
  ``A + C_0 x M``, per unit ``max A_u + sum C_u x M``), and the ratio of the two;
- the median step time (forward + backward) over ``--iters`` steps, and its ratio to keeping
  the activations (re-materializing costs one more forward either way; per unit also runs
  its units' graphs through ``torch.fx.Interpreter``).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import gpt  # noqa: E402

CFG = dict(vocab_size=256, seq_len=128, d_model=128, n_layer=8, n_head=4, dropout=0.1)
BATCH, M = 16, 4


class PeakBytes(TorchDispatchMode):
    """The most bytes of tensor storage allocated inside the block and alive at once.

    Every operator's outputs are seen here (the autograd engine's too); a storage counts
    from the first output that holds it until it is freed (a weak reference's callback).
    Storages of ``existing`` (parameters, their gradients) are not counted."""

    def __init__(self, existing: list[torch.Tensor]) -> None:
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in existing}
        self.live = 0
        self.peak = 0
        self._refs: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                storage = t.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
                if key in self.known or size == 0:
                    continue
                self.known.add(key)
                self.live += size
                self.peak = max(self.peak, self.live)
                self._refs.append(weakref.ref(storage, self._freed(key, size)))
        return out

    def _freed(self, key: int, size: int) -> Any:
        def done(_: Any) -> None:
            self.live -= size
            self.known.discard(key)

        return done


def pipeline(model: torch.nn.Module, idx: torch.Tensor, how: str) -> Any:
    """The model on one stage: activations kept (``none``) or checkpointed ``stage`` / ``unit``."""
    from autopipe.profiler.units import trace_units

    from autopipe.core.plan import Plan, StagePlan
    from autopipe.parallelizing import parallelize

    names = trace_units(model, idx).unit_names
    stage = StagePlan(index=0, device="cpu", units=names, checkpoint=how != "none",
                      checkpoint_granularity="unit" if how == "unit" else "stage")  # fmt: skip
    return parallelize(model, idx, ["cpu"], plan=Plan(1, M, 0, 0, [stage]))


def step(pipe: Any, idx: torch.Tensor) -> None:
    gpt.loss_fn(pipe(idx), idx).backward()


def predicted_bytes(model: torch.nn.Module, idx: torch.Tensor) -> dict[str, float]:
    """The cost model's activation bytes of the one stage, per option."""
    from autopipe.planner import Cluster
    from autopipe.planner.costs import CostModel
    from autopipe.profiler.measure import profile
    from autopipe.profiler.options import MeasureOptions

    prof = profile(copy.deepcopy(model), idx, MeasureOptions(repeat=1, warmup=0), loss_fn=gpt.loss_fn, progress=False)  # fmt: skip
    out = {}
    for how, mode in (("none", "never"), ("stage", "always"), ("unit", "always")):
        cm = CostModel(prof, Cluster.homogeneous(1), batch_size=BATCH, microbatches=M,
                       schedule="gpipe", checkpoint=mode, state_bytes_per_parameter=16,
                       headroom=0.0)  # fmt: skip
        n, r = cm.n_units, cm.ratio
        if how == "stage":
            out[how] = float(cm.act_prefix[n] * r + cm.cut_bytes_at[0] * r * M)
        elif how == "unit":
            out[how] = float(cm.unit_activation_max(0, n) * r + cm.unit_input_prefix[n] * r * M)
        else:
            out[how] = float(cm.segment(0, 0, n).activation_bytes)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = gpt.build_model(**CFG)
    idx = gpt.example_inputs(BATCH, gpt.GPTConfig(**CFG))
    options = ("none", "stage", "unit")
    copies = {how: copy.deepcopy(model) for how in options}
    pipes = {how: pipeline(copies[how], idx, how) for how in options}
    peaks = {}
    for how in options:
        step(pipes[how], idx)  # gradients exist: the measured step adds into them
        params = list(copies[how].parameters())
        with PeakBytes(params + [p.grad for p in params if p.grad is not None]) as mode:
            step(pipes[how], idx)
        peaks[how] = mode.peak
    times: dict[str, list[float]] = {how: [] for how in options}
    for _ in range(args.iters):  # interleaved: drift on a shared machine hits all alike
        for how in options:
            started = time.perf_counter()
            step(pipes[how], idx)
            times[how].append(time.perf_counter() - started)
    predicted = predicted_bytes(model, idx)
    print(f"GPT d_model {CFG['d_model']} x {CFG['n_layer']} blocks, seq {CFG['seq_len']}, "
          f"batch {BATCH}, M={M}, one stage, {args.threads} thread(s), {args.iters} steps")  # fmt: skip
    print(f"{'re-materialized':<16}{'peak MiB':>10}{'predicted MiB':>15}{'ratio':>7}"
          f"{'vs kept':>9}{'step ms':>9}{'vs kept':>9}")  # fmt: skip
    base_t = statistics.median(times["none"])
    for how in options:
        med = statistics.median(times[how])
        print(f"{how if how != 'none' else 'no (kept)':<16}{peaks[how] / 2**20:>10.2f}"
              f"{predicted[how] / 2**20:>15.2f}{peaks[how] / predicted[how]:>7.3f}"
              f"{peaks[how] / peaks['none']:>9.3f}{med * 1e3:>9.1f}{med / base_t:>9.3f}")  # fmt: skip


if __name__ == "__main__":
    main()

"""torchrun entry point of the mesh zoo (tests/test_mesh_zoo.py): many (family, mesh) cases in
one launch of 4 gloo processes, one JSON result per case.

    torchrun --nproc-per-node 4 tests/mesh_zoo_run.py OUT_DIR FAMILY:MESH [...]

For each case, in order:

1. rank 0 profiles the family (``tests/mesh_zoo_models.py``; measured, once per family) and
   plans it for the mesh with autopipe's own API (``autopipe.plan`` with the mesh's
   :data:`MESHES` request); a ``PlanningError`` is the case's result (``refused-plan``);
2. every rank builds the model and its part of the plan with autopipe's distributed runtime
   (``DistributedPipeline``), and trains 3 steps with SGD, then, from the same initial
   weights, 3 steps with AdamW (``autopipe.training.make_optimizer``: ZeRO-1 under
   ``shard optimizer``);
3. every parameter (TP pieces and FSDP shards gathered with ``full_tensor()``) is compared
   with one process training the plain model on the same global batch with the same
   optimizer: the update over lr, rtol 1e-4 / atol 1e-5.

``FAMILY:MESH:bfloat16`` trains the same in bfloat16, SGD only, with labels, within
:data:`BF16_GRADIENT_RTOL`'s bound.

``OUT_DIR/FAMILY:MESH.json`` (``:`` written ``-``) says ``outcome``: ``equal``, ``differs``
(the largest error and the parameter), ``refused-plan`` (the planner's reason),
``refused-start`` (the runtime's one-line refusal before training), ``fails-start`` /
``fails-step`` (the first line of the root cause, building / training).

A failing case must not take the next ones with it: every group of the run gets a bounded
timeout (:data:`CASE_TIMEOUT_S`, torch's default for groups made without one, DeviceMesh's,
is patched too), the ranks meet after each case on a group of their own, and a case that
did not fail alike on every rank (one rank raised while its peers waited for it) is
followed by a fresh process group for the rest. Not a test module (no ``test_`` prefix).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

STEPS = 3
BATCH = 8
"""The global batch (all meshes): 2 micro-batches per replica."""
MICROBATCHES = 2
LR = {"sgd": 0.1, "adamw": 1e-2}
OPTIMIZERS = ("sgd", "adamw")
RTOL, ATOL = 1e-4, 1e-5
DTYPE = "float64"
"""The parameters' dtype in training and in the reference. AdamW divides each gradient by its
own running magnitude, so in float32 the order of a sum alone moves its update over lr by
up to 9e-4 (one process, the whole batch against 2 micro-batches of it, Llama), far above
atol 1e-5; in float64 that noise is ~1e-12 and a wrong gradient still shows at full size.
(The planner plans from the float32 profile: the dtype changes no shape the plan checks.)"""
CASE_TIMEOUT_S = 30.0
"""Timeout of every group a case uses: a rank that failed leaves its peers waiting this long."""
CONTROL_TIMEOUT_S = 600.0
"""Timeout of the group the ranks meet on between cases (rank 0 plans meanwhile)."""

MESHES: dict[str, dict[str, Any]] = {
    "pp2tp2": {"tensor_parallel": 2, "data_parallel": 1, "schedule": "1f1b"},
    "tp2fsdp2": {
        "tensor_parallel": 2,
        "data_parallel": 2,
        "shard": "parameters",
        "schedule": "1f1b",
    },
    "pp2d2zero1": {
        "tensor_parallel": 1,
        "data_parallel": 2,
        "shard": "optimizer",
        "schedule": "1f1b",
    },
    "pp2v2tp2": {
        "tensor_parallel": 2,
        "data_parallel": 1,
        "schedule": "interleaved-1f1b",
        "virtual_stages": 2,
    },
}
"""Mesh name -> the PlanRequest fields that ask the planner for it (4 devices)."""
EXPERT_MESHES: dict[str, dict[str, Any]] = {
    "pp2ep2": {
        "tensor_parallel": 1,
        "data_parallel": 2,
        "expert_parallel": 2,
        "schedule": "1f1b",
    },
    "pp2ep2fsdp": {
        "tensor_parallel": 1,
        "data_parallel": 2,
        "expert_parallel": 2,
        "shard": "parameters",
        "schedule": "1f1b",
    },
    "pp2ep2remat": {
        "tensor_parallel": 1,
        "data_parallel": 2,
        "expert_parallel": 2,
        "checkpoint": "always",
        "schedule": "1f1b",
    },
    "d4ep2": {
        "tensor_parallel": 1,
        "data_parallel": 4,
        "expert_parallel": 2,
        "schedule": "1f1b",
    },
    "pp2ep2zero1": {
        "tensor_parallel": 1,
        "data_parallel": 2,
        "expert_parallel": 2,
        "shard": "optimizer",
        "schedule": "1f1b",
    },
    "d4ep2zero1": {
        "tensor_parallel": 1,
        "data_parallel": 4,
        "expert_parallel": 2,
        "shard": "optimizer",
        "schedule": "1f1b",
    },
    "d2ep2tp2": {
        "tensor_parallel": 2,
        "data_parallel": 2,
        "expert_parallel": 2,
        "schedule": "1f1b",
    },
    "d2ep2tp2zero1": {
        "tensor_parallel": 2,
        "data_parallel": 2,
        "expert_parallel": 2,
        "shard": "optimizer",
        "schedule": "1f1b",
    },
    "d2ep2tp2fsdp": {
        "tensor_parallel": 2,
        "data_parallel": 2,
        "expert_parallel": 2,
        "shard": "parameters",
        "schedule": "1f1b",
    },
}
"""Expert-parallel meshes (tests/test_expert_parallel.py; mixture-of-experts families only):
PP 2 x D 2 with each MoE layer's experts spread over the 2 replicas of a stage (E = D), the
same with FSDP2 on the other parameters, the same with every stage re-materialized (the
all-to-alls run again in the backward), D 4 with E 2 (two EP groups whose expert
gradients are summed), each of PP 2 x D 2 = E and D 4 x E 2 again with ZeRO-1 (the dense
state sharded over the replicas, the experts' over the ranks holding the same experts:
none besides itself at E = D, the other EP group at D 4), and EP 2 x TP 2 (each rank half
the experts, each of them half its FFN), with and without FSDP2 on the other parameters."""
WORLD = 4
MIXTURES_OF_EXPERTS = ("mixtral", "qwen3_moe", "deepseek_v3")
"""Families whose TP cases also check autopipe's checkpoint of their split experts."""


BF16 = "bfloat16"
BF16_LR = {"sgd": LR["sgd"]}
"""bfloat16 cases (``FAMILY:MESH:bfloat16``) train SGD only (see :data:`BF16_GRADIENT_RTOL`)."""
BF16_GRADIENT_RTOL = 2.0**-5
"""The bound of a bfloat16 case: parameters (and so gradients and every reduction) in
bfloat16 in the mesh and in the one process alike; SGD, so the update over lr is the sum of
the 3 steps' gradients; the objective is the model's own next-token loss (labels given):
with the zoo's default objective (no labels) the gradients are ~1e-4 (Cohere's ~1e-5, its
logits scaled by 1/16), below the parameters' resolution at any usable lr, and no update
would show. Per element the error of the update over lr is allowed

    STEPS * ulp(|p|) / lr  +  BF16_GRADIENT_RTOL * max |update over lr| of the parameter

The first term is the parameter's own rounding: each step rounds ``p - lr * g`` to
bfloat16 (8 significant bits), and where the two runs' gradients differ by a hair the two
values may round to neighbouring numbers, one ulp of ``p`` apart (:func:`bf16_ulp` of the
largest magnitude the element takes). Measured (llama, qwen3, cohere_qk_norm, every mesh):
the largest error is exactly 1 to 2 such ulps (2.4e-3 or 4.9e-3 at lr 0.1, |p| in [0.03,
0.06)), 32-50 % of the largest update of some parameter: q/k projections, MLPs and the norm
weights (|p| = 1, ulp 2^-7) move by less than an ulp a step at lr 0.1, so bfloat16 resolves
their update only to that term (it holds there, and says little: a wrong gradient of a norm
weight, as a missing TP sum of Qwen3's q/k norms, does not show in bfloat16; the float64
cases catch it); the embedding, v/o projections and head move by tens of ulps, where the
second term decides. That second term is the gradient's own error: the mesh sums in another
order, and in bfloat16, what one process sums at once (micro-batch gradients accumulated in
the parameter's dtype, data-parallel and FSDP reductions, TP's partial sums in the forward,
the division by the item count), each a rounding of 2^-8 of the values summed, a handful in
all: 2^-5 (3.1 %) of the largest update. Measured, the error beyond the first term: at most
0.56 % of the largest update (qwen3; llama 0.40 %, cohere_qk_norm 0.15 %), 5.6 x inside;
tests/test_mesh_zoo.py's table prints it per case. A gradient off by tens of percent on a
parameter that moves is far outside.
AdamW is not compared in bfloat16: its first update is ``g / |g|``, so an element whose
gradient is within rounding of zero flips sign between the two runs (its update over lr off
by 2 per step; measured at lr 1e-2 without labels: up to 4.1, 64-138 % of the largest,
llama and qwen3); the float64 cases check AdamW."""


def bf16_ulp(x: Any) -> Any:
    """The spacing of bfloat16 values (8 significant bits) at magnitude ``x`` (a tensor):
    ``2 ** (e - 8)`` for ``x`` in ``[2 ** (e - 1), 2 ** e)``."""
    import torch

    _, exponent = torch.frexp(x.clamp_min(2.0**-126))
    return torch.ldexp(torch.ones_like(x), exponent - 8)


def case_inputs(family: str, dtype: str) -> Any:
    """The family's global batch (``BATCH`` rows); a bfloat16 case's with the token ids as
    ``labels`` too, so that the objective is the model's own next-token loss (see
    :data:`BF16_GRADIENT_RTOL`)."""
    import mesh_zoo_models

    inputs = mesh_zoo_models.example_inputs(family, BATCH)
    if dtype == BF16 and "labels" not in inputs:
        inputs = {**inputs, "labels": inputs["input_ids"].clone()}
    return inputs


def optimizers_of(dtype: str) -> tuple[str, ...]:
    return ("sgd",) if dtype == BF16 else OPTIMIZERS


def lr_of(optimizer: str, dtype: str) -> float:
    return BF16_LR[optimizer] if dtype == BF16 else LR[optimizer]


def case_parts(case: str) -> tuple[str, str, str]:
    """(family, mesh, dtype) of ``FAMILY:MESH`` (dtype :data:`DTYPE`) or
    ``FAMILY:MESH:DTYPE``."""
    family, mesh, *rest = case.split(":")
    return family, mesh, rest[0] if rest else DTYPE


def result_path(out: Path, case: str) -> Path:
    return out / f"{case.replace(':', '-')}.json"


WRAPPERS = ("failed to run forward", "Failed to run stage backward")
"""Messages of torch.distributed.pipelining's wrappers around a stage's own error."""


def root_cause(exc: BaseException) -> str:
    """``Type: first line`` of the innermost exception of ``exc``'s cause chain that is not a
    pipelining wrapper (which say only "[Stage 0] failed to run forward:")."""
    chain = [exc]
    while True:
        nxt = chain[-1].__cause__ or chain[-1].__context__
        if nxt is None or any(nxt is e for e in chain):
            break
        chain.append(nxt)
    own = [e for e in chain if not any(w in str(e) for w in WRAPPERS)] or chain
    cause = own[-1]
    text = str(cause).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(cause).__name__}: {first}"[:300] if first else type(cause).__name__


class Runner:
    """One rank's state across the cases of a launch."""

    def __init__(self, out: Path) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        torch.set_num_threads(1)
        # Groups made without a timeout (DeviceMesh's) would wait torch's 30 minutes.
        distributed_c10d.default_pg_timeout = timedelta(seconds=CASE_TIMEOUT_S)
        self.out = out
        self.rank = int(os.environ["RANK"])
        self.generation = 0
        self.store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            WORLD,
            is_master=False,
            timeout=timedelta(seconds=CONTROL_TIMEOUT_S),
        )
        self._join()
        self.profiles: dict[str, Any] = {}
        self.references: dict[tuple[str, str], tuple[dict[str, Any], dict[str, Any]]] = {}

    def _join(self) -> None:
        """A fresh process group (generation ``self.generation``), and the control group."""
        import torch.distributed as dist
        from autopipe.runtime.distributed import process

        store = dist.PrefixStore(f"mesh_zoo/{self.generation}/", self.store)
        timeout = timedelta(seconds=CASE_TIMEOUT_S)
        dist.init_process_group(
            "gloo", store=store, rank=self.rank, world_size=WORLD, timeout=timeout
        )
        process._world_timeout = timeout  # the groups autopipe makes itself take it
        self.control = dist.new_group(backend="gloo", timeout=timedelta(seconds=CONTROL_TIMEOUT_S))

    @staticmethod
    def forget_meshes() -> None:
        """Drop DTensor's caches of sharding decisions: they hold the DeviceMesh of the case
        that filled them (an equal mesh hits them), whose groups a fresh process group
        destroyed ("Could not resolve the process group registered under the name 48")."""
        import torch
        from torch.distributed.tensor import DTensor, _redistribute, _sharding_prop

        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
        native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
        if native is not None:  # the C++ dispatch fast path's cache of the same decisions
            native()
        _sharding_prop.ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
        _redistribute.clear_redistribute_planner_cache()
        transforms = getattr(_redistribute, "_gen_transform_infos", None)
        if transforms is not None and hasattr(transforms, "cache_clear"):
            transforms.cache_clear()

    def _rejoin(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()
        self.generation += 1
        self._join()

    # -- planning (rank 0) -------------------------------------------------------------------

    def _plan(self, family: str, mesh: str, dtype: str) -> tuple[dict[str, Any] | None, str | None]:
        """(the plan as JSON, None) or (None, the planner's refusal)."""
        import mesh_zoo_models
        from autopipe.planner import PlanningError
        from autopipe.profiler.options import MeasureOptions

        import autopipe
        from autopipe.core.request import PlanRequest
        from autopipe.profiling import profile

        key = f"{family} labels" if dtype == BF16 else family  # what it is traced with
        if key not in self.profiles:
            model = mesh_zoo_models.build(family)
            self.profiles[key] = profile(
                model, case_inputs(family, dtype), MeasureOptions(warmup=0, repeat=1),
                progress=False,
            )  # fmt: skip
        request = PlanRequest(
            gpus=WORLD,
            microbatches=MICROBATCHES,
            optimizer="sgd",
            baselines=False,
            **{**MESHES, **EXPERT_MESHES}[mesh],
        )
        try:
            plan = autopipe.plan(self.profiles[key], request)
        except PlanningError as exc:
            return None, " ".join(str(exc).split())
        return plan.to_dict(), None

    # -- the one-process reference -----------------------------------------------------------

    def _reference(
        self, family: str, optimizer: str, dtype: str
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """(initial, trained) parameters of the plain model (in ``dtype``) trained on the
        global batch."""
        key = (family, optimizer, dtype)
        if key not in self.references:
            import mesh_zoo_models
            import torch
            from autopipe.profiler.inputs import call_model
            from autopipe.profiler.objective import default_loss

            model = mesh_zoo_models.build(family, dtype)
            inputs = case_inputs(family, dtype)
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            opt = make_plain_optimizer(optimizer, model.parameters(), lr_of(optimizer, dtype))
            for _ in range(STEPS):
                opt.zero_grad()
                default_loss(call_model(model, inputs), inputs).backward()
                opt.step()
            after = {n: p.detach().clone() for n, p in model.named_parameters()}
            self.references[key] = (before, after)
            del torch
        return self.references[key]

    # -- one case ----------------------------------------------------------------------------

    def run_case(self, case: str) -> bool:
        """Run ``case`` on every rank and write its result (rank 0). Returns whether the
        process group can be kept for the next case."""
        import torch.distributed as dist

        family, mesh, dtype = case_parts(case)
        t0 = time.monotonic()
        self.forget_meshes()
        message: list[Any] = [None, None]
        if self.rank == 0:
            try:
                message = list(self._plan(family, mesh, dtype))
            except Exception as exc:  # profiling or planning broke: not a refusal
                message = [None, f"planning raised {root_cause(exc)}"]
        dist.broadcast_object_list(message, src=0, group=self.control)
        plan_dict, refusal = message
        result: dict[str, Any] = {"case": case, "family": family, "mesh": mesh, "dtype": dtype}
        if plan_dict is None:
            outcome = (
                "refused-plan" if not str(refusal).startswith("planning raised") else "fails-plan"
            )
            result.update(outcome=outcome, reason=refusal)
            keep = True
        else:
            local = self._train_and_compare(family, plan_dict, dtype)
            gathered: list[Any] = [None] * WORLD
            dist.all_gather_object(gathered, local, group=self.control)
            result.update(_combine(gathered))
            # Experts modules each rank spread over its EP group (expert-parallel plans).
            result["expert_parallel_modules"] = [g.get("expert_parallel_modules") for g in gathered]
            # Each rank's expert parameters split by TP or EP: name -> the local shape.
            result["expert_shapes"] = [g.get("expert_shapes") for g in gathered]
            # TP cases: each rank's expert parameters in autopipe's checkpoint, and those
            # that differ from the trained ones (names, layout or values).
            result["checkpoint_experts"] = [g.get("checkpoint_experts") for g in gathered]
            result["checkpoint_wrong"] = [g.get("checkpoint_wrong") for g in gathered]
            result["plan"] = _plan_summary(plan_dict)
            keep = (
                all(g["symmetric"] for g in gathered)
                and len({g.get("error") for g in gathered}) == 1
            )
        result["wall_s"] = round(time.monotonic() - t0, 2)
        if self.rank == 0:
            result_path(self.out, case).write_text(json.dumps(result, indent=1))
        return keep

    def _train_and_compare(
        self, family: str, plan_dict: dict[str, Any], dtype: str
    ) -> dict[str, Any]:
        """This rank's part of a case: its errors per parameter, or how it failed."""
        import mesh_zoo_models
        import torch
        from autopipe.runtime.distributed.failures import is_comm_failure
        from autopipe.runtime.distributed.pipeline import DistributedPipeline

        from autopipe.core.errors import UsageError
        from autopipe.core.plan import Plan

        plan = Plan.from_dict(plan_dict)
        phase = "start"
        try:
            model = mesh_zoo_models.build(family, dtype)
            inputs = case_inputs(family, dtype)
            pipe = DistributedPipeline(model, plan, inputs)
            del model
            phase = "step"
            named = _parameter_names(pipe)
            initial = {name: p.detach().clone() for name, p in named.items()}
            errors: dict[str, Any] = {}
            for optimizer in optimizers_of(dtype):
                with torch.no_grad():
                    for name, p in named.items():
                        p.copy_(initial[name])
                lr = lr_of(optimizer, dtype)
                losses, kind = _train(pipe, plan, optimizer, inputs, lr)
                errors[optimizer] = self._compare(family, optimizer, pipe, losses, dtype)
                errors[optimizer]["optimizer_class"] = kind
            saved: dict[str, Any] = {}
            if plan.tensor_parallel > 1 and family in MIXTURES_OF_EXPERTS:
                saved = self._checkpoint_experts(pipe)
            spread = sum(type(m).__name__ == "ExpertParallel" for m in pipe.module.modules())
            split = {
                f"{path}.{name}": list(p.to_local().shape)
                for path, m in pipe.module.named_modules()
                if type(m).__name__ in ("TensorParallelExperts", "ExpertParallel")
                for name, p in m.named_parameters()
            }
            return {
                "errors": errors,
                "symmetric": True,
                "expert_parallel_modules": spread,
                "expert_shapes": split,
                **saved,
            }
        except Exception as exc:
            comm = is_comm_failure(exc)
            outcome = (
                "refused-start"
                if isinstance(exc, UsageError) and phase == "start"
                else (f"fails-{phase}")
            )
            return {
                "outcome": outcome,
                "error": root_cause(exc),
                "comm": comm,
                "rank": self.rank,
                # A refusal every rank makes alike leaves the groups in step; anything else
                # (a peer timed out waiting) gets a fresh process group.
                "symmetric": not comm,
                "trace": traceback.format_exc()[-3000:],
            }

    def _checkpoint_experts(self, pipe: Any) -> dict[str, Any]:
        """A TP case of a mixture of experts: autopipe's checkpoint of the trained pipeline (``save_checkpoint``,
        torch.distributed.checkpoint), read back whole, against this rank's expert
        parameters gathered with ``full_tensor()``: the names and layout must be the
        model's (a fused ``[gate; up]`` split by TP is written as it is whole)."""
        import torch
        import torch.distributed as dist
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        from torch.distributed.tensor import DTensor

        from autopipe.saving import save_checkpoint

        held = {
            name: value.full_tensor() if isinstance(value, DTensor) else value
            for name, value in pipe.state_dict().items()
            if ".experts." in name
        }
        folder = self.out / "checkpoint"  # one case at a time; deleted after
        save_checkpoint(pipe, str(folder))
        whole = folder.with_suffix(".pt")
        if self.rank == 0:
            dcp_to_torch_save(folder, whole)
        dist.barrier(group=self.control)
        saved = torch.load(whole)
        wrong = sorted(
            name
            for name, value in held.items()
            if name not in saved or not torch.equal(saved[name], value)
        )
        dist.barrier(group=self.control)
        if self.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
            whole.unlink()
        return {"checkpoint_experts": len(held), "checkpoint_wrong": wrong}

    def _compare(
        self, family: str, optimizer: str, pipe: Any, losses: list[float], dtype: str
    ) -> dict[str, Any]:
        """Per parameter this rank's stage holds: the largest error of its update over lr
        against the reference, and whether it is within rtol / atol (``dtype`` float64) or
        the bfloat16 bound (:data:`BF16_BOUND`)."""
        import torch
        from torch.distributed.tensor import DTensor

        before, after = self._reference(family, optimizer, dtype)
        lr = lr_of(optimizer, dtype)
        out: dict[str, Any] = {"losses": losses, "parameters": {}, "expected": sorted(after)}
        for name, value in pipe.state_dict().items():
            if name not in after:
                continue  # a buffer
            full = value.full_tensor() if isinstance(value, DTensor) else value
            got = (full.detach().double() - before[name].double()) / lr
            want = (after[name].double() - before[name].double()) / lr
            diff = (got - want).abs()
            relative = float(diff.max() / want.abs().max().clamp_min(ATOL))
            entry = {"max_error": float(diff.max()), "max_relative": relative}
            if dtype == BF16:
                # BF16_GRADIENT_RTOL's bound: the parameter's own roundings, then the rest
                held = torch.stack([before[name], after[name], full.detach()]).double()
                rounding = STEPS * bf16_ulp(held.abs().amax(0)) / lr
                rest = (diff - rounding) / want.abs().max().clamp_min(ATOL)
                entry["gradient_relative"] = float(rest.max())
                entry["excess"] = float(rest.max()) - BF16_GRADIENT_RTOL
            else:
                entry["excess"] = float((diff - (ATOL + RTOL * want.abs())).max())
            out["parameters"][name] = entry
        del torch
        return out


def make_plain_optimizer(name: str, parameters: Any, lr: float) -> Any:
    import torch

    if name == "sgd":
        return torch.optim.SGD(parameters, lr=lr)
    return torch.optim.AdamW(parameters, lr=lr)


def _parameter_names(pipe: Any) -> dict[str, Any]:
    """This rank's parameters by a name of its own (each once)."""
    return {name: p for name, p in pipe.module.named_parameters()}


def _train(pipe: Any, plan: Any, optimizer: str, inputs: Any, lr: float) -> tuple[list[float], str]:
    """``STEPS`` steps of the pipeline with ``optimizer`` (autopipe's own, the plan's kind) at
    learning rate ``lr``: the losses and the optimizer's class name."""
    from autopipe.training import make_optimizer

    opt = make_optimizer(
        dataclasses.replace(plan, optimizer=optimizer),
        pipe.parameters(),
        lr,
        pipe.replica_group,
        pipe.expert_parameters,
        pipe.expert_replica_group,
    )
    local = pipe.local_batch(inputs)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        pipe.step(local if pipe.holds_first or pipe.holds_last else None)
        opt.step()
        losses.append(pipe.last_loss)
    return losses, type(opt).__name__


def _combine(gathered: list[dict[str, Any]]) -> dict[str, Any]:
    """The case's result from every rank's part."""
    failed = [g for g in gathered if "error" in g]
    if failed:
        # The root cause: a rank's own error before a peer's "timed out waiting".
        first = sorted(failed, key=lambda g: (g["comm"], g["rank"]))[0]
        return {
            "outcome": first["outcome"],
            "reason": f"rank {first['rank']}: {first['error']}",
            "ranks_failed": [g["rank"] for g in failed],
            "trace": first["trace"],
        }
    summary: dict[str, Any] = {}
    equal = True
    optimizers = list(gathered[0]["errors"])
    for optimizer in optimizers:
        params: dict[str, Any] = {}
        for g in gathered:
            for name, e in g["errors"][optimizer]["parameters"].items():
                if name not in params or e["excess"] > params[name]["excess"]:
                    params[name] = e
        worst = max(params, key=lambda n: params[n]["excess"])
        wrong = sorted(n for n, e in params.items() if e["excess"] > 0)
        # Every parameter of the model is compared on some rank, or the case is not equal.
        unseen = sorted(set(gathered[0]["errors"][optimizer]["expected"]) - set(params))
        wrong += [f"{name} (held by no rank)" for name in unseen]
        losses = next(g["errors"][optimizer]["losses"] for g in gathered)
        summary[optimizer] = {
            "max_error": max(e["max_error"] for e in params.values()),
            # largest |got - want| over the largest |want| of a parameter's update over lr
            "max_relative": max(e.get("max_relative", 0.0) for e in params.values()),
            # bfloat16: the same less the parameter's own roundings (BF16_GRADIENT_RTOL)
            "gradient_relative": max(e.get("gradient_relative", 0.0) for e in params.values()),
            "worst": worst,
            "wrong": wrong,
            "parameters": len(params),
            "losses": losses,
            "optimizer_class": sorted(
                {g["errors"][optimizer].get("optimizer_class", "") for g in gathered}
            ),
        }
        equal = equal and not wrong
    reason = None
    if not equal:
        reason = "; ".join(
            f"{o}: {len(summary[o]['wrong'])} parameters differ, worst {summary[o]['worst']} "
            f"(max error {summary[o]['max_error']:.3g})"
            for o in optimizers
            if summary[o]["wrong"]
        )
    return {"outcome": "equal" if equal else "differs", "reason": reason, **summary}


def _plan_summary(plan: dict[str, Any]) -> dict[str, Any]:
    return {
        "stages": [s["units"] for s in plan["stages"]],
        "mesh": [plan["num_stages"], plan.get("data_parallel"), plan.get("tensor_parallel")],
        "expert_parallel": plan.get("expert_parallel", 1),
        "context_parallel": plan.get("context_parallel", 1),
        "shard": plan.get("shard"),
        "schedule": plan["schedule"],
        "microbatches": plan["microbatches"],
    }


def main(out_dir: str, cases: list[str]) -> None:
    import torch.distributed as dist

    runner = Runner(Path(out_dir))
    for case in cases:
        keep = runner.run_case(case)
        if not keep:
            runner._rejoin()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    from autopipe.runtime.distributed import exit_process

    exit_process(0)  # Python's teardown can abort a rank after a clean run

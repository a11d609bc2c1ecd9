"""Counting what each aten op costs, without running it: FLOPs, bytes moved, kernels.

:class:`OpCounter` is a ``TorchDispatchMode`` that sees every aten op a model runs on
meta (or fake) tensors. For each op it takes

* FLOPs from ``torch.utils.flop_counter``'s formula registry (matmul, conv, attention;
  elementwise ops count as 0 FLOPs, as in FlopCounterMode), plus grouped matmuls
  (mixture-of-experts experts: ``aten._grouped_mm`` and Hugging Face's fallback op),
* bytes moved = bytes of the tensor inputs read + bytes of the outputs written
  (view ops move nothing and launch nothing; allocation-only ops likewise),
* one kernel launch per non-view op,

and prices it with the roofline ``max(flops / (peak x compute_eff), bytes / (bw x mem_eff))``.
The op's cost is booked to the *current unit* and *phase*, which the caller sets
(the unit graph's interpreter in forward, autograd-node pre-hooks in backward; see
``analytic.py``). Cost per op is O(#args).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from autopipe.core.catalog import DeviceSpec, normalize_dtype
from autopipe.core.gemm import gemm_compute_s

aten = torch.ops.aten

# CPU flash attention has the same FLOP count as the CUDA flash kernel (q, k, v lead both
# signatures; grad_out, q, k, v lead the backward ones).
_GEMM_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
"""Matmul dtypes priced per shape (autopipe.core.gemm); others at the flat efficiency."""


def _gemm_shape(packet: Any, args: tuple[Any, ...]) -> tuple[int, int, int, int] | None:
    """``(m, n, k, batch)`` of a plain matmul op (``mm``, ``addmm``, ``bmm``), else None."""
    aten = torch.ops.aten
    operands = args[1:3] if packet is aten.addmm else args[:2]
    if packet not in (aten.mm, aten.addmm, aten.bmm) or len(operands) < 2:
        return None
    a, b = operands
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return None
    if packet is aten.bmm:
        return (a.shape[1], b.shape[2], a.shape[2], a.shape[0])
    return (a.shape[0], b.shape[1], a.shape[1], 1)


def weight_matmul_flops(packet: Any, args: tuple[Any, ...], parameter_storages: set[int]) -> float:
    """FLOPs of ``packet(*args)`` when it is a weight matmul, else 0: an ``mm`` or ``addmm``
    (what ``nn.Linear`` and Hugging Face's ``Conv1D`` run, a 3-D input flattened to
    ``[tokens, in]``) with an operand whose storage is a parameter's (``parameter_storages``,
    keys of :func:`storage_key`; the weight's transpose is a view of it). ``2 m k n`` =
    2 x in x out x tokens per call: a linear called twice, or a tied head, counts each call.
    What an FP8 trainer runs at the FP8 peak (``UnitProfile.linear_forward_flops``)."""
    if packet not in (aten.mm, aten.addmm):
        return 0.0
    shape = _gemm_shape(packet, args)
    operands = args[1:3] if packet is aten.addmm else args[:2]
    if shape is None or not any(storage_key(t) in parameter_storages for t in operands):
        return 0.0
    m, n, k, _ = shape
    return 2.0 * m * n * k


_EXTRA_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu: flop_registry[
        aten._scaled_dot_product_flash_attention
    ],
    aten._scaled_dot_product_flash_attention_for_cpu_backward: flop_registry[
        aten._scaled_dot_product_flash_attention_backward
    ],
}


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(t.shape)


def grouped_mm_flops(a: Any, b: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    """FLOPs of a grouped matmul (mixture-of-experts experts): ``(S, K) x (E, K, N)`` with
    ``offs`` splitting the S routed token slots among the E experts, ``(E, M, K) x (E, K, N)``,
    or ``(M, K) x (K, N)`` grouped along K (the weight gradient). Every routed slot meets one
    expert's matrix, so the count is ``2 x S x K x N`` however the tokens are split; under
    balanced top-k routing each expert gets ``tokens x k / E`` of them and all E expert
    matrices are read once (the op's bytes)."""
    sa, sb = _shape(a), _shape(b)
    if len(sa) == 2 and len(sb) == 2:
        return 2 * sa[0] * sa[1] * sb[1]
    return 2 * int(out_val.numel()) * sa[-1]


def _grouped_mm_backward_flops(
    a: Any, b: Any, offs: Any, grad: Any, *args: Any, out_val: Any = None, **kwargs: Any
) -> int:
    # grad_input = grad x W^T and grad_weight = input^T x grad: two grouped matmuls
    return 2 * 2 * _shape(a)[0] * _shape(a)[-1] * _shape(grad)[-1]


# FLOP formulas by op name, for ops that torch.utils.flop_counter does not know and whose
# namespace may not be loaded (Hugging Face's grouped-matmul fallback for MoE experts).
_NAMED_FLOPS = {
    "aten._grouped_mm": grouped_mm_flops,
    "transformers.grouped_mm_fallback": grouped_mm_flops,
    "transformers.grouped_mm_fallback_backward": _grouped_mm_backward_flops,
}

# Ops that only allocate (no kernel touches the memory).
_ALLOC_ONLY = {
    aten.empty,
    aten.empty_like,
    aten.empty_strided,
    aten.new_empty,
    aten.new_empty_strided,
}

# Metadata queries that never launch a kernel.
_METADATA = {
    aten.sym_size,
    aten.sym_stride,
    aten.sym_numel,
    aten.sym_storage_offset,
    aten.is_contiguous,
    aten.size,
    aten.stride,
    aten.dim,
}


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage (views share it); stable while the storage lives."""
    return t.untyped_storage()._cdata


def _is_view(func: torch._ops.OpOverload) -> bool:
    returns = func._schema.returns
    if not returns:
        return False
    for ret in returns:
        info = ret.alias_info
        if info is None or info.is_write:
            return False
    return True


def _tensor_bytes(t: torch.Tensor) -> int:
    # An expanded (stride-0) tensor reads only its storage, not numel elements.
    return (
        min(t.numel(), t.untyped_storage().nbytes() // max(t.element_size(), 1)) * t.element_size()
    )


@dataclass
class PhaseCost:
    """Accumulated cost of one unit in one phase (forward or backward)."""

    flops: float = 0.0
    bytes_moved: float = 0.0
    kernels: int = 0
    compute_s: float = 0.0
    """Sum of ``flops / (peak x eff)`` over ops whose compute term won the roofline max."""
    memory_s: float = 0.0
    """Sum of ``bytes / (bw x eff)`` over ops whose memory term won."""
    working_set_bytes: int = 0
    """Largest single-op working set (inputs + outputs) seen in this phase."""
    parameter_flops: float = 0.0
    """FLOPs of the ops taking a parameter as an operand (``Y = X W``): in forward, what the
    weight gradient costs again in backward (``dW = X^T dY``), the analytic W."""
    linear_flops: float = 0.0
    """Of ``flops``, the weight matmuls' (:func:`weight_matmul_flops`): in forward, what an
    FP8 trainer runs at the FP8 peak."""
    ops: dict[str, int] = field(default_factory=dict)

    def seconds(self, launch_overhead_s: float) -> float:
        return self.compute_s + self.memory_s + self.kernels * launch_overhead_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "flops": self.flops,
            "bytes_moved": self.bytes_moved,
            "kernels": self.kernels,
            "compute_s": self.compute_s,
            "memory_s": self.memory_s,
            "working_set_bytes": self.working_set_bytes,
            "parameter_flops": self.parameter_flops,
        }


@dataclass
class UnitCost:
    """Everything counted for one unit: op costs per phase and bytes saved for backward."""

    forward: PhaseCost = field(default_factory=PhaseCost)
    backward: PhaseCost = field(default_factory=PhaseCost)
    saved_bytes: int = 0


class OpCounter(TorchDispatchMode):
    """Books every aten op's roofline cost to ``self.unit`` / ``self.phase``.

    ``units[n_units]`` (one past the last unit) is the loss.

    Also tracks, in forward, which unit produced each storage and which unit used it
    last, so cut bytes (tensors live across unit boundaries) fall out of the same pass.
    """

    def __init__(
        self,
        spec: DeviceSpec,
        n_units: int,
        parameter_storages: set[int],
        *,
        allow_tf32: bool = False,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.allow_tf32 = allow_tf32
        self.n_units = n_units
        # one extra entry after the real units collects the loss (forward and backward)
        self.units = [UnitCost() for _ in range(n_units + 1)]
        self.unit = 0
        self.phase = "forward"
        self.track_liveness = True
        self.parameter_storages = parameter_storages
        """Storage keys of every parameter and buffer (not activations)."""
        self.producer: dict[int, int] = {}
        self.last_use: dict[int, int] = {}
        self.storage_bytes: dict[int, int] = {}
        self._keep_alive: list[Any] = []
        self._peaks: dict[torch.dtype, float] = {}

    # -- bookkeeping helpers -------------------------------------------------------------

    def mark_inputs(self, tensors: list[torch.Tensor]) -> None:
        """Model inputs: produced "before" unit 0."""
        for t in tensors:
            key = storage_key(t)
            self.producer.setdefault(key, -1)
            self.storage_bytes[key] = t.untyped_storage().nbytes()
            self._keep_alive.append(t)

    def mark_outputs(self, tensors: list[torch.Tensor]) -> None:
        """Model outputs are used after the last unit."""
        for t in tensors:
            key = storage_key(t)
            if key in self.producer:
                self.last_use[key] = self.n_units

    def _peak(self, dtype: torch.dtype) -> float:
        if dtype not in self._peaks:
            name = str(dtype).removeprefix("torch.")
            try:
                self._peaks[dtype] = self.spec.peak_for(
                    normalize_dtype(name), allow_tf32=self.allow_tf32
                )
            except ValueError:
                # Integer/float64 matmuls are rare; price them at the FP32 rate.
                self._peaks[dtype] = self.spec.peak_for("float32")
        return self._peaks[dtype]

    # -- the dispatch hook ---------------------------------------------------------------

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if packet in _METADATA or _is_view(func):
            return out
        in_tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        out_tensors = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor)]
        if self.track_liveness and self.phase == "forward":
            self._book_liveness(in_tensors, out_tensors)
        if packet in _ALLOC_ONLY:
            return out
        cost = (
            self.units[self.unit].forward
            if self.phase == "forward"
            else self.units[self.unit].backward
        )
        read = sum(_tensor_bytes(t) for t in in_tensors)
        written = sum(_tensor_bytes(t) for t in out_tensors)
        moved = read + written
        formula = (
            flop_registry.get(packet) or _EXTRA_FLOPS.get(packet) or _NAMED_FLOPS.get(str(packet))
        )
        flops = float(formula(*args, **kwargs, out_val=out)) if formula is not None else 0.0
        memory_s = moved / (self.spec.memory_bandwidth_bytes_per_s * self.spec.memory_efficiency)
        compute_s = 0.0
        if flops > 0:
            dtype = next((t.dtype for t in in_tensors if t.is_floating_point()), torch.float32)
            shape = _gemm_shape(packet, args) if dtype in _GEMM_DTYPES else None
            if shape is not None:  # its math at its shape (autopipe.core.gemm); bytes below
                name = _GEMM_DTYPES[dtype]
                if (
                    name == "float32"
                    and self.allow_tf32
                    and "tfloat32" in self.spec.peak_flops_per_s
                ):
                    name = "tfloat32"
                compute_s = gemm_compute_s(self.spec, *shape[:3], name, batch=shape[3])
            else:
                compute_s = flops / (self._peak(dtype) * self.spec.compute_efficiency)
        if compute_s >= memory_s:
            cost.compute_s += compute_s
        else:
            cost.memory_s += memory_s
        cost.flops += flops
        if flops > 0 and any(storage_key(t) in self.parameter_storages for t in in_tensors):
            cost.parameter_flops += flops
            cost.linear_flops += weight_matmul_flops(packet, args, self.parameter_storages)
        cost.bytes_moved += moved
        cost.kernels += 1
        cost.working_set_bytes = max(cost.working_set_bytes, moved)
        name = str(packet).removeprefix("aten.")
        cost.ops[name] = cost.ops.get(name, 0) + 1
        return out

    def _book_liveness(
        self, in_tensors: list[torch.Tensor], out_tensors: list[torch.Tensor]
    ) -> None:
        for t in in_tensors:
            key = storage_key(t)
            if key in self.producer and self.last_use.get(key, -2) < self.unit:
                self.last_use[key] = self.unit
        for t in out_tensors:
            key = storage_key(t)
            if key not in self.producer and key not in self.parameter_storages:
                self.producer[key] = self.unit
                self.storage_bytes[key] = t.untyped_storage().nbytes()
                self._keep_alive.append(t.untyped_storage())

    # -- results -------------------------------------------------------------------------

    def cut_bytes(self) -> list[int]:
        """Bytes live across each cut ``i | i+1``: produced at or before unit i, used after it."""
        n = self.n_units
        diff = [0] * (n + 1)
        for key, producer in self.producer.items():
            # live across cuts producer .. last-1 (cut i sits between unit i and i+1);
            # model inputs have producer -1
            lo = max(producer, 0)
            hi = min(self.last_use.get(key, producer) - 1, n - 2)
            if lo <= hi:
                diff[lo] += self.storage_bytes[key]
                diff[hi + 1] -= self.storage_bytes[key]
        cuts, running = [], 0
        for i in range(n - 1):
            running += diff[i]
            cuts.append(running)
        return cuts


def parameter_storage_keys(*modules: torch.nn.Module) -> set[int]:
    """:func:`storage_key` of every parameter and buffer of ``modules`` (on meta as well:
    the storage's identity, not its address, which is 0 there)."""
    return {storage_key(t) for m in modules for t in [*m.parameters(), *m.buffers()]}


class WeightMatmulCounter(TorchDispatchMode):
    """Sums :func:`weight_matmul_flops` of the ops it sees into ``flops[self.unit]`` (the
    caller sets ``unit``), running each op as it is: the measured profiler's count of each
    unit's weight-matmul FLOPs, from one forward on whatever device the model is on."""

    def __init__(self, n_units: int, parameter_storages: set[int]) -> None:
        super().__init__()
        self.unit = 0
        self.flops = [0.0] * n_units
        self.parameter_storages = parameter_storages

    def at(self, node_unit: Mapping[str, int], node: fx.Node) -> None:
        """Book the ops of ``node`` (about to run in an fx interpreter) to its unit; a node in
        no unit, and the graph's output, to the unit before it."""
        if node.op != "output":
            self.unit = node_unit.get(node.name, self.unit)

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if 0 <= self.unit < len(self.flops):
            self.flops[self.unit] += weight_matmul_flops(
                func.overloadpacket, args, self.parameter_storages
            )
        return out

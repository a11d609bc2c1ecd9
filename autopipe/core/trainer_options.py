"""The trainer options a plan was priced for, as one of its instructions. Torch-free.

A :class:`TrainerOptions` is what the ranks (``autopipe run``) and the emitted trainer
configs (``autopipe emit megatron`` / ``torchtitan``) act on besides the cut and the mesh:
compiled stages, FP8 matmuls, selective re-computation, the TP and data-parallel
communication options. The planner copies them from its request
(:meth:`TrainerOptions.from_request`) into ``Plan.trainer``; the ranks and the emitters read
them there, never from ``plan.request`` (the report's record of what was asked: #34, #37).

Each default is what a plan made without them meant, so a plan without a request (one built
by hand) is emitted and run as before they were recorded.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from autopipe.core.fields import FieldError
from autopipe.core.request import PlanRequest
from autopipe.core.vocabulary import PRECISIONS

__all__ = ["TrainerOptions"]


@dataclass(frozen=True)
class TrainerOptions:
    """How the trainer runs the plan's stages, as the plan was priced (``autopipe plan``'s
    flags, :class:`~autopipe.core.request.PlanRequest`'s fields of the same names)."""

    compile: bool = False
    """The stages are ``torch.compile``'d (``--compile``): ``autopipe run`` compiles them,
    torchtitan's config sets ``[compile] enable``."""
    precision: str = "bf16"
    """Matmul precision (``--precision``, :data:`~autopipe.core.vocabulary.PRECISIONS`):
    ``fp8`` is Megatron's ``--fp8-format hybrid``, torchtitan's Float8 linear converter."""
    selective_recompute: bool = False
    """Selective activation checkpointing (``--selective-recompute``): Megatron's
    ``--recompute-granularity selective``, torchtitan's ``mode = "selective"``."""
    sequence_parallel: bool = True
    """With T > 1, sequence parallelism outside the TP regions (on unless
    ``--no-sequence-parallel``): Megatron's ``--sequence-parallel``."""
    loss_parallel: bool | None = None
    """With T > 1, the cross-entropy on the vocabulary-sharded logits (``--loss-parallel``);
    False: the logits gathered to every TP rank, as ``autopipe run`` runs the head (torchtitan's
    ``disable_loss_parallel``). None: not recorded (a plan without a request), torchtitan's
    own default kept."""
    tp_comm_overlap: bool = False
    """TP collectives overlapped with their matmuls (``--tp-comm-overlap``): Megatron's
    ``--tp-comm-overlap``, torchtitan's async TP (compiled)."""
    grad_reduce_overlap: bool = False
    """Gradient reduction during the last backward (``--overlap-grad-reduce``): Megatron's
    ``--overlap-grad-reduce`` (and ``--overlap-param-gather`` with ZeRO-1)."""
    grad_reduce_fp32: bool = False
    """The data-parallel gradient reduction in fp32 (``--grad-reduce-fp32``): Megatron's
    ``--accumulate-allreduce-grads-in-fp32``."""
    reshard_after_forward: bool = True
    """``shard="parameters"``: FSDP2 reshards after each micro-batch's forward (False:
    ``--no-reshard-after-forward``, torchtitan's ``fsdp_reshard_after_forward = "never"``)."""

    @classmethod
    def from_request(cls, request: PlanRequest | None) -> TrainerOptions:
        """The options ``request`` asked for (the defaults for None: a plan without one)."""
        if request is None:
            return cls()
        return cls(**{f.name: getattr(request, f.name) for f in dataclasses.fields(cls)})

    @classmethod
    def from_dict(cls, data: Any) -> TrainerOptions:
        """The options a plan file's ``"trainer"`` object holds (the defaults for the keys it
        lacks; keys of a newer writer ignored), checked (:meth:`check`: FieldError)."""
        if not isinstance(data, dict):
            raise FieldError("trainer", "is not an object")
        names = {f.name for f in dataclasses.fields(cls)}
        out = cls(**{k: v for k, v in data.items() if k in names})
        out.check()
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every field."""
        return dataclasses.asdict(self)

    def check(self) -> None:
        """FieldError naming the first field (``trainer.<name>``) that is not a value of its
        kind: true or false (or null for ``loss_parallel``), a precision of ``PRECISIONS``."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "precision":
                if value not in PRECISIONS:
                    raise FieldError(
                        "trainer.precision",
                        f"is {value!r}; expected one of {', '.join(PRECISIONS)}",
                    )
            elif not isinstance(value, bool) and not (f.name == "loss_parallel" and value is None):
                raise FieldError(f"trainer.{f.name}", f"is {value!r}; expected true or false")

    def flags(self) -> list[str]:
        """The ``autopipe plan`` flags that ask for these options where they differ from the
        flags' defaults, e.g. ``["--compile", "--precision fp8"]`` ([] for the defaults)."""
        chosen = [
            (self.compile, "--compile"),
            (self.precision != "bf16", f"--precision {self.precision}"),
            (self.selective_recompute, "--selective-recompute"),
            (not self.sequence_parallel, "--no-sequence-parallel"),
            (self.loss_parallel is True, "--loss-parallel"),
            (self.tp_comm_overlap, "--tp-comm-overlap"),
            (self.grad_reduce_overlap, "--overlap-grad-reduce"),
            (self.grad_reduce_fp32, "--grad-reduce-fp32"),
            (not self.reshard_after_forward, "--no-reshard-after-forward"),
        ]
        return [flag for on, flag in chosen if on]

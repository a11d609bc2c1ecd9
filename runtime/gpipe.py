"""GPipe: torchgpipe's interface for an ``nn.Sequential``, on autopipe's executor.

    model = GPipe(nn.Sequential(a, b, c, d), balance=[2, 2], devices=["cuda:0", "cuda:1"], chunks=8)
    loss_fn(model(x), y).backward()

``balance[j]`` consecutive layers form partition ``j`` on ``devices[j]``. A mini-batch is
split into ``chunks`` micro-batches and run in the fill-drain schedule; gradients equal the
unsplit model's (accumulated over micro-batches). Checkpoint modes: ``"always"`` (every
micro-batch re-materialized), ``"except_last"`` (all but the last micro-batch, whose backward
starts at once), ``"never"``; nothing is re-materialized in eval mode or under ``no_grad``.
Inputs and each partition's outputs are a tensor or a tuple of tensors (a tuple is passed to
the next layer as one argument, as ``nn.Sequential`` does). The module behaves like the
``nn.Sequential`` it wraps (``len``, indexing, iteration, ``named_children``, ``state_dict``
keys; ``load_state_dict`` also takes torchgpipe's ``partitions.N.``-prefixed keys, so its
checkpoints migrate). It can be cast (``.half()``, ``.to(torch.double)``, ``.to(dtype=...)``)
but not moved: it is placed on its devices at construction.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn, cast

import torch
from autopipe.runtime.batchnorm import begin_minibatch, convert_deferred_batch_norm
from autopipe.runtime.executor import Stage, run_pipeline
from autopipe.runtime.microbatch import gather, scatter
from autopipe.runtime.recorder import Clock, TimelineRecorder
from autopipe.runtime.rng import MicrobatchRNG, draw_base_seed
from autopipe.runtime.split import own_copy, shared_parameters
from autopipe.runtime.torch_devices import as_device, default_devices
from torch import nn

from autopipe.core.timeline import Timeline

__all__ = ["TORCHGPIPE_CHECKPOINT_MODES", "GPipe", "checkpoint_stop"]

TORCHGPIPE_CHECKPOINT_MODES = ("always", "except_last", "never")
"""torchgpipe's words, per *micro-batch*: ``except_last`` re-materializes every micro-batch
but the last (whose backward follows at once). The planner's words are per stage
(``autopipe.core.checkpointing``); this module is the only place that speaks these."""


def _check_torchgpipe_mode(mode: str) -> None:
    if mode not in TORCHGPIPE_CHECKPOINT_MODES:
        raise ValueError(
            "checkpoint is not one of "
            f"{', '.join(map(repr, TORCHGPIPE_CHECKPOINT_MODES))}: got {mode!r}"
        )


def checkpoint_stop(mode: str, num_microbatches: int) -> int:
    """Number of leading micro-batches re-materialized under torchgpipe's ``mode``."""
    return {"always": num_microbatches, "except_last": num_microbatches - 1, "never": 0}[mode]


def _check_tensors(value: Any, what: str) -> None:
    ok = isinstance(value, torch.Tensor) or (
        isinstance(value, tuple)
        and len(value) > 0
        and all(isinstance(v, torch.Tensor) for v in value)
    )
    if not ok:
        raise TypeError(
            f"{what} must be a Tensor or a tuple of Tensors, got {type(value).__name__}"
        )


def _split(module: nn.Sequential, balance: Sequence[int]) -> list[nn.Sequential]:
    layers = list(module._modules.items())
    partitions, start = [], 0
    for count in balance:
        partitions.append(nn.Sequential(OrderedDict(layers[start : start + count])))
        start += count
    return partitions


def _verify(module: nn.Sequential, partitions: list[nn.Sequential]) -> None:
    children = list(module._modules.values())
    if len({id(c) for c in children}) != len(children):
        raise ValueError(
            "module with duplicate children is not supported; give each position its own module"
        )
    for first, _, j, _ in shared_parameters(partitions):
        raise ValueError(
            f"a parameter is shared by partitions {first} and {j}; "
            "put the layers that share it in one partition (change balance)"
        )


def _partition_fn(
    partition: nn.Sequential, last: bool, first: bool = False
) -> Callable[[Any], tuple[Any]]:
    """The stage function: one value (a tensor or a tuple of tensors) in, one out; the
    executor flattens tuples around the autograd node.

    A later partition that starts with an in-place layer (``nn.ReLU(inplace=True)``) gets a
    copy of its input: the executor hands it an autograd leaf, which autograd does not let
    a layer overwrite (see ``split._clone_written_inputs`` for traced stages).
    """
    head = next(iter(partition.children()), None)
    copy_input = not first and getattr(head, "inplace", False) is True

    def fn(value: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[Any]:
        out = partition(own_copy(value) if copy_input else value)
        _check_tensors(out, "the output of the last partition" if last else "a partition output")
        return (out,)

    return fn


class GPipe(nn.Module):
    """Pipeline-parallel ``nn.Sequential`` (torchgpipe-compatible constructor and attributes)."""

    def __init__(
        self,
        module: nn.Sequential,
        balance: Sequence[int] | None = None,
        devices: Sequence[torch.device | str | int] | None = None,
        chunks: int | float = 1,
        checkpoint: str = "except_last",
        deferred_batch_norm: bool = False,
    ) -> None:
        super().__init__()
        chunks = _checked_chunks(chunks)
        _check_torchgpipe_mode(checkpoint)
        balance = _checked_balance(module, balance)
        devs = _checked_devices(devices, len(balance))
        _verify(module, _split(module, balance))  # before the BatchNorm swap mutates the module
        if deferred_batch_norm:
            module = convert_deferred_batch_norm(module)  # type: ignore[assignment]
        partitions = _split(module, balance)

        for name, layer in module.named_children():
            self.add_module(name, layer)
        for part, device in zip(partitions, devs, strict=False):
            part.to(device)
        # Not registered: the layers above are the children, so state_dict keys and
        # named_children match the wrapped nn.Sequential.
        object.__setattr__(self, "partitions", nn.ModuleList(partitions))
        self.balance = balance
        self.devices = devs[: len(balance)]
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.deferred_batch_norm = deferred_batch_norm
        # The clocks each forward's timeline is read on (see runtime/recorder.py).
        self.timeline_clocks: dict[str, Clock | None] | None = None
        self.last_recorder: TimelineRecorder | None = None
        self._stages = [
            Stage(
                _partition_fn(part, j == len(partitions) - 1, first=j == 0),
                dev,
                list(part.modules()),
            )
            for j, (part, dev) in enumerate(zip(partitions, self.devices, strict=True))
        ]
        self.register_load_state_dict_pre_hook(_torchgpipe_keys)

    @property
    def last_timeline(self) -> Timeline | None:
        """The last forward's tasks, and its backward's once run, as a ``Timeline`` (None
        before the first forward). Built on each access: read it after ``backward()``."""
        return None if self.last_recorder is None else self.last_recorder.timeline()

    # -- nn.Sequential behaviour -------------------------------------------------------
    def __len__(self) -> int:
        partitions = cast(nn.ModuleList, self.partitions)
        return sum(len(cast(nn.Sequential, p)) for p in partitions)

    def __getitem__(self, index: int) -> nn.Module:
        layers = list(self._modules.values())
        if not isinstance(index, int):
            raise TypeError(f"GPipe indices must be integers, got {type(index).__name__}")
        if not -len(layers) <= index < len(layers):
            raise IndexError(f"index {index} is out of range for a GPipe of {len(layers)} layers")
        return layers[index]  # type: ignore[return-value]

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())  # type: ignore[arg-type]

    # -- moving is refused, casting is not ---------------------------------------------
    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(
            "a GPipe module cannot be moved after construction; its partitions are already "
            "on their devices: move the nn.Sequential before wrapping it (casting, e.g. "
            ".half() or .to(torch.double), is fine)"
        )

    cuda = cpu = _refuse

    def to(self, *args: Any, **kwargs: Any) -> GPipe:
        """Cast (``to(dtype)``, ``to(dtype=...)``); any device, or a tensor (whose device
        would be taken), is refused: the partitions stay on their devices."""
        tensor_given = any(isinstance(a, torch.Tensor) for a in args) or "tensor" in kwargs
        device, _, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None or tensor_given:
            self._refuse()
        return super().to(*args, **kwargs)

    def type(self, dst_type: torch.dtype | str) -> GPipe:
        """Cast to a dtype; a tensor type name (e.g. ``torch.cuda.HalfTensor``) would also
        move the weights and is refused."""
        if not isinstance(dst_type, torch.dtype):
            self._refuse()
        return super().type(dst_type)

    # -- forward ------------------------------------------------------------------------------
    def forward(self, input: torch.Tensor | tuple[torch.Tensor, ...]) -> Any:
        _check_tensors(input, "GPipe input")
        if not self._stages:  # an empty nn.Sequential is the identity, as in torchgpipe
            return input
        microbatches = scatter([input], self.chunks)
        num = len(microbatches)
        if self.training:
            begin_minibatch(list(cast(nn.ModuleList, self.partitions)), num)
        stop = checkpoint_stop(self.checkpoint, num)
        if not (self.training and torch.is_grad_enabled()):
            stop = 0
        self.last_recorder = recorder = TimelineRecorder(
            self.devices, num_stages=len(self._stages), clocks=self.timeline_clocks
        )
        outputs = run_pipeline(
            self._stages,
            microbatches,
            checkpoint=lambda i, j: i < stop,
            recorder=recorder,
            rng=MicrobatchRNG(draw_base_seed()),
        )
        return gather([out for (out,) in outputs])


def _checked_chunks(chunks: int | float) -> int:
    """``chunks`` as torchgpipe takes it (``42.0`` is 42); ValueError unless a positive integer."""
    if isinstance(chunks, float) and chunks.is_integer():
        chunks = int(chunks)  # torchgpipe takes chunks=42.0 as 42
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks <= 0:
        raise ValueError(f"number of chunks must be a positive integer, got {chunks!r}")
    return chunks


def _checked_balance(module: nn.Module, balance: Sequence[int] | None) -> list[int]:
    """``balance`` as integers; TypeError for a module that is not an ``nn.Sequential``,
    ValueError for a balance that is missing, not positive or does not count every layer."""
    if not isinstance(module, nn.Sequential):
        raise TypeError(
            f"module must be nn.Sequential to be partitioned, got {type(module).__name__}"
        )
    if balance is None:
        raise ValueError(
            "balance is required: the number of layers in each partition, e.g. balance=[2, 2]"
        )
    balance = [int(b) for b in balance]
    if sum(balance) != len(module):
        raise ValueError(
            f"module and sum of balance have different length (module: {len(module)}, "
            f"sum of balance: {sum(balance)}); balance must count every layer once"
        )
    if any(b <= 0 for b in balance):
        raise ValueError(f"all balance numbers must be positive integers, got {balance}")
    return balance


def _checked_devices(
    devices: Sequence[torch.device | str | int] | None, partitions: int
) -> list[torch.device]:
    """The devices (default: ``default_devices``); IndexError if fewer than ``partitions``."""
    if devices is None:
        devices = default_devices(partitions)
    devs = [as_device(d) for d in devices]
    if len(devs) < partitions:
        raise IndexError(
            f"too few devices to hold given partitions (devices: {len(devs)}, partitions: {partitions})"
        )
    return devs


_TORCHGPIPE_KEY = re.compile(r"partitions\.\d+\.")


def _torchgpipe_keys(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any, **__: Any
) -> None:
    """Rename torchgpipe's ``partitions.N.LAYER...`` keys to this module's ``LAYER...``.

    torchgpipe registers its partitions as children, so its checkpoints carry that prefix;
    each partition keeps the wrapped Sequential's layer names, so dropping it is the whole
    translation. Keys already in this module's form are left as they are.
    """
    for key in [k for k in state_dict if k.startswith(prefix)]:
        match = _TORCHGPIPE_KEY.match(key, len(prefix))
        if match is not None:
            state_dict[prefix + key[match.end() :]] = state_dict.pop(key)

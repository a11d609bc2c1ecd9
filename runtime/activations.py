"""Count the activation bytes autograd holds for backward: the figure a schedule changes.

A pipeline schedule decides how many micro-batches' forwards a stage keeps alive before their
backwards free them (GPipe: all M; 1F1B: at most K - rank). :class:`ActivationMeter` sees
every tensor autograd saves for backward while :meth:`ActivationMeter.saving` is active
(``torch.autograd.graph.saved_tensors_hooks``) and counts the bytes it covers once, however
many saves share them, until autograd drops the last of them (a backward without
``retain_graph`` frees them). Parameters, buffers and any tensor given in ``exclude`` are not
activations and are not counted. ``peak_bytes`` is the most held at any one time; a device's
allocator peak also holds gradients, temporaries and the optimizer's state, which this does not.

The hooks are thread-local: enter :meth:`saving` on the thread that runs the forward.
Cost: one dictionary update per saved tensor (a lock), one more when it is freed.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["ActivationMeter"]


class _Saved:
    """A saved tensor as autograd keeps it; its meter counts its bytes while it lives."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _key(t: torch.Tensor) -> tuple[str, int, int]:
    """The bytes a tensor covers: device, first address, size (a view of a parameter, such
    as ``weight.t()``, has the parameter's; a micro-batch's rows of the batch, its own)."""
    return (str(t.device), t.data_ptr(), t.numel() * t.element_size())


class ActivationMeter:
    """Bytes of the tensors autograd saves for backward (see the module docstring).

    ``current_bytes``: held now; ``peak_bytes``: the most held at once since creation or
    :meth:`reset_peak`. ``exclude``: tensors (and views covering the same bytes) never counted (parameters,
    buffers, replicas of tied parameters).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {_key(t) for t in exclude}
        self._held: dict[tuple[str, int, int], int] = {}  # key -> saves alive
        self._lock = threading.Lock()
        self.current_bytes = 0
        self.peak_bytes = 0

    def reset_peak(self) -> None:
        """Start a new peak from what is held now."""
        with self._lock:
            self.peak_bytes = self.current_bytes

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Count what autograd saves for backward in the body (this thread only)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _pack(self, t: torch.Tensor) -> Any:
        if t.device.type == "meta" or t.layout != torch.strided:
            return t
        key = _key(t)
        if key in self._excluded or key[2] == 0:
            return t
        # Detached: a saved output holding its own grad_fn would be a reference cycle
        # through autograd's node, kept alive after the graph is dropped without backward.
        saved = _Saved(t.detach())
        with self._lock:
            alive = self._held.get(key, 0)
            self._held[key] = alive + 1
            if alive == 0:
                self.current_bytes += key[2]
                self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        weakref.finalize(saved, self._release, key)
        return saved

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _release(self, key: tuple[str, int, int]) -> None:
        with self._lock:
            alive = self._held[key] - 1
            if alive:
                self._held[key] = alive
            else:
                del self._held[key]
                self.current_bytes -= key[2]

"""Tied parameters across devices in one process: one logical parameter, a copy per device.

A parameter that stages on different devices use (GPT-2's token embedding and LM head, T5's
shared embedding) cannot live on both devices. The first stage that uses it keeps the real
``Parameter`` (the one the optimizer updates, listed by ``pipeline.parameters()``); every
other device gets a *replica*: a plain tensor that requires grad, installed in those stages'
modules under the parameter's names. Each forward starts by copying the parameter into its
replicas (:meth:`TiedReplicas.refresh`), and at the end of the backward pass the replicas'
gradients are added into the parameter's ``.grad`` (queued on the autograd engine, so the
sum happens once every stage has finished), as Megatron-LM sums the word-embedding gradient
of its first and last stage. Stages on the same device share the ``Parameter`` itself.

The replica is installed in a private shallow copy of each module on the path to it, so the
user's model keeps its own modules and parameter untouched. Cost per step: one device copy
and one gradient addition per replica.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from autopipe.runtime.planned_stages import TiedParameter
from torch import nn

__all__ = ["TiedReplicas"]


def _private_copy(module: nn.Module) -> nn.Module:
    """A shallow copy whose parameter/buffer/module tables can change without touching the
    original (the tensors and child modules stay shared)."""
    twin = copy.copy(module)
    twin._parameters = dict(module._parameters)
    twin._buffers = dict(module._buffers)
    twin._modules = dict(module._modules)
    return twin


def _install(root: nn.Module, name: str, value: torch.Tensor, shared: set[int]) -> None:
    """Make ``root``'s attribute path ``name`` resolve to ``value``, copying every module on
    the path that is shared with the user's model (``shared``: their ids)."""
    *path, leaf = name.split(".")
    parent = root
    for part in path:
        child = parent._modules[part]
        assert child is not None
        if id(child) in shared:
            child = _private_copy(child)
            parent._modules[part] = child
        parent = child
    parent._parameters.pop(leaf, None)
    object.__setattr__(parent, leaf, value)


class TiedReplicas:
    """Replicas of the tied parameters of stages on other devices (see the module docstring).

    ``stages[j]`` is stage ``j``'s module (modified in place), ``devices[j]`` its device.
    ``model_modules`` are the modules of the user's model, never modified.
    """

    def __init__(
        self,
        stages: Sequence[nn.Module],
        devices: Sequence[torch.device],
        tied: Sequence[TiedParameter],
        model_modules: Sequence[nn.Module],
    ) -> None:
        shared = {id(m) for m in model_modules}
        self._pairs: list[tuple[nn.Parameter, torch.Tensor]] = []
        self._queued = False
        for t in tied:
            owner = t.stages[0]
            param = stages[owner].get_parameter(t.names[owner][0])
            replicas: dict[torch.device, torch.Tensor] = {}
            for stage in t.stages[1:]:
                device = devices[stage]
                if device == devices[owner]:
                    continue  # same device: the stages share the Parameter itself
                replica = replicas.get(device)
                if replica is None:
                    replica = param.detach().to(device, copy=True)
                    replica.requires_grad_(param.requires_grad)
                    if param.requires_grad:
                        replica.register_post_accumulate_grad_hook(self._queue_fold)
                    replicas[device] = replica
                    self._pairs.append((param, replica))
                for name in t.names[stage]:
                    _install(stages[stage], name, replica, shared)

    def __len__(self) -> int:
        return len(self._pairs)

    def refresh(self) -> None:
        """Copy every parameter into its replicas (after an optimizer step changed it)."""
        with torch.no_grad():
            for param, replica in self._pairs:
                replica.copy_(param)

    def _queue_fold(self, _replica: torch.Tensor) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._fold)

    def _fold(self) -> None:
        """Add the replicas' gradients into their parameters' ``.grad`` (end of backward)."""
        self._queued = False
        with torch.no_grad():
            for param, replica in self._pairs:
                if replica.grad is None:
                    continue
                grad = replica.grad.to(param.device)
                param.grad = grad if param.grad is None else param.grad + grad
                replica.grad = None

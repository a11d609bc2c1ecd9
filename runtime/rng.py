"""Per-micro-batch random streams, so dropout does not depend on the schedule.

The pipeline runs micro-batches interleaved (clock order), so drawing dropout masks from
the one global generator would make them depend on the number of stages and the schedule.
Instead each forward draws one base seed from the default CPU generator and gives
micro-batch ``i`` its own stream per generator, seeded ``base + i``: the stages of
micro-batch ``i`` that use one generator (all CPU stages; the stages on one GPU) continue one
stream, on whatever stage they run. With every stage on one device the result equals running the unsplit model on micro-batch ``i`` right after
``torch.manual_seed(base + i)``, for every ``K`` and schedule. Only the generator of the
task's device is swapped (the CPU generator for CPU stages, that GPU's generator for CUDA
stages), and a task holds that generator's lock while it runs, so two workers never
interleave draws from one generator (CPU stages on "cpu" and "cpu:0" take turns; each GPU
has one worker, so its lock is never contended). The caller's generators are left as they
were after the base-seed draw. Cost per task: one get/set of a generator
state (about 5 KB for the CPU Mersenne Twister).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["MicrobatchRNG", "draw_base_seed", "microbatch_seed"]

_SEED_BOUND = 2**62


def draw_base_seed() -> int:
    """One draw from the default CPU generator: the base seed of this iteration's streams."""
    return int(torch.randint(0, _SEED_BOUND, (), dtype=torch.int64).item())


def microbatch_seed(base_seed: int, microbatch: int) -> int:
    """Seed of micro-batch ``microbatch``'s stream."""
    return (base_seed + microbatch) % _SEED_BOUND


_LOCKS: dict[int, threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()


def _lock_of(gen: torch.Generator) -> threading.Lock:
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(id(gen), threading.Lock())


def _generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return torch.default_generator


class MicrobatchRNG:
    """Generator states of each (micro-batch, generator) stream of one iteration."""

    def __init__(self, base_seed: int) -> None:
        self.base_seed = base_seed
        self._states: dict[tuple[int, int], Any] = {}

    @contextmanager
    def stream(self, microbatch: int, device: torch.device) -> Iterator[None]:
        """Run the body with ``device``'s default generator on micro-batch ``microbatch``'s stream."""
        gen = _generator(device)
        key = (microbatch, id(gen))
        with _lock_of(gen):
            state = self._states.get(key)
            if state is None:
                fresh = torch.Generator(device=gen.device)
                fresh.manual_seed(microbatch_seed(self.base_seed, microbatch))
                state = fresh.get_state()
            saved = gen.get_state()
            gen.set_state(state)
            try:
                yield
            finally:
                self._states[key] = gen.get_state()
                gen.set_state(saved)

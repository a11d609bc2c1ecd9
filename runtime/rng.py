"""Per-micro-batch random streams, so dropout does not depend on the schedule.

The pipeline runs micro-batches interleaved (clock order), so drawing dropout masks from
the one global generator would make them depend on the number of stages and the schedule.
Instead each training forward draws one base seed from the default CPU generator and gives
micro-batch ``i`` its own stream seeded ``base + i``: every stage of micro-batch ``i``
continues that stream, on whatever stage it runs. The result equals running the unsplit model
on micro-batch ``i`` right after ``torch.manual_seed(base + i)``, for every ``K``. Only the
generator of the task's device is swapped (the CPU generator for CPU stages, that GPU's
generator for CUDA stages), so concurrent workers never share one; the caller's generators
are left as they were after the base-seed draw. Cost per task: one get/set of a generator
state (about 5 KB for the CPU Mersenne Twister).
"""

from __future__ import annotations

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


def _generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return torch.default_generator


class MicrobatchRNG:
    """Generator states of each (micro-batch, device) stream of one iteration."""

    def __init__(self, base_seed: int) -> None:
        self.base_seed = base_seed
        self._states: dict[tuple[int, str], Any] = {}

    @contextmanager
    def stream(self, microbatch: int, device: torch.device) -> Iterator[None]:
        """Run the body with ``device``'s default generator on micro-batch ``microbatch``'s stream."""
        gen = _generator(device)
        key = (microbatch, str(device))
        state = self._states.get(key)
        if state is None:
            fresh = torch.Generator(device=device)
            fresh.manual_seed(microbatch_seed(self.base_seed, microbatch))
            state = fresh.get_state()
        saved = gen.get_state()
        gen.set_state(state)
        try:
            yield
        finally:
            self._states[key] = gen.get_state()
            gen.set_state(saved)

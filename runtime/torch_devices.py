"""Device names as the runtime uses them: one GPU has exactly one ``torch.device``.

``"cuda"`` and ``"cuda:0"`` are different keys to the runtime (one worker thread, one RNG lock
and one timeline clock per key), so every device is normalised once, at construction:
an ``int`` is that CUDA device and an unindexed ``"cuda"`` gets the current device's index.
A CPU device keeps its name (``"cpu"`` and ``"cpu:0"`` stay two keys, which the tests use to
run CPU stages on separate worker threads).
"""

from __future__ import annotations

import torch

__all__ = ["as_device", "default_devices"]


def as_device(device: torch.device | str | int) -> torch.device:
    """``device`` as a ``torch.device``; CUDA devices always carry an index."""
    if isinstance(device, int):
        return torch.device("cuda", device)
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def default_devices(count: int) -> list[torch.device]:
    """All visible CUDA devices, else ``count`` copies of the CPU."""
    if torch.cuda.is_available():
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device("cpu")] * count

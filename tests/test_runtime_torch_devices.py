"""Device names as the runtime uses them (``autopipe.runtime.torch_devices``)."""

from __future__ import annotations

import torch


def test_devices_are_normalised() -> None:
    from autopipe.runtime.torch_devices import as_device

    assert as_device(2) == torch.device("cuda", 2)
    assert as_device("cpu") == torch.device("cpu") != as_device("cpu:0")
    if torch.cuda.is_available():
        assert as_device("cuda") == torch.device("cuda", torch.cuda.current_device())

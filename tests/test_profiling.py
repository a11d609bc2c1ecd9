"""autopipe/profiling.py: profiling a model file, the checks before it, and model failures."""

from __future__ import annotations

from pathlib import Path

import pytest

import autopipe.profiling as profiling
from autopipe.core.catalog import get_device
from autopipe.core.errors import UsageError
from autopipe.device_target import DeviceTarget
from autopipe.modelfile import load_model_file
from autopipe.profiling import (
    ProfileRequest,
    check_counting_request,
    model_failed,
    profile_model_file,
    too_big_to_build,
)

MLP = """
import torch


def build_model():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def example_inputs(batch_size=4):
    return torch.randn(batch_size, 8)


def wrong_width():
    return torch.nn.Sequential(torch.nn.Linear(3, 4))
"""


@pytest.fixture
def mlp(tmp_path: Path) -> Path:
    path = tmp_path / "mlp.py"
    path.write_text(MLP)
    return path


def test_a_request_is_a_value_with_tuple_patterns() -> None:
    r = ProfileRequest(units=["model.layers.*"])  # type: ignore[arg-type]
    assert r.units == ("model.layers.*",) and hash(r) == hash(
        ProfileRequest(units=("model.layers.*",))
    )
    assert ProfileRequest().units == ()


def test_counting_refuses_meta_init_and_a_dtype_the_device_lacks() -> None:
    a100 = DeviceTarget(counted_on=get_device("a100-80gb"))
    check_counting_request(a100, ProfileRequest())
    with pytest.raises(UsageError, match="^--meta-init measures unit by unit; with --device NAME"):
        check_counting_request(a100, ProfileRequest(meta_init=True))
    v100 = DeviceTarget(counted_on=get_device("v100-32gb"))  # no bfloat16 peak
    with pytest.raises(UsageError, match="^the default --dtype bfloat16: "):
        check_counting_request(v100, ProfileRequest())
    check_counting_request(v100, ProfileRequest(dtype="float16"))
    with pytest.raises(UsageError, match="^--dtype: "):
        check_counting_request(v100, ProfileRequest(dtype="bfloat16"))


def test_a_counted_profile_of_a_model_file(mlp: Path) -> None:
    devices = DeviceTarget(counted_on=get_device("a100-80gb"))
    profile = profile_model_file(str(mlp), devices, ProfileRequest(batch_size=8, progress=False))
    assert profile.mode == "analytic" and profile.model == "mlp.py:build_model"
    assert profile.batch_size == 8 and profile.dtype == "bfloat16"
    assert sum(u.parameter_count for u in profile.units) == 8 * 16 + 16 + 16 * 4 + 4
    assert all(u.forward_s > 0 for u in profile.units if u.parameter_count)


def test_a_model_failing_on_its_inputs_is_bad_input(mlp: Path) -> None:
    devices = DeviceTarget(counted_on=get_device("a100-80gb"))
    with pytest.raises(UsageError) as info:
        profile_model_file(f"{mlp}:wrong_width", devices, ProfileRequest(progress=False))
    # counted on meta: the analytic profiler's own line, saying how to get past it
    assert str(info.value).startswith(
        "analytic mode runs the model on the meta device, and 0 failed there in forward: "
        "RuntimeError: "
    )
    assert str(info.value).endswith(
        "(profile it measured, without --device, or make that op meta-friendly)"
    )
    assert "\n" not in str(info.value)


def test_model_failed_reraises_out_of_memory(mlp: Path) -> None:
    import torch

    mf = load_model_file(str(mlp))
    err = model_failed(mf, 4, ValueError("bad shape"))
    assert (
        str(err)
        == "mlp.py:build_model: the model failed on example_inputs(4): ValueError: bad shape"
    )
    with pytest.raises(torch.OutOfMemoryError):
        model_failed(mf, 4, torch.OutOfMemoryError("out"))


def test_too_big_to_build_compares_twice_the_state_with_free_memory(
    mlp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mf = load_model_file(str(mlp))
    state = 4 * (8 * 16 + 16 + 16 * 4 + 4)  # fp32 parameters, no buffers
    monkeypatch.setattr(profiling, "available_memory_bytes", lambda device: 2 * state)
    assert not too_big_to_build(mf, "cpu")
    monkeypatch.setattr(profiling, "available_memory_bytes", lambda device: 2 * state - 1)
    assert too_big_to_build(mf, "cpu")
    monkeypatch.setattr(profiling, "available_memory_bytes", lambda device: None)
    assert not too_big_to_build(mf, "cpu")  # unknown: built for real


def test_available_memory_on_the_host_is_positive() -> None:
    free = profiling.available_memory_bytes("cpu")
    assert free is None or free > 0

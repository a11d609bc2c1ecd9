"""autopipe.core.optimizer: training-state bytes per parameter, the module's table."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopipe.core.optimizer import (
    OPTIMIZERS,
    default_optimizer,
    describe_training_state,
    normalize_optimizer,
    optimizer_state_bytes,
    optimizer_step_bytes_per_parameter,
    resolve_optimizer,
    training_state_bytes_per_parameter,
)


@pytest.mark.parametrize(
    ("optimizer", "bf16", "fp32"),
    [
        ("sgd", 4, 8),
        ("none", 4, 8),
        ("sgd-momentum", 6, 12),
        ("adam", 8, 16),
        ("adamw", 8, 16),
        ("mixed-adam", 16, 16),
        ("auto", 16, 16),
    ],
)
def test_the_table(optimizer: str, bf16: int, fp32: int) -> None:
    assert training_state_bytes_per_parameter(optimizer, 2) == bf16
    assert training_state_bytes_per_parameter(optimizer, 4) == fp32


def test_names_normalise_and_unknown_ones_name_the_choices() -> None:
    assert normalize_optimizer("SGD_Momentum") == "sgd-momentum"
    assert normalize_optimizer("AUTO") == "auto"
    with pytest.raises(ValueError) as info:
        normalize_optimizer("lion")
    assert str(info.value) == (
        "unknown optimizer 'lion'; use one of auto, adam, adamw, sgd, sgd-momentum, "
        "mixed-adam, none"
    )


def test_auto_is_mixed_adam_below_fp32() -> None:
    assert [default_optimizer(b) for b in (1, 2, 4, 8)] == ["mixed-adam"] * 2 + ["adam"] * 2
    assert resolve_optimizer("auto", 2) == "mixed-adam" and resolve_optimizer("Adam", 2) == "adam"


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.sampled_from(OPTIMIZERS), st.integers(1, 10**9), st.sampled_from([2, 4]))
def test_state_bytes_are_linear_in_the_parameters(optimizer: str, count: int, size: int) -> None:
    per = optimizer_state_bytes(optimizer, 1, size)
    assert optimizer_state_bytes(optimizer, count, count * size) == count * per


def test_auto_state_reads_the_parameter_size_from_the_bytes() -> None:
    assert optimizer_state_bytes("auto", 10, 20) == 120  # 2-byte parameters: mixed-adam
    assert optimizer_state_bytes("auto", 10, 40) == 80  # fp32: adam's two moments
    assert optimizer_state_bytes("auto", 0, 0) == 0


def test_descriptions() -> None:
    assert describe_training_state("auto", 2) == (
        "mixed-adam: 2 weight + 2 gradient + 12 fp32 master, m, v"
    )
    assert describe_training_state("auto", 4) == "adam: 4 weight + 4 gradient + 8 optimizer state"
    assert describe_training_state("sgd", 4) == "sgd: 4 weight + 4 gradient"


def test_the_optimizer_steps_bytes_counted_pass_by_pass() -> None:
    """Bytes read + written per parameter element, by hand from the code each trainer runs
    (docs/cost-model.md, "The optimizer step")."""
    step = optimizer_step_bytes_per_parameter
    # torch's foreach AdamW on fp32 (torch/optim/adam.py _multi_tensor_adam), elements moved
    # per call: mul_(p) 2, lerp_(m, g) 3, mul_(v) 2, addcmul_(v, g, g) 3, sqrt(v) 2,
    # div_ 2, add_(eps) 2, addcdiv_(p, m, denom) 4: 20 x 4 B
    assert step("adam", 4) == step("adamw", 4) == 20 * 4 == 80
    # bf16 weights without a master copy: the same passes in bf16
    assert step("adamw", 2) == 40
    # torchtitan under FSDP2: fp32 shards (mixed-adam), clip_grad_norm_: norm 1 + mul_ 2
    assert step("mixed-adam", 2, grad_clip="torch") == 80 + 3 * 4
    # Megatron: FusedAdam reads p, g, m, v and writes p, m, v (7 x 4), its grad norm reads
    # g (4), the fp32 main weights copied into the bf16 ones (4 + 2)
    megatron = step("mixed-adam", 2, kernel="fused", grad_clip="megatron", master_copy=True)
    assert megatron == 28 + 4 + 6 == 38
    # ... and bf16 gradients cast to fp32 main gradients first (2 + 4)
    cast = step("mixed-adam", 2, kernel="fused", grad_clip="megatron", master_copy=True,
                grad_cast=True)  # fmt: skip
    assert cast == 44
    # fp32 parameters have no 16-bit copy to refresh nor cast
    assert step("mixed-adam", 4, kernel="fused", master_copy=True, grad_cast=True) == 28
    # SGD (torch/optim/sgd.py _multi_tensor_sgd): add_(p, g) 3; with momentum mul_(buf) 2,
    # add_(buf, g) 3, add_(p, buf) 3
    assert step("sgd", 4) == 12 and step("sgd-momentum", 4) == 32
    assert step("sgd-momentum", 4, kernel="fused") == 20
    assert step("none", 2, grad_clip="torch") == 0
    with pytest.raises(ValueError, match="fused"):
        step("adam", 4, kernel="apex")
    with pytest.raises(ValueError, match="megatron"):
        step("adam", 4, grad_clip="always")


def test_the_request_literals_are_the_optimizer_modules_choices() -> None:
    """``PlanRequest``'s ``Literal`` types and the optimizer module's tuples (the CLI's choices)
    name the same values: request.py imports the module, so the two are written twice."""
    from typing import get_args

    from autopipe.core.optimizer import GRAD_CLIPS, OPTIMIZER_KERNELS
    from autopipe.core.request import GradClip, OptimizerKernel

    assert get_args(OptimizerKernel) == OPTIMIZER_KERNELS
    assert get_args(GradClip) == GRAD_CLIPS

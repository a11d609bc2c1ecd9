"""Training-state bytes per parameter: the one convention the profiler and the planner share.

Torch-free (the planner imports it). A trainable parameter of ``p`` bytes costs ``p``
(itself) + ``p`` (its gradient, same dtype) + its optimizer state:

| optimizer | optimizer state per parameter | total, 16-bit / fp32 parameters |
| --- | --- | --- |
| ``sgd``, ``none`` | nothing | ``2p``: 4 / 8 |
| ``sgd-momentum`` | one buffer in the parameter dtype: ``p`` | ``3p``: 6 / 12 |
| ``adam``, ``adamw`` | two moments in the parameter dtype: ``2p`` | ``4p``: 8 / 16 |
| ``mixed-adam`` | fp32 moments (8) + fp32 master copy (4) unless the parameters are fp32 already | 16 / 16 |

``auto`` (the default everywhere) is how models of that dtype are usually trained:
``mixed-adam`` for 16-bit parameters (bf16/fp16 weights with fp32 master weights and moments,
as Megatron-LM and DeepSpeed do), ``adam`` for fp32 parameters; both are 16 bytes per
parameter. An explicit ``bytes_per_parameter`` overrides the table.
"""

from __future__ import annotations

OPTIMIZERS = ("adam", "adamw", "sgd", "sgd-momentum", "mixed-adam", "none")
CLI_OPTIMIZERS = ("sgd", "sgd-momentum", "adam", "mixed-adam")
"""The choices ``--optimizer`` offers (``adamw`` and ``none`` remain API aliases)."""
AUTO = "auto"

_FP32_BYTES = 4


def normalize_optimizer(optimizer: str) -> str:
    """``"SGD_Momentum"`` -> ``"sgd-momentum"``; ``"auto"`` stays ``"auto"``; ``ValueError``
    naming the choices if unknown."""
    key = optimizer.lower().replace("_", "-")
    if key != AUTO and key not in OPTIMIZERS:
        raise ValueError(
            f"unknown optimizer {optimizer!r}; use one of {', '.join((AUTO, *OPTIMIZERS))}"
        )
    return key


def default_optimizer(parameter_size_bytes: int) -> str:
    """What ``auto`` means for parameters of ``parameter_size_bytes`` each: ``mixed-adam``
    below 4 bytes (16-bit training), else ``adam``."""
    return "mixed-adam" if parameter_size_bytes < _FP32_BYTES else "adam"


def resolve_optimizer(optimizer: str, parameter_size_bytes: int) -> str:
    """``normalize_optimizer``, with ``auto`` replaced by :func:`default_optimizer`."""
    key = normalize_optimizer(optimizer)
    return default_optimizer(parameter_size_bytes) if key == AUTO else key


def optimizer_state_bytes(optimizer: str, parameter_count: int, parameter_bytes: int) -> int:
    """Optimizer-state bytes for ``parameter_count`` trainable parameters of ``parameter_bytes``.

    See the module table. ``mixed-adam``: fp32 ``m`` and ``v`` (8 bytes per parameter) plus an
    fp32 master copy (4) where the parameters are narrower than fp32, so parameter + gradient +
    state is 16 bytes per parameter for both 16-bit and fp32 (autocast) parameters.
    """
    key = normalize_optimizer(optimizer)
    if key == AUTO:
        key = default_optimizer(parameter_bytes // parameter_count if parameter_count else 4)
    if key in ("adam", "adamw"):
        return 2 * parameter_bytes
    if key == "sgd-momentum":
        return parameter_bytes
    if key in ("sgd", "none"):
        return 0
    # mixed-adam
    fp32_bytes = _FP32_BYTES * parameter_count
    master_bytes = fp32_bytes if parameter_bytes < fp32_bytes else 0
    return 2 * _FP32_BYTES * parameter_count + master_bytes


def training_state_bytes_per_parameter(optimizer: str, parameter_size_bytes: int) -> int:
    """Parameter + gradient + optimizer-state bytes of one parameter of ``parameter_size_bytes``."""
    optimizer = resolve_optimizer(optimizer, parameter_size_bytes)
    return 2 * parameter_size_bytes + optimizer_state_bytes(optimizer, 1, parameter_size_bytes)


def describe_training_state(optimizer: str, parameter_size_bytes: int) -> str:
    """One phrase for reports: ``"mixed-adam: 2 weight + 2 gradient + 12 fp32 master, m, v"``."""
    optimizer = resolve_optimizer(optimizer, parameter_size_bytes)
    p = parameter_size_bytes
    state = optimizer_state_bytes(optimizer, 1, p)
    if optimizer == "mixed-adam" and p < _FP32_BYTES:
        parts = f"{p} weight + {p} gradient + {state} fp32 master, m, v"
    elif state:
        parts = f"{p} weight + {p} gradient + {state} optimizer state"
    else:
        parts = f"{p} weight + {p} gradient"
    return f"{optimizer}: {parts}"

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


OPTIMIZER_KERNELS = ("foreach", "fused")
"""How the optimizer step runs (``PlanRequest.optimizer_kernel``): ``foreach``, torch.optim's
``_multi_tensor_*`` path, one ``torch._foreach_*`` kernel per operation (torch's default on
CUDA, autopipe's own ``run``, torchtitan at 9dec370: ``"foreach": not fused``); ``fused``, one
kernel per step (torch's ``fused=True``, torchtitan since 6e49885, Apex / Transformer Engine /
DeepSpeed ``FusedAdam`` under Megatron)."""

GRAD_CLIPS = ("none", "torch", "megatron")
"""How the trainer clips the gradients by their global norm before the step
(``PlanRequest.grad_clip``): ``none``; ``torch``, ``torch.nn.utils.clip_grad_norm_`` with
``foreach`` (a norm pass, then a scale pass that always runs: torch clamps the coefficient at 1
rather than test it, torch/nn/utils/clip_grad.py ``_clip_grads_with_norm_``; torchtitan's
``max_norm = 1.0``); ``megatron``, Megatron's ``get_grad_norm_fp32`` (a norm pass; its scale
pass runs only when the norm is over ``--clip-grad``, ``clip_grad_by_total_norm_fp32``'s
``if clip_coeff < 1.0``, not counted)."""


def optimizer_step_bytes_per_parameter(
    optimizer: str,
    parameter_size_bytes: int,
    *,
    kernel: str = "foreach",
    grad_clip: str = "none",
    master_copy: bool = False,
    grad_cast: bool = False,
) -> float:
    """Device-memory bytes the optimizer step reads and writes per parameter element it
    updates (docs/cost-model.md, "The optimizer step", has each pass with its source line).

    The step runs over the state's elements in the state's dtype ``s``: 4 (fp32 master weight,
    gradient, ``m``, ``v``) for ``mixed-adam``, else the parameters' ``parameter_size_bytes``.
    Every Adam variant is AdamW with a non-zero weight decay (autopipe's ``run``: torch's
    ``AdamW`` default ``weight_decay=1e-2``; torchtitan: 0.1; Megatron: ``--weight-decay``).

    - ``foreach`` AdamW (torch/optim/adam.py ``_multi_tensor_adam``, one pass per call):
      ``_foreach_mul_(params)`` 2s, ``_foreach_lerp_(m, g)`` 3s, ``_foreach_mul_(v)`` 2s,
      ``_foreach_addcmul_(v, g, g)`` 3s (the second ``g`` is the same address, loaded from
      cache), ``_foreach_sqrt(v)`` 2s, ``_foreach_div_`` 2s, ``_foreach_add_`` 2s,
      ``_foreach_addcdiv_(params, m, denom)`` 4s: 20s, 80 bytes in fp32;
      ``fused``: reads ``p, g, m, v`` and writes ``p, m, v`` once, 7s.
    - ``sgd``: ``_foreach_add_(params, g)`` 3s; ``sgd-momentum``: ``_foreach_mul_(bufs)`` 2s,
      ``_foreach_add_(bufs, g)`` 3s, ``_foreach_add_(params, bufs)`` 3s (torch/optim/sgd.py
      ``_multi_tensor_sgd``); fused: 3s / 5s. ``none``: 0.
    - ``grad_clip``: ``torch`` 3s (norm, scale), ``megatron`` s (norm).
    - ``master_copy``: the updated fp32 master weights copied into the 16-bit model weights
      (read 4, write ``p``: Megatron's ``_copy_main_params_to_model_params``; not under FSDP2,
      whose sharded parameters are the fp32 ones, cast by its all-gather).
    - ``grad_cast``: the 16-bit gradients cast to fp32 main gradients first (read ``p``,
      write 4: Megatron's ``main_param.grad = model_param.grad.float()`` without an fp32
      gradient buffer).
    """
    if kernel not in OPTIMIZER_KERNELS:
        raise ValueError(f"optimizer kernel {kernel!r}; use one of {', '.join(OPTIMIZER_KERNELS)}")
    if grad_clip not in GRAD_CLIPS:
        raise ValueError(f"grad_clip {grad_clip!r}; use one of {', '.join(GRAD_CLIPS)}")
    key = resolve_optimizer(optimizer, parameter_size_bytes)
    if key == "none":
        return 0.0
    p = float(parameter_size_bytes)
    mixed = key == "mixed-adam" and parameter_size_bytes < _FP32_BYTES
    s = float(_FP32_BYTES) if key == "mixed-adam" else p
    fused = kernel == "fused"
    if key == "sgd":
        passes = 3
    elif key == "sgd-momentum":
        passes = 5 if fused else 8
    else:
        passes = 7 if fused else 20
    clip = {"none": 0, "torch": 3, "megatron": 1}[grad_clip]
    total = (passes + clip) * s
    if mixed and master_copy:
        total += _FP32_BYTES + p
    if mixed and grad_cast:
        total += p + _FP32_BYTES
    return total

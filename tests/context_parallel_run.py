"""torchrun entry point of the context-parallel cases (tests/test_context_parallel.py): the
mesh zoo's runner (``tests/mesh_zoo_run.py``: plan on rank 0 with autopipe's own API, train
3 steps on every rank with ``DistributedPipeline``, compare every parameter's update over lr
with one process training the plain model, rtol 1e-4 / atol 1e-5) on the meshes below.

Family ``llama`` carries ``labels`` (the model's own causal-LM loss is the objective: the
labels are shifted before the sequence is split); ``llama_ids`` only token ids (the
default objective, the mean squares of the output). SGD and AdamW. The one-process
reference's loss is the causal-LM cross-entropy in the model's own dtype
(:func:`causal_lm_loss_in_dtype`): Hugging Face's ``ForCausalLMLoss`` computes it in float32
(``logits.float()``) even for this float64 model, rounding the logits by ~6e-8, while the
context-parallel run's :func:`~autopipe.runtime.distributed.context_parallel.shifted_token_loss`
keeps float64; AdamW's first step moves every weight by about lr x sign(gradient), so on
weights whose gradient is at that rounding's size the two differed by ~3.4e-4 of lr (measured),
above atol, where SGD's differences stay below 1e-5.

    torchrun --nproc-per-node 4 tests/context_parallel_run.py OUT_DIR FAMILY:MESH [...]

Not a test module (no ``test_`` prefix).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mesh_zoo_models  # noqa: E402
import mesh_zoo_run  # noqa: E402

MESHES: dict[str, dict[str, Any]] = {
    "pp2cp2": {"context_parallel": 2, "data_parallel": 1, "tensor_parallel": 1, "schedule": "1f1b"},
    "cp2d2": {"context_parallel": 2, "data_parallel": 2, "tensor_parallel": 1, "schedule": "1f1b"},
    "cp2tp2": {"context_parallel": 2, "data_parallel": 1, "tensor_parallel": 2, "schedule": "1f1b"},
    "cp2d2zero1": {
        "context_parallel": 2,
        "data_parallel": 2,
        "tensor_parallel": 1,
        "shard": "optimizer",
        "schedule": "1f1b",
    },
    "cp2fsdp2": {
        "context_parallel": 2,
        "data_parallel": 2,
        "tensor_parallel": 1,
        "shard": "parameters",
        "schedule": "1f1b",
    },
    "pp2cp2ep2": {
        "context_parallel": 2,
        "data_parallel": 1,
        "tensor_parallel": 1,
        "expert_parallel": 2,
        "schedule": "1f1b",
    },
    "cp2tp2ep2": {
        "context_parallel": 2,
        "data_parallel": 1,
        "tensor_parallel": 2,
        "expert_parallel": 2,
        "schedule": "1f1b",
    },
    "cp2d2ep2zero1": {
        "context_parallel": 2,
        "data_parallel": 2,
        "tensor_parallel": 1,
        "expert_parallel": 2,
        "shard": "optimizer",
        "schedule": "1f1b",
    },
}
"""Mesh name -> the PlanRequest fields that ask the planner for it (4 devices). The EP group
is carved out of the dp x cp ranks (torchtitan's way): at PP 2 x CP 2 it is each stage's CP
pair; at CP 2 x D 2 each CP pair again, the two pairs holding the same experts; at CP 2 x
TP 2 x EP 2 (the fewest ranks that run all three) each TP rank's CP pair, every expert's FFN
split over the TP pair (an ``(ep, tp)`` mesh)."""

_ids = mesh_zoo_models.example_inputs
_build = mesh_zoo_models.build


def causal_lm_loss_in_dtype(
    logits: Any,
    labels: Any,
    vocab_size: int,
    num_items_in_batch: Any = None,
    ignore_index: int = -100,
    shift_labels: Any = None,
    **kwargs: Any,
) -> Any:
    """Hugging Face's causal-LM loss (labels shifted left, the mean cross-entropy over the
    labels that are not ``ignore_index``) in the logits' own dtype, not float32."""
    import torch

    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    total = torch.nn.functional.cross_entropy(
        logits.reshape(-1, vocab_size),
        shift_labels.reshape(-1).to(logits.device),
        ignore_index=ignore_index,
        reduction="sum",
    )
    count = (
        num_items_in_batch
        if num_items_in_batch is not None
        else (shift_labels != ignore_index).sum()
    )
    return total / count


def build(family: str, dtype: str = "float32") -> Any:
    """The zoo's model computing in its own dtype throughout: the causal-LM loss
    (:func:`causal_lm_loss_in_dtype`) and the RMS norms (torch's ``nn.RMSNorm``, the same
    formula, in place of Hugging Face's, which compute in float32)."""
    import torch

    model = _build(family, dtype)
    model.loss_function = causal_lm_loss_in_dtype
    for path, module in list(model.named_modules()):
        # Llama's, Mixtral's, Qwen3-MoE's: the same float32 formula (Qwen3-MoE's rounding
        # to float32 moved AdamW's expert updates of qwen3_moe:cp2tp2ep2 by 3.5e-4 of lr
        # against one process, measured; in float64 they agree to 2.3e-7)
        names = ("LlamaRMSNorm", "MixtralRMSNorm", "Qwen3MoeRMSNorm")
        if type(module).__name__ in names:
            norm = torch.nn.RMSNorm(module.weight.shape, eps=module.variance_epsilon)
            norm = norm.to(module.weight.dtype)
            with torch.no_grad():
                norm.weight.copy_(module.weight)
            model.set_submodule(path, norm)
    return model


def example_inputs(family: str, batch_size: int) -> dict[str, Any]:
    """The zoo's token ids, with themselves as ``labels`` (the model shifts them) except for
    ``llama_ids``."""
    inputs = _ids(family, batch_size)
    if family == "llama_ids":
        return inputs
    return {**inputs, "labels": inputs["input_ids"].clone()}


if __name__ == "__main__":
    mesh_zoo_run.MESHES.update(MESHES)
    mesh_zoo_models.FAMILIES["llama_ids"] = mesh_zoo_models.FAMILIES["llama"]
    mesh_zoo_models.example_inputs = example_inputs  # the runner looks it up when it runs
    mesh_zoo_models.build = build
    mesh_zoo_run.main(sys.argv[1], sys.argv[2:])
    from autopipe.runtime.distributed import exit_process

    exit_process(0)  # Python's teardown can abort a rank after a clean run

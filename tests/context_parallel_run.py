"""torchrun entry point of the context-parallel cases (tests/test_context_parallel.py): the
mesh zoo's runner (``tests/mesh_zoo_run.py``: plan on rank 0 with autopipe's own API, train
3 steps on every rank with ``DistributedPipeline``, compare every parameter's update over lr
with one process training the plain model, rtol 1e-4 / atol 1e-5) on the meshes below.

Family ``llama`` carries ``labels`` (the model's own causal-LM loss is the objective: the
labels are shifted before the sequence is split); ``llama_ids`` only token ids (the
default objective, the mean squares of the output). SGD only: Hugging Face's causal-LM loss
computes its cross-entropy in float32 (``logits.float()``) even for this float64 model, and
AdamW's per-element normalisation turns that rounding into update differences of ~3e-4 of
lr on a few weights (measured), above atol; SGD keeps them below 1e-5.

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
}
"""Mesh name -> the PlanRequest fields that ask the planner for it (4 devices)."""

_ids = mesh_zoo_models.example_inputs


def example_inputs(family: str, batch_size: int) -> dict[str, Any]:
    """The zoo's token ids, with themselves as ``labels`` (the model shifts them) except for
    ``llama_ids``."""
    inputs = _ids(family, batch_size)
    if family == "llama_ids":
        return inputs
    return {**inputs, "labels": inputs["input_ids"].clone()}


if __name__ == "__main__":
    mesh_zoo_run.MESHES.update(MESHES)
    mesh_zoo_run.OPTIMIZERS = ("sgd",)
    mesh_zoo_models.FAMILIES["llama_ids"] = mesh_zoo_models.FAMILIES["llama"]
    mesh_zoo_models.example_inputs = example_inputs  # the runner looks it up when it runs
    mesh_zoo_run.main(sys.argv[1], sys.argv[2:])

"""The example-inputs convention (autopipe.profiler.inputs): what a model is called with,
its batch, rows cut from it, outputs the pipelines can join, and binding calls to a trace."""

from __future__ import annotations

import pytest
import torch
from autopipe.profiler.inputs import (
    InputBinder,
    OutputError,
    batch_rows,
    batch_size_of,
    call_model,
    check_joinable_output,
    split_inputs,
)
from torch import nn


def test_the_three_input_forms() -> None:
    x = torch.ones(2)
    assert split_inputs((x, 3)) == ((x, 3), {})
    assert split_inputs({"a": x}) == ((), {"a": x})
    assert split_inputs(x) == ((x,), {})
    assert call_model(lambda a, b=0: a * 2 + b, {"a": x, "b": 1}).tolist() == [3.0, 3.0]


def test_batch_size_and_rows_keep_shared_tensors_whole() -> None:
    inputs = {"ids": torch.arange(12).reshape(6, 2), "mask": torch.ones(2, 2), "n": 3}
    assert batch_size_of(inputs) == 6
    rows = batch_rows(inputs, 2, 4)
    assert rows["ids"].tolist() == [[4, 5], [6, 7]] and rows["n"] == 3
    assert rows["mask"] is inputs["mask"]  # (T, T) mask: not a batch tensor
    storage = inputs["ids"].untyped_storage().data_ptr()
    assert rows["ids"].untyped_storage().data_ptr() == storage  # a view...
    copied = batch_rows(inputs, 2, 4, copy=True)
    assert copied["ids"].untyped_storage().data_ptr() != storage  # ...or its own rows only
    assert copied["ids"].untyped_storage().nbytes() == 4 * 8
    with pytest.raises(TypeError, match="no tensor with a batch dimension"):
        batch_size_of({"t": torch.tensor(1.0), "n": 3})


def test_outputs_that_cannot_be_joined_are_refused() -> None:
    check_joinable_output({"logits": torch.ones(4, 3), "loss": torch.tensor(0.5)}, 4)
    with pytest.raises(OutputError, match=r"output \['counts'\] has shape \(3,\)"):
        check_joinable_output({"logits": torch.ones(4, 3), "counts": torch.ones(3)}, 4)
    with pytest.raises(
        OutputError, match=r"has shape \(\) \(torch.int64\), without the batch \(4\)"
    ):
        check_joinable_output(torch.tensor(3), 4)  # a 0-dim integer is no loss


class TwoInputs(nn.Module):
    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0
    ) -> torch.Tensor:
        return x * scale if mask is None else x * mask * scale


def test_a_call_binds_by_name_whatever_its_form() -> None:
    x, mask = torch.ones(2), torch.zeros(2)
    placeholders = torch.fx.symbolic_trace(TwoInputs()).graph.nodes
    binder = InputBinder.for_trace(
        TwoInputs(), (x, mask), [n for n in placeholders if n.op == "placeholder"]
    )
    assert binder.traced_positional == ["x", "mask"] and binder.traced_keywords == []
    assert binder.placeholder_names == ["x", "mask", "scale"]
    assert binder((x,), {"mask": mask}) == [x, mask, 1.0]
    assert binder((), {"scale": 2.0, "x": x, "mask": mask}) == [x, mask, 2.0]
    with pytest.raises(TypeError, match="'x' is given both positionally and by keyword"):
        binder((x,), {"x": x})
    with pytest.raises(TypeError, match="has no argument 'y' \\(it takes x, mask, scale\\)"):
        binder((x,), {"y": x})
    with pytest.raises(TypeError, match="got 4 positional inputs but the model's forward takes 3"):
        binder((x, x, x, x), {})

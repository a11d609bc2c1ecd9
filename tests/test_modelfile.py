"""autopipe/modelfile.py: loading MODEL.py[:FACTORY], its roles and its one-line errors."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from autopipe.core.errors import UsageError
from autopipe.modelfile import ModelFileError, factory_candidates, load_model_file

MODEL = """
from dataclasses import dataclass

import torch
from helper import WIDTH


def build_model():
    return torch.nn.Linear(WIDTH, 2)


def small(scale=1):
    return torch.nn.Linear(WIDTH, 1)


def needs_args(width):
    return torch.nn.Linear(width, 1)


def _private():
    return None


def not_a_module():
    return 42


def example_inputs(batch_size=6):
    return torch.randn(batch_size, WIDTH)


def example_inputs_small(batch_size=3):
    return torch.randn(batch_size, WIDTH)


def example_inputs_wrong(batch_size=4):
    return torch.randn(8, WIDTH)


def loss_fn(output, inputs):
    return output.sum()


def tp_plan():
    return {"*": "colwise"}
"""


@pytest.fixture
def model_py(tmp_path: Path) -> Path:
    (tmp_path / "helper.py").write_text("WIDTH = 5\n")  # a sibling the model file imports
    path = tmp_path / "net.py"
    path.write_text(MODEL)
    return path


def test_a_model_file_with_its_roles(model_py: Path) -> None:
    mf = load_model_file(str(model_py))
    assert mf.factory_name == "build_model" and mf.label == "net.py:build_model"
    assert mf.default_batch_size() == 6 and mf.loss_fn is not None
    assert mf.tp_plan is not None and mf.tp_plan() == {"*": "colwise"}
    model = mf.build()
    assert model.in_features == 5 and model.out_features == 2
    assert tuple(mf.inputs(4).shape) == (4, 5) and tuple(mf.inputs(None).shape) == (6, 5)
    assert str(model_py.parent) not in sys.path  # the folder was on the path only to import
    assert next(mf.build("meta").parameters()).is_meta


def test_a_named_factory_takes_its_own_example_inputs(model_py: Path) -> None:
    mf = load_model_file(f"{model_py}:small")
    assert mf.label == "net.py:small" and mf.example_inputs.__name__ == "example_inputs_small"
    assert mf.default_batch_size() == 3


def test_factory_candidates_are_the_files_own_no_argument_functions(model_py: Path) -> None:
    mf = load_model_file(str(model_py))
    # not dataclass or torch (imported), _private, needs_args, nor the other roles
    assert factory_candidates(mf.module) == ["build_model", "not_a_module", "small"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("{dir}/missing.py", "model file not found: {dir}/missing.py (give a path to a .py file)"),
        ("{dir}/helper.txt", "{dir}/helper.txt: expected a Python file (MODEL.py[:FACTORY])"),
        (
            "{dir}/net.py:gpt",
            "net.py has no factory function 'gpt'; define it or name one with net.py:FACTORY "
            "(factories in net.py: build_model, not_a_module, small)",
        ),
        (
            "{dir}/helper.py",
            "helper.py has no factory function 'build_model'; define it or name one with "
            "helper.py:FACTORY (factories in helper.py: none)",
        ),
    ],
)
def test_unusable_specs_are_one_line(model_py: Path, spec: str, message: str) -> None:
    (model_py.parent / "helper.txt").write_text("")
    d = str(model_py.parent)
    with pytest.raises(ModelFileError) as info:
        load_model_file(spec.format(dir=d))
    assert str(info.value) == message.format(dir=d)
    assert isinstance(info.value, UsageError)


def test_what_the_users_functions_do_wrong_is_one_line(model_py: Path, tmp_path: Path) -> None:
    with pytest.raises(
        ModelFileError,
        match=r"^net.py:not_a_module: the factory returned int, not a torch.nn.Module$",
    ):
        load_model_file(f"{model_py}:not_a_module").build()
    mf = load_model_file(str(model_py))
    wrong = dataclasses.replace(mf, example_inputs=mf.module.example_inputs_wrong)
    with pytest.raises(
        ModelFileError, match=r"returned a batch of 8 \(dim 0\), not 4; make example_inputs"
    ):
        wrong.inputs(4)
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_here\n")
    with pytest.raises(
        ModelFileError, match=r"^importing .*broken.py failed: ModuleNotFoundError: "
    ):
        load_model_file(str(broken))
    assert not any(
        "autopipe_user_model" in m and "broken" in str(getattr(sys.modules[m], "__file__", ""))
        for m in sys.modules
    )
    no_inputs = tmp_path / "bare.py"
    no_inputs.write_text("def build_model():\n    return None\n")
    with pytest.raises(
        ModelFileError, match=r"^bare.py has no example_inputs\(batch_size\) function"
    ):
        load_model_file(str(no_inputs))

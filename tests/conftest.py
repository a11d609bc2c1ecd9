"""Fixtures tests share: one small hand-made profile and the two real plans made from it
(``tests/viz_plans.py`` builds them; the plot and report tests), module-scoped: planning is
the costly part, and no test changes them; and a small MLP model file (``mlp_file``: the
CLI's profile and compile tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
from viz_plans import _profile, gpipe_plan_of, onefoneb_plan_of

from autopipe.core.plan import Plan
from autopipe.core.profile import Profile

MLP_MODEL_FILE = """
import torch


def build_model():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def example_inputs(batch_size=8):
    return torch.randn(batch_size, 8)
"""
"""A model file the CLI tests profile and plan: a two-layer MLP, batch 8 by default."""


@pytest.fixture
def mlp_file(tmp_path: Path) -> Path:
    """:data:`MLP_MODEL_FILE` written to ``tmp_path / "mlp.py"``."""
    path = tmp_path / "mlp.py"
    path.write_text(MLP_MODEL_FILE)
    return path


@pytest.fixture(scope="module")
def profile() -> Profile:
    """12 uneven units, a heavy last one (like an LM head), batch 32."""
    return _profile()


@pytest.fixture(scope="module")
def gpipe_plan(profile: Profile) -> Plan:
    """K = 4, GPipe, M chosen, 1 GiB per device."""
    return gpipe_plan_of(profile)


@pytest.fixture(scope="module")
def onefoneb_plan(profile: Profile) -> Plan:
    """K = 4, 1F1B, M = 8, finite links and every stage re-materialized."""
    return onefoneb_plan_of(profile)


_LAUNCHES = ("torch.distributed.run", "free_port(")
"""What a test module that starts torchrun launches (directly or through a helper's port)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that start torchrun share one xdist worker (``make test`` runs ``--dist
    loadgroup``): two launches of 4 gloo ranks at once put 8 processes on a 2-core machine,
    and their collective timeouts then fire under load, not on a bug."""
    launching: dict[str, bool] = {}
    for item in items:
        path = str(item.path)
        if path not in launching:
            text = item.path.read_text() if item.path.suffix == ".py" else ""
            launching[path] = any(s in text for s in _LAUNCHES)
        if launching[path]:
            item.add_marker(pytest.mark.xdist_group("torchrun"))

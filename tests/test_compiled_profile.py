"""``MeasureOptions(compile=True)``: the measured profiler times each unit ``torch.compile``'d,
as a trainer that compiles its stages runs it (autopipe/profiler/measure.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from autopipe.profiler.measure import profile
from autopipe.profiler.options import MeasureOptions
from torch import nn

from autopipe.core.profile import Profile

BATCH, WIDTH = 8, 16
ONE_ACTIVATION_BYTES = BATCH * WIDTH * 4  # one (B, WIDTH) float32 tensor


class Elementwise(nn.Module):
    """x*2+1 -> gelu -> *3 -> gelu: eager autograd saves both gelu inputs; a compiled unit
    (AOT autograd's min-cut partition, inductor's too) saves x alone and recomputes the
    element-wise chain in backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(F.gelu(x * 2 + 1) * 3)


class Chain(nn.Module):
    """Units ``inp``, ``blocks.0`` .. ``blocks.2`` (one computation) and ``out``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Elementwise() for _ in range(3))
        self.out = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Chain(), torch.randn(BATCH, WIDTH)


class Compiles:
    """``torch.compile`` calls counted (``calls``), and the graphs dynamo compiled
    (``graphs()``, dynamo's own count)."""

    def __init__(self) -> None:
        self.calls = 0

    def graphs(self) -> int:
        return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch) -> Iterator[Compiles]:
    """``torch.compile`` counted, its backend AOT autograd with decompositions and the
    min-cut partition (what inductor partitions with, without its seconds of C++ compile
    per graph). The backend is passed by its registered name's function: a wrapper of ours
    would keep references to the parameters that the meta-init path must swap."""
    counts = Compiles()
    real = torch.compile
    partition = torch._dynamo.lookup_backend("aot_eager_decomp_partition")

    def counting_compile(model: Any, **kwargs: Any) -> Callable[..., Any]:
        counts.calls += 1
        return real(model, **{**kwargs, "backend": partition})

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    monkeypatch.setattr(torch, "compile", counting_compile)
    yield counts
    torch._dynamo.reset()


OPTIONS = MeasureOptions(warmup=1, repeat=2, microbatch_sizes=(), share=True)


def test_each_distinct_unit_runs_compiled_once(compiles: Compiles) -> None:
    model, x = _model()
    p = profile(model, x, MeasureOptions(**{**OPTIONS.__dict__, "compile": True}), progress=False)
    assert p.unit_names == ["inp", "blocks.0", "blocks.1", "blocks.2", "out"]
    # inp, blocks.0 (blocks.1 and .2 share its measurement) and out: three compiles, one
    # forward graph each (the backward graphs are AOT autograd's, not dynamo's), no
    # recompile in the timed runs on the detached inputs.
    assert [u.measured_as for u in p.units] == ["", "", "blocks.0", "blocks.0", ""]
    assert (compiles.calls, compiles.graphs()) == (3, 3)
    assert p.measurement is not None and p.measurement.compile
    assert all(u.backward_input_s == 0 and u.backward_weight_s == 0 for u in p.units)
    assert all(u.forward_s > 0 and u.backward_s > 0 for u in p.units)
    # Saved bytes are the compiled unit's: the block's input, not its two gelu inputs.
    assert [u.activation_bytes for u in p.units[1:4]] == [ONE_ACTIVATION_BYTES] * 3
    assert Profile.from_dict(p.to_dict()).measurement.compile  # type: ignore[union-attr]


def test_eager_saves_what_autograd_saves(compiles: Compiles) -> None:
    model, x = _model()
    p = profile(model, x, OPTIONS, progress=False)
    assert (compiles.calls, compiles.graphs()) == (0, 0)
    assert p.measurement is not None and not p.measurement.compile
    assert [u.activation_bytes for u in p.units[1:4]] == [2 * ONE_ACTIVATION_BYTES] * 3
    # The split backward is timed eagerly (B of the element-wise blocks, W of the linears).
    assert p.units[1].backward_input_s > 0 and p.units[0].backward_weight_s > 0


def test_the_reference_is_compiled_too(compiles: Compiles) -> None:
    """The whole model timed in one piece (what ``scale_to_reference`` scales the units to)
    runs compiled as its units do. Compiled whole, it fuses across the units' boundaries:
    it saves the inputs of the two linears and of the first block only (the blocks' chain
    is recomputed from it in backward), where the units compiled apart save each block's
    input too; the loss, outside the compiled model, saves its (B, 4) output either way."""
    model, x = _model()
    options = MeasureOptions(**{**OPTIONS.__dict__, "compile": True, "reference": True})
    p = profile(model, x, options, progress=False)
    assert compiles.calls == 4
    assert p.total_forward_s > 0
    loss_bytes = BATCH * 4 * 4
    assert sum(u.activation_bytes for u in p.units) == 5 * ONE_ACTIVATION_BYTES + loss_bytes
    assert p.total_activation_bytes == 3 * ONE_ACTIVATION_BYTES + loss_bytes


def test_compiled_and_eager_profiles_have_their_own_cache_entries(
    compiles: Compiles, tmp_path: Any
) -> None:
    model, x = _model()
    keys = []
    for compiled in (False, True):
        options = MeasureOptions(**{**OPTIONS.__dict__, "compile": compiled})
        keys.append(options.key())
        profile(model, x, options, progress=False, cache=True, cache_dir=tmp_path)
    assert keys[0] != keys[1] and keys[1]["compile"] is True
    assert len(list(tmp_path.glob("*.json"))) == 2
    cached = profile(model, x, options, progress=False, cache=True, cache_dir=tmp_path)
    assert cached.measurement is not None and cached.measurement.compile
    assert compiles.calls == 3  # the cached compiled profile was read, not measured again


def test_compile_needs_a_warmup_run() -> None:
    with pytest.raises(ValueError, match="compile=True needs warmup >= 1"):
        MeasureOptions(compile=True, warmup=0)


def test_a_model_on_meta_is_timed_compiled_one_unit_at_a_time(compiles: Compiles) -> None:
    """From meta (each unit's weights materialized only while it is timed) the compiled
    module of each measured unit is timed at once and dropped with its weights."""
    with torch.device("meta"):
        model = Chain()
    x = torch.randn(BATCH, WIDTH)
    p = profile(model, x, MeasureOptions(**{**OPTIONS.__dict__, "compile": True}), progress=False)
    assert p.measurement is not None and p.measurement.meta_init and p.measurement.compile
    assert (compiles.calls, compiles.graphs()) == (3, 3)
    assert [u.activation_bytes for u in p.units[1:4]] == [ONE_ACTIVATION_BYTES] * 3
    assert all(u.forward_s > 0 and u.backward_s > 0 for u in p.units)

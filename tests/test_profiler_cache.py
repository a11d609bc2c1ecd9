"""Profile cache: reuse, invalidation by key, and recovery from bad files."""

from __future__ import annotations

import dataclasses
import json

import autopipe.profiler.measure as measure
import pytest
import torch
from autopipe.profiler.cache import cache_key, default_cache_dir, load_cached
from autopipe.profiler.measure import profile
from autopipe.profiler.options import MeasureOptions
from torch import nn

from autopipe.core.profile import Profile

FAST = MeasureOptions(warmup=0, repeat=1, microbatch_sizes=())


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def forbid_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("measured although a cached profile should have been used")

    monkeypatch.setattr(measure, "_prepare_size", fail)


def test_cache_reuses_same_problem(tmp_path, monkeypatch) -> None:
    m, x = model(), torch.randn(8, 16)
    first = profile(m, x, FAST, cache=True, cache_dir=tmp_path, progress=False)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and Profile.load(files[0]) == first
    forbid_measuring(monkeypatch)
    # Same structure and shapes, other weights and other input values: reused.
    again = profile(
        model(), torch.randn(8, 16), FAST, cache=True, cache_dir=tmp_path, progress=False
    )
    assert again == first


def test_cache_key_changes_with_what_matters() -> None:
    m, x = model(), torch.randn(8, 16)
    base = cache_key(m, x, device="cpu", granularity="block")
    assert cache_key(model(), torch.randn(8, 16), device="cpu", granularity="block") == base
    assert cache_key(m, torch.randn(4, 16), device="cpu", granularity="block") != base
    assert cache_key(m, x.double(), device="cpu", granularity="block") != base
    assert cache_key(m, x, device="cpu", granularity="node") != base
    assert cache_key(m, x, device="cuda", granularity="block") != base
    wider = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    assert cache_key(wider, x, device="cpu", granularity="block") != base


def test_a_new_profile_field_is_a_new_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """A profile cached before the profiler recorded a field (linear_forward_flops, between
    two releases) holds that field's default, 0, which would pass for a measurement: the
    key holds UnitProfile's field names, so such a file is not found. Failed before (the
    same key)."""
    import autopipe.profiler.cache as cache

    m, x = model(), torch.randn(8, 16)
    base = cache_key(m, x, device="cpu", granularity="block")
    assert "linear_forward_flops" in cache.unit_fields()
    older = [f for f in cache.unit_fields() if f != "linear_forward_flops"]
    monkeypatch.setattr(cache, "unit_fields", lambda: older)
    assert cache_key(m, x, device="cpu", granularity="block") != base


def test_other_shapes_are_measured_not_reused(tmp_path) -> None:
    m = model()
    profile(m, torch.randn(8, 16), FAST, cache=True, cache_dir=tmp_path, progress=False)
    p = profile(m, torch.randn(4, 16), FAST, cache=True, cache_dir=tmp_path, progress=False)
    assert p.batch_size == 4 and len(list(tmp_path.glob("*.json"))) == 2


def test_more_repeats_are_measured_not_reused(tmp_path) -> None:
    m, x = model(), torch.randn(8, 16)
    profile(m, x, FAST, cache=True, cache_dir=tmp_path, progress=False)
    p = profile(
        m, x, dataclasses.replace(FAST, repeat=2), cache=True, cache_dir=tmp_path, progress=False
    )
    assert (
        p.measurement is not None
        and p.measurement.repeat == 2
        and len(list(tmp_path.glob("*.json"))) == 2
    )


@pytest.mark.parametrize(
    "damage",
    [
        lambda path: path.write_text("{ not json"),
        lambda path: path.write_text(json.dumps({**json.loads(path.read_text()), "version": 0})),
        lambda path: path.write_text(
            json.dumps({**json.loads(path.read_text()), "autopipe_version": "0.0.1"})
        ),
        lambda path: path.write_text(json.dumps({"units": "nonsense", "version": 1})),
        lambda path: path.write_bytes(b"\xff\xfe\x00garbage"),
    ],
    ids=["corrupt-json", "old-schema", "old-autopipe", "malformed", "binary"],
)
def test_bad_cache_file_warns_and_remeasures(tmp_path, damage) -> None:
    m, x = model(), torch.randn(8, 16)
    good = profile(m, x, FAST, cache=True, cache_dir=tmp_path, progress=False)
    (path,) = tmp_path.glob("*.json")
    damage(path)
    with pytest.warns(UserWarning, match="re-measuring"):
        again = profile(m, x, FAST, cache=True, cache_dir=tmp_path, progress=False)
    assert again.unit_names == good.unit_names
    assert Profile.load(path) == again  # the bad file was replaced by the new measurement


def test_default_cache_dir_from_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("AUTOPIPE_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    m, x = model(), torch.randn(8, 16)
    profile(m, x, FAST, cache=True, progress=False)
    assert len(list((tmp_path / "c").glob("*.json"))) == 1
    monkeypatch.delenv("AUTOPIPE_CACHE_DIR")
    assert default_cache_dir().parts[-2:] == (".cache", "autopipe")


def test_cache_off_by_default(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("AUTOPIPE_CACHE_DIR", str(tmp_path))
    profile(model(), torch.randn(8, 16), FAST, progress=False)
    assert not list(tmp_path.glob("*.json"))
    assert load_cached("0" * 64, tmp_path) is None


def test_measure_options_are_the_cache_key(tmp_path, monkeypatch) -> None:
    """The same MeasureOptions (or equal ones, or options that resolve to the same values:
    ``device=None`` is where the model is) find one entry; any option that changes the
    measurement is another entry."""
    m, x = model(), torch.randn(8, 16)
    options = MeasureOptions(warmup=0, repeat=1, microbatch_sizes=())
    first = profile(m, x, options, cache=True, cache_dir=tmp_path, progress=False)
    forbid_measuring(monkeypatch)
    assert profile(m, x, FAST_OPTIONS, cache=True, cache_dir=tmp_path, progress=False) == first
    assert (
        profile(
            m,
            x,
            dataclasses.replace(options, device="cpu"),
            cache=True,
            cache_dir=tmp_path,
            progress=False,
        )
        == first
    )
    monkeypatch.undo()
    again = dataclasses.replace(options, repeat=2)
    profile(m, x, again, cache=True, cache_dir=tmp_path, progress=False)
    node = dataclasses.replace(options, granularity="node")
    profile(m, x, node, cache=True, cache_dir=tmp_path, progress=False)
    assert len(list(tmp_path.glob("*.json"))) == 3
    with pytest.raises(TypeError, match="unexpected keyword argument 'repeats'"):
        profile(m, x, options, repeats=2)


FAST_OPTIONS = MeasureOptions(warmup=0, repeat=1, microbatch_sizes=())


MODEL_FILE = """\
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def build_model():
    torch.manual_seed(0)
    return Net()


def example_inputs(batch_size=8):
    return torch.randn(batch_size, 16)
"""


def test_editing_forward_measures_again(tmp_path, monkeypatch) -> None:
    """Before, the key held the module tree and parameter shapes only: a new forward (same
    modules) got the old forward's profile back."""
    from autopipe.modelfile import load_model_file

    path = tmp_path / "net.py"
    path.write_text(MODEL_FILE)
    mf = load_model_file(str(path))
    first = profile(
        mf.build(), mf.inputs(8), FAST, cache=True, cache_dir=tmp_path / "c", progress=False
    )
    path.write_text(MODEL_FILE.replace("torch.relu(self.a(x))", "torch.tanh(self.a(x)) * 2"))
    mf = load_model_file(str(path))
    measured = []
    original = measure._prepare_size

    def count(*args, **kwargs):
        measured.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(measure, "_prepare_size", count)
    second = profile(
        mf.build(), mf.inputs(8), FAST, cache=True, cache_dir=tmp_path / "c", progress=False
    )
    assert measured, "the edited model got the cached profile of the old forward"
    assert len(list((tmp_path / "c").glob("*.json"))) == 2
    assert [u.name for u in second.units] == [u.name for u in first.units]


def test_the_key_follows_forward_code_without_a_file() -> None:
    def net(body: str) -> nn.Module:
        scope: dict = {"nn": nn, "torch": torch}
        exec(
            "class Net(nn.Module):\n"
            "    def __init__(self):\n        super().__init__()\n        self.a = nn.Linear(4, 4)\n"
            f"    def forward(self, x):\n        return {body}\n",
            scope,
        )
        return scope["Net"]()

    x = torch.randn(2, 4)
    assert cache_key(net("self.a(x)"), x) == cache_key(net("self.a(x)"), x)
    assert cache_key(net("self.a(x)"), x) != cache_key(net("self.a(x) * 2"), x)


def test_a_cached_profile_is_said(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    """Before, a cached profile came back in silence, even with -v: a user could not tell
    that nothing was measured, nor where the file was."""
    m, x = model(), torch.randn(8, 16)
    with caplog.at_level("INFO", logger="autopipe"):
        profile(m, x, FAST, cache=True, cache_dir=tmp_path, progress=False)
        assert "from cache" not in caplog.text  # measured, then written
        (path,) = tmp_path.glob("*.json")
        profile(m, x, FAST, cache=True, cache_dir=tmp_path, progress=False)
    assert f"profile read from cache ({path}); --no-cache re-measures" in caplog.text


def test_the_cli_says_the_cache_was_used(
    tmp_path, monkeypatch, caplog: pytest.LogCaptureFixture
) -> None:
    from autopipe.cli import main

    monkeypatch.setenv("AUTOPIPE_CACHE_DIR", str(tmp_path / "c"))
    path = tmp_path / "net.py"
    path.write_text(MODEL_FILE)
    with caplog.at_level("INFO", logger="autopipe"):
        assert main(["profile", str(path), "-q"]) == 0
        assert "from cache" not in caplog.text
        assert main(["profile", str(path)]) == 0
        assert "profile read from cache (" in caplog.text
        caplog.clear()
        assert main(["profile", str(path), "--no-cache"]) == 0
    assert "from cache" not in caplog.text

"""autopipe.core.profile: unit times at other micro-batch sizes, validation, JSON, old keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopipe.core.profile import Profile, ProfileFormatError, UnitProfile
from autopipe.core.profile_records import Counting, Measurement


def _profile(n: int = 3) -> Profile:
    units = [UnitProfile(f"u{i}", forward_s=0.1 * (i + 1), backward_s=0.2) for i in range(n)]
    return Profile(units=units, cut_bytes=[100] * (n - 1), batch_size=8)


def test_times_scale_linearly_above_the_per_call_overhead() -> None:
    u = UnitProfile("u", forward_s=1.0, backward_s=3.0, forward_overhead_s=0.2)
    assert u.forward_at(8, 8) == pytest.approx(1.0)
    assert u.forward_at(4, 8) == pytest.approx(0.2 + 0.8 / 2)
    assert u.forward_at(0, 8) == pytest.approx(0.2)
    assert u.backward_at(2, 8) == pytest.approx(3.0 / 4)  # no backward overhead
    # An overhead above the whole time (or below 0) is clamped into [0, total].
    assert UnitProfile("v", forward_s=1.0, forward_overhead_s=5.0).forward_at(1, 8) == 1.0
    assert UnitProfile("w", forward_s=1.0, forward_overhead_s=-1.0).forward_at(4, 8) == 0.5
    assert not u.split_fitted
    assert UnitProfile("s", backward_input_overhead_s=1e-4).split_fitted


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    st.floats(0, 10),
    st.floats(0, 1),
    st.integers(1, 64),
    st.integers(1, 64),
)
def test_a_smaller_microbatch_never_takes_longer(
    total: float, share: float, a: int, b: int
) -> None:
    u = UnitProfile("u", forward_s=total, forward_overhead_s=total * share)
    small, large = sorted((a, b))
    assert u.forward_at(small, 64) <= u.forward_at(large, 64) + 1e-12


def test_one_cut_fewer_than_units() -> None:
    with pytest.raises(ValueError, match="profile has 3 units but 1 cut sizes"):
        Profile(units=_profile(3).units, cut_bytes=[1], batch_size=8)


def test_shared_groups_in_unit_order() -> None:
    p = _profile(5)
    p.units[4].measured_as = "u1"
    p.units[3].measured_as = "u0"
    p.units[2].measured_as = "u1"
    assert p.shared_groups() == {"u0": ["u0", "u3"], "u1": ["u1", "u2", "u4"]}
    assert len(p) == 5 and p.unit_names == ["u0", "u1", "u2", "u3", "u4"]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda p: setattr(p.units[1], "forward_s", -1.0), "units[1].forward_s is -1.0"),
        (lambda p: setattr(p.units[0], "backward_s", float("nan")), "units[0].backward_s is nan"),
        (lambda p: setattr(p.units[2], "activation_bytes", 10**31), "units[2].activation_bytes"),
        (lambda p: setattr(p, "batch_size", 0), "batch_size is 0; expected an integer in [1, "),
        (lambda p: setattr(p.units[2], "name", "u0"), "'u0' repeats units[0].name"),
        (lambda p: setattr(p.units[1], "name", ""), "units[1].name is empty"),
        (
            lambda p: [setattr(u, f, 0.0) for u in p.units for f in ("forward_s", "backward_s")],
            "nothing was measured",
        ),
    ],
)
def test_validate_names_the_first_bad_field(edit, message: str) -> None:
    p = _profile()
    p.validate()
    edit(p)
    with pytest.raises(ProfileFormatError) as info:
        p.validate()
    assert message in str(info.value) and "\n" not in str(info.value)


def test_save_load_round_trip_and_errors_name_the_file(tmp_path: Path) -> None:
    p = _profile()
    p.measurement = Measurement(microbatch_sizes=[8, 4], clock="wall")
    path = tmp_path / "profile.json"
    p.save(path)
    assert Profile.load(path) == p
    data = json.loads(path.read_text())
    data["version"] = 2
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileFormatError, match=r"profile\.json: profile schema version 2"):
        Profile.load(path)
    data["version"] = 1
    data["units"][0]["forward_s"] = -3
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileFormatError, match=r"profile\.json: units\[0\]\.forward_s is -3"):
        Profile.load(path)
    with pytest.raises(ProfileFormatError, match="malformed autopipe profile"):
        Profile.from_dict({"version": 1, "units": [{"kind": "Linear"}], "cut_bytes": []})


def test_new_keys_are_ignored_and_old_meta_keys_become_fields() -> None:
    data = _profile().to_dict()
    data["units"][0]["from_the_future"] = 1
    data["from_the_future"] = 2
    data["meta"] = {
        "loss_forward_s": 0.01,
        "warmup": 3,
        "clock": "thread_cpu",
        "analytic_seconds": 2.5,
        "analytic_batch_size": 8,
        "note": "kept",
    }
    p = Profile.from_dict(data)
    assert p.loss_forward_s == 0.01
    assert p.measurement == Measurement(warmup=3, clock="thread_cpu")
    assert p.counting == Counting(seconds=2.5)
    assert p.meta == {"note": "kept"}

"""autopipe/report.py: the CLI's profile and scaling tables."""

from __future__ import annotations

from autopipe.core.profile import Profile, UnitProfile
from autopipe.core.profile_records import Measurement
from autopipe.report import format_profile, format_scaling


def _profile() -> Profile:
    units = [
        UnitProfile("embed", "Embedding", forward_s=0.0015, backward_s=0.003, parameter_bytes=2048),
        *(
            UnitProfile(
                f"blocks.{i}",
                "Block",
                forward_s=0.002,
                backward_s=0.004,
                activation_bytes=3 * 2**20,
            )
            for i in range(5)
        ),
        UnitProfile("head", "Linear", forward_s=0.001, backward_s=0.002),
    ]
    for u in units[2:6]:
        u.measured_as = "blocks.0"
    return Profile(units=units, cut_bytes=[1024] * 6, batch_size=8, model="toy", device="cpu")


def test_the_profile_table_one_row_per_unit() -> None:
    text = format_profile(_profile())
    lines = text.splitlines()
    assert lines[0] == (
        "autopipe profile: toy (measured, fx trace) on cpu, float32, batch 8, 7 units"
    )
    assert lines[2].split() == [
        "#",
        "unit",
        "kind",
        "fwd",
        "ms",
        "bwd",
        "ms",
        "params",
        "saved",
        "act.",
        "cut",
        "after",
    ]
    assert lines[4].split() == [
        "0",
        "embed",
        "Embedding",
        "1.50",
        "3.00",
        "2.00",
        "KiB",
        "0",
        "B",
        "1.00",
        "KiB",
    ]
    assert lines[5].split() == [
        "1",
        "blocks.0",
        "Block",
        "2.00",
        "4.00",
        "0",
        "B",
        "3.00",
        "MiB",
        "1.00",
        "KiB",
    ]
    assert lines[10].split()[-1] == "-"  # nothing is cut after the last unit
    assert (
        "5 units share 1 measurement (identical computations, measured once); -v lists them" in text
    )


def test_verbose_names_who_shares_a_measurement() -> None:
    text = format_profile(_profile(), verbose=True)
    assert text.endswith("  blocks.0: measured once for blocks.0, blocks.1 .. blocks.4 (5 units)")
    counted = _profile()
    counted.mode = "analytic"
    counted.units[6].measured_as = "embed"
    text = format_profile(counted, verbose=True)
    assert "7 units share 2 measurements (identical computations, counted once)" in text
    assert "  embed: counted once for embed, head (2 units)" in text


def test_meta_init_is_said() -> None:
    p = _profile()
    p.measurement = Measurement(meta_init=True)
    assert format_profile(p).endswith("meta-init      built on meta, measured one unit at a time")


def test_the_scaling_table() -> None:
    rows = [
        {"gpus": 1, "feasible": False, "error": "x"},
        {
            "gpus": 2,
            "feasible": True,
            "iteration_time_s": 0.25,
            "throughput": 128.0,
            "speedup": 1.9,
            "efficiency": 0.95,
            "microbatches": 8,
            "max_memory_bytes": 3 * 2**30,
        },
    ]
    text = format_scaling(rows)
    lines = text.splitlines()
    assert lines[0] == "scaling with the number of stages"
    assert lines[-1] == "fewest GPUs that fit: 2"
    assert lines[-3].split()[:3] == ["1", "does", "not"]
    assert lines[-2].split() == ["2", "250", "ms", "128", "1.90x", "95%", "8", "3.00", "GiB"]
    assert format_scaling(rows[:1]).endswith("no GPU count in this range fits")

"""The mesh search's work is bounded for any device count and batch size (#36, #37): one
divisor routine (``planner/search.py:divisors``, O(sqrt(n))), the micro-batch counts
enumerated in one place (``search.microbatch_counts``, at most ``MAX_AUTO_MICROBATCHES``),
and a request no mesh can fill refused in one line, exit 2, before any device list is built.

The bounds are checked by counting the work (units priced, bisection probes), not by a wall
clock; the one timed test allows a factor of a thousand over what the routine takes."""

from __future__ import annotations

import math
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from autopipe.planner import RuleViolation, plan, probe, search
from autopipe.planner.mesh import (
    MeshCandidate,
    mesh_candidates,
    mesh_lower_bound_s,
    refuse_too_deep,
)
from autopipe.planner.search import MAX_AUTO_MICROBATCHES, divisors, microbatch_counts
from planner_instances import cost_model, random_cluster, random_profile
from test_cli_errors import _err_line
from test_planner_mesh import TOPOLOGY, _saved, tiny_profile

from autopipe.cli import main
from autopipe.core.request import PlanRequest


@contextmanager
def _within(seconds: int) -> Iterator[None]:
    """Fail (not hang) when the body runs past ``seconds``: the old O(n) loops took hours."""

    def stop(*_: object) -> None:
        raise AssertionError(f"took more than {seconds} s")

    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_mesh_candidates_of_10_to_the_12_gpus_enumerate_the_divisors_only() -> None:
    n = 10**12  # 2^12 5^12: 169 divisors; an O(n) scan never ends
    with _within(20):  # O(sqrt(n)) = 10^6 trial divisions: well under a second
        cands = mesh_candidates(tiny_profile(), n, 2**40, tensor_parallel=1, shard="none")
    assert sorted(c.dp for c in cands) == [d for d in divisors(n) if 2**40 % d == 0]
    assert all(c.pp * c.dp * c.tp == n for c in cands)


def test_the_lower_bound_prices_at_most_max_auto_microbatches_counts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bound on a 10^12-sample replica walks the M the search may pick (divisors up to
    MAX_AUTO_MICROBATCHES), not every divisor of the batch: the M it prices are counted (the
    bound prices every unit at every M at once, vectorised)."""
    import autopipe.planner.mesh as mesh

    profile = tiny_profile()
    priced: list[list[int]] = []

    def counted(batch: int, candidates: list[int] | None = None) -> list[int]:
        out = microbatch_counts(batch, candidates)
        priced.append(out)
        return out

    monkeypatch.setattr(mesh, "microbatch_counts", counted)
    batch = 2**20 * 3**10  # divisors: 21 x 11 = 231, of which fewer than 4096 are <= 4096
    cand = MeshCandidate(pp=2, dp=1, tp=1, shard="none")
    bound = mesh_lower_bound_s(profile, profile, cand, batch, TOPOLOGY)
    counts = microbatch_counts(batch)
    assert counts == [m for m in divisors(batch) if m <= MAX_AUTO_MICROBATCHES]
    assert priced == [counts]
    assert math.isfinite(bound) and bound > 0


def test_a_billion_gpus_are_refused_in_one_rule_line() -> None:
    with _within(20), pytest.raises(RuleViolation) as err:
        plan(tiny_profile(), PlanRequest(gpus=10**9, tensor_parallel="auto"))
    assert "\n" not in str(err.value)
    assert "the model has 6 units" in str(err.value)


@pytest.mark.parametrize(
    "flags",
    [
        ["--gpus", str(10**9), "--tensor-parallel", "auto"],
        ["--gpus", str(10**6), "--tensor-parallel", "auto"],
        ["--gpus", str(10**6), "--shard", "auto", "--gpus-per-node", "8"],
        ["--gpus", str(10**6), "--data-parallel", "auto"],
    ],
)
def test_cli_refuses_a_mesh_too_deep_for_the_model_in_one_line_exit_2(
    tmp_path: Path, flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    saved = _saved(tmp_path, tiny_profile(heads=[2, 4]))
    with _within(30):  # before the fix: a list of 10^9 devices, then an O(N) scan
        assert main(["plan", saved, "-q", *flags]) == 2
    assert "pipeline stages" in _err_line(capsys)


def test_the_refusal_is_exact_at_the_deepest_mesh_that_fits() -> None:
    """6 stages x D=16 x T=4 is the most a 6-unit model at batch 16 fills."""
    p = tiny_profile(heads=[2, 4])
    most = 6 * 16 * 4
    search_for = dict(tensor_parallel="auto", data_parallel="auto", gpus_per_node=8)
    refuse_too_deep(p, most, 16, **search_for)  # fits: PP=6 with D=16, T=4
    with pytest.raises(RuleViolation, match="at most 384 GPUs"):
        refuse_too_deep(p, 2 * most, 16, **search_for)


def test_the_least_memory_need_skips_candidates_by_their_floor_and_says_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The refusal's figure with the floors pruning equals the one bisecting every candidate,
    and fewer candidates are bisected."""
    profile = random_profile(10, 4)
    req = PlanRequest(gpus=3, memory_per_device=10**6, microbatches="auto", batch_size=2**12)

    def refusal() -> tuple[str, int]:
        bisected = [0]
        real = probe.min_memory_needed

        def counted(cm: object) -> float:
            bisected[0] += 1
            return real(cm)  # type: ignore[arg-type]

        monkeypatch.setattr(search, "min_memory_needed", counted)
        with pytest.raises(search.PlanningError) as err:
            plan(profile, req)
        return str(err.value), bisected[0]

    pruned, few = refusal()
    monkeypatch.setattr(search, "memory_floor", lambda cm: 0.0)  # nothing pruned
    every, all_of_them = refusal()
    # the figure (the hint's own floor check is switched off with the pruning)
    assert pruned.split("; try")[0] == every.split("; try")[0]
    assert few < all_of_them


def test_memory_floor_is_below_the_bisected_need() -> None:
    for seed in range(6):
        cm = cost_model(random_profile(9, seed), random_cluster(3, seed, 10**6), 4, "1f1b", "auto")
        assert probe.memory_floor(cm) <= probe.min_memory_needed(cm)


def test_a_mesh_refused_at_a_huge_batch_bisects_no_memory_need(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--shard auto --batch-size 10**12`` on 8 GPUs: nothing fits, so every M of every mesh
    is refused and each refusal states its least memory need. That need is one min-max DP
    over the segments (exact), not ~30 bisection probes: before, 15 000 probes (30 of 35 s).
    Counted: at most the one failing probe per candidate its partition search makes."""
    probes = [0]
    real_probe = probe._Prober.probe

    def counted(self: probe._Prober, *args: float) -> list[int] | None:
        probes[0] += 1
        return real_probe(self, *args)

    prepared = [0]
    real_prepare = search._prepare

    def counted_prepare(*args: object, **kwargs: object) -> object:
        prepared[0] += 1
        return real_prepare(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(probe._Prober, "probe", counted)
    monkeypatch.setattr(search, "_prepare", counted_prepare)
    req = PlanRequest(gpus=8, data_parallel="auto", tensor_parallel="auto", shard="auto",
                      batch_size=10**12, memory_per_device=80 * 2**30)  # fmt: skip
    with pytest.raises(search.PlanningError, match="the smallest need is") as err:
        plan(tiny_profile(), req)
    assert err.value.min_memory_bytes and err.value.min_memory_bytes > 80 * 2**30
    assert prepared[0] > 100  # every M of every mesh was searched
    assert probes[0] <= prepared[0]


@pytest.mark.parametrize("dp_max_units", [probe.MEMORY_DP_MAX_UNITS, 0])
def test_the_least_memory_need_by_dp_and_by_bisection_agree(
    monkeypatch: pytest.MonkeyPatch, dp_max_units: int
) -> None:
    """The DP (small models) is exact; the bisection (beyond ``MEMORY_DP_MAX_UNITS`` units)
    is within its 1e-6 above it; both against every cut."""
    import itertools

    monkeypatch.setattr(probe, "MEMORY_DP_MAX_UNITS", dp_max_units)
    for seed in range(8):
        n, k = 7, 1 + seed % 4
        sched, ckpt = ("gpipe", "1f1b")[seed % 2], ("never", "always", "auto")[seed % 3]
        cm = cost_model(random_profile(n, seed), random_cluster(k, seed, 10**6), 4, sched, ckpt)
        brute = min(
            max(cm.segment_memory_need(s, b[s], b[s + 1]) for s in range(k))
            for cuts in itertools.combinations(range(1, n), k - 1)
            for b in [[0, *cuts, n]]
        )
        found = probe.min_memory_needed(cm)
        if dp_max_units:
            assert found == brute
        else:
            assert brute <= found <= brute * (1 + 2e-6)


def test_a_million_gpus_at_a_huge_batch_price_no_bound_of_a_mesh_too_deep_to_cut(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--gpus 10**6 --shard auto --tensor-parallel auto --batch-size 10**12`` on a catalog
    device (#36): the batch lets D reach the devices, so the request is not refused as too
    deep, and before, every mesh was priced, the 10^4-stage ones too (K x #M arrays, about a
    minute), and the equal-devices check deep-copied each of the 10^6 devices (astuple, 30 s).
    Counted: no lower bound of a pipeline deeper than the model's units, no astuple per
    device; the plan still refuses (nothing fits 1 MiB) with its least need."""
    import dataclasses

    import autopipe.planner.mesh as mesh

    from autopipe.core.cluster import Cluster, Device

    profile = tiny_profile(heads=[2, 4])
    deepest: list[int] = []
    real_bound = mesh.mesh_lower_bound_s

    def counted_bound(prof: object, device: object, cand: MeshCandidate, *a: object) -> float:
        deepest.append(cand.pp)
        return real_bound(prof, device, cand, *a)  # type: ignore[arg-type]

    copies = [0]
    real_astuple = dataclasses.astuple

    def counted_astuple(obj: object) -> tuple[object, ...]:
        copies[0] += 1
        return real_astuple(obj)

    monkeypatch.setattr(mesh, "mesh_lower_bound_s", counted_bound)
    monkeypatch.setattr(mesh.dataclasses, "astuple", counted_astuple)
    one = Device("h100", memory_bytes=2**20, link_bandwidth_bytes_per_s=4.5e11)
    n = 10**6
    req = PlanRequest(
        gpus=n, cluster=Cluster([one] * n), tensor_parallel="auto", data_parallel="auto",
        shard="auto",
        batch_size=10**12, gpus_per_node=8, inter_node_bandwidth_bytes_per_s=5e10,
    )  # fmt: skip
    with _within(120), pytest.raises(search.PlanningError, match="the smallest need is"):
        plan(profile, req)
    assert deepest and max(deepest) <= len(profile.units)
    assert copies[0] < 100


@pytest.mark.parametrize("mesh", [["--shard", "auto"], ["--tensor-parallel", "auto"]])
def test_a_mesh_at_a_batch_of_10_to_the_24_plans_finite_or_refuses_in_one_line(
    tmp_path: Path, mesh: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """#36 minor: ``--batch-size 10**24`` ended in an OverflowError (exit 1). A mesh plans
    it with finite figures where memory is unlimited, and refuses it in one line naming
    the least need where the device's memory binds (exit 1: nothing fits)."""
    import dataclasses
    import json

    saved = _saved(tmp_path, tiny_profile(heads=[2, 4]))
    out = tmp_path / "plan.json"
    argv = ["plan", saved, "--gpus", "8", *mesh, "--batch-size", str(10**24),
            "--allreduce-bandwidth", "10GB/s", "-q", "--json", str(out)]  # fmt: skip
    with _within(60):
        assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["data_parallel"] * data["batch_size"] == 10**24  # batch_size: per replica
    assert math.isfinite(data["report"]["iteration_time_s"]) and data["report"]["throughput"] > 0
    h100 = tmp_path / "h100.json"
    dataclasses.replace(tiny_profile(heads=[2, 4]), device="H100-SXM-80GB", mode="analytic").save(
        h100
    )
    with _within(60):
        assert main(["plan", str(h100), "--gpus", "8", *mesh, "--batch-size", str(10**24)]) == 1
    err = _err_line(capsys)
    assert "no mesh of 8 GPUs fits in 79.65 GiB per device: the smallest need is" in err

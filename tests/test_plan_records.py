"""The planner's figures a Plan keeps are typed fields, and schema v1 files that kept them as
``meta`` keys load into those fields (``autopipe/core/meta_fields.py``)."""

from __future__ import annotations

import json
from pathlib import Path

from autopipe.core.plan import Plan, load_plan
from autopipe.core.plan_records import CandidateRow, MeshReport, MeshRow
from autopipe.core.plantext import format_plan
from autopipe.core.profile import Profile

OLD = Path(__file__).parent / "data" / "plan_v1_meta.json"
"""A mesh plan as the writer before the typed fields wrote it: the mesh table, candidates,
pipeline / all-reduce split, bottlenecks, embedded profile and plot data under ``meta``."""


def test_an_old_plan_file_loads_its_meta_keys_into_the_fields(tmp_path: Path) -> None:
    raw = json.loads(OLD.read_text())
    meta = raw["meta"]
    old = load_plan(OLD)
    assert isinstance(old.mesh, MeshReport) and all(
        isinstance(r, MeshRow) for r in old.mesh.candidates
    )
    # the row's fields that file has (later additive fields, e.g. cp and ep, take defaults)
    rows = meta["mesh"]["candidates"]
    pairs = zip(old.mesh.candidates, rows, strict=True)
    assert [{k: r.__dict__[k] for k in row} for r, row in pairs] == rows
    assert all((r.cp, r.ep) == (1, 1) for r in old.mesh.candidates)
    assert old.mesh.peak_bytes == meta["mesh"]["peak_bytes"] > 0
    assert old.mesh.gpus_per_node == meta["mesh"]["gpus_per_node"] == 4
    assert [c.__dict__ for c in old.candidates] == meta["candidates"]
    assert all(isinstance(c, CandidateRow) for c in old.candidates)
    assert old.partition_algorithm == meta["algorithm"] != ""
    assert (old.bottleneck_s, old.min_bottleneck_s) == (
        meta["bottleneck_s"],
        meta["min_bottleneck_s"],
    )
    assert old.single_device_time_s == meta["single_device_time_s"] > 0
    assert old.parameter_size_bytes == meta["parameter_size_bytes"] == 2
    assert (old.pipeline_iteration_s, old.allreduce_s) == (
        meta["pipeline_iteration_s"],
        meta["allreduce_s"],
    )
    assert isinstance(old.profile, Profile) and old.profile.unit_names == [
        u["name"] for u in meta["profile"]["units"]
    ]
    assert old.plot_data == meta["viz"]
    # what is left in meta is notes nothing reads back (copies of what the request and the
    # fields this file also had say)
    left = {"frontier", "refinement", "checkpoint_mode", "headroom", "state_bytes_per_parameter"}
    assert set(old.meta) <= left
    assert "mesh" in format_plan(old) and "meshes, fastest first" in format_plan(old)
    # written again, the figures are the report's fields and read back equal
    path = tmp_path / "plan.json"
    old.save(path)
    written = json.loads(path.read_text())["report"]
    pairs = zip(written["mesh"]["candidates"], rows, strict=True)
    assert [{k: r[k] for k in row} for r, row in pairs] == rows
    assert "mesh" not in written["meta"] and "profile" not in written["meta"]
    again = load_plan(path)
    assert again.to_dict() == old.to_dict()


def test_a_given_field_wins_over_a_meta_key() -> None:
    data = json.loads(OLD.read_text())
    data["bottleneck_s"] = 1.5  # a file with both: the field was written by the newer writer
    plan = Plan.from_dict(data)
    assert plan.bottleneck_s == 1.5 and "bottleneck_s" in plan.meta


def test_an_unusable_embedded_profile_is_one_line() -> None:
    data = json.loads(OLD.read_text())
    data["meta"]["profile"]["units"] = []
    try:
        Plan.from_dict(data)
    except ValueError as exc:
        message = str(exc)
    else:
        raise AssertionError("a plan with an empty embedded profile loaded")
    assert message.startswith("profile (the embedded profile) is unusable:") and "\n" not in message


def test_a_plan_from_before_the_request_gets_its_request_from_meta() -> None:
    data = json.loads(OLD.read_text())
    del data["request"]
    data["meta"]["options"] = {"microbatches": [2, 4], "strategy": "dp", "removed_option": 1}
    plan = Plan.from_dict(data)
    assert plan.request is not None
    assert (plan.request.microbatches, plan.request.strategy) == ((2, 4), "dp")
    assert (plan.request.checkpoint, plan.request.headroom) == ("never", 0.1)
    assert not {"options", "checkpoint_mode", "headroom"} & set(plan.meta)


PROFILE_OLD = Path(__file__).parent / "data" / "profile_v1_meta.json"
"""A measured profile as the writer before the typed fields wrote it: how it was measured,
the loss's times and the counted blocks as flat ``meta`` keys."""


def test_an_old_profile_file_loads_its_meta_keys_into_the_fields(tmp_path: Path) -> None:
    meta = json.loads(PROFILE_OLD.read_text())["meta"]
    old = Profile.load(PROFILE_OLD)
    assert old.measurement is not None
    assert old.measurement.microbatch_sizes == meta["microbatch_sizes"]
    assert (old.measurement.clock, old.measurement.repeat, old.measurement.reference) == (
        "thread_cpu",
        3,
        True,
    )
    assert old.measurement.reference_scale == {"forward": 1.01, "backward": 0.99}
    assert [s.activation_bytes for s in old.measurement.per_size] == [
        s["activation_bytes"] for s in meta["per_size"]
    ]
    assert (old.loss_forward_s, old.loss_backward_s) == (1e-4, 2e-4)
    assert old.counted_blocks is not None and old.counted_blocks.counted == 3
    assert old.optimizer_chosen is meta["optimizer_chosen"] is False
    assert old.counting is None
    # left in meta: what nothing lifts (a note)
    assert set(old.meta) == {"note"}
    path = tmp_path / "profile.json"
    old.save(path)
    assert Profile.load(path) == old


ANALYTIC_OLD = Path(__file__).parent / "data" / "profile_v1_analytic_meta.json"
"""An analytic profile (a 3-unit MLP counted for an A100 in bfloat16 at batch 8 and 4, with
``--bytes-per-parameter 10``) as the writer before ``Profile.counting`` wrote it: the
device spec, the counted cost parts, the run's seconds and the optimizer choice as flat
``meta`` keys."""


def test_an_old_analytic_profile_loads_its_meta_keys_into_the_fields(tmp_path: Path) -> None:
    from autopipe.profiler.calibrate import priced_times, reprice, spec_of

    raw = json.loads(ANALYTIC_OLD.read_text())
    meta = raw["meta"]
    old = Profile.load(ANALYTIC_OLD)
    counting = old.counting
    assert counting is not None and old.measurement is None
    assert counting.device_spec == meta["device_spec"]
    assert counting.units == meta["analytic_units"] and len(counting.units) == len(old.units)
    assert counting.smaller_sizes == meta["analytic_smaller_sizes"]
    assert counting.smaller_sizes[0]["microbatch_size"] == 4
    assert counting.loss == meta["analytic_loss"] != {}
    assert counting.seconds == meta["analytic_seconds"] == 0.25
    assert old.batch_size == meta["analytic_batch_size"] == 8
    assert (old.optimizer_chosen, old.state_bytes_per_parameter) == (True, 10)
    assert set(old.meta) == {"note"}
    # the lifted parts price to the times the old writer stored
    spec = spec_of(old)
    times = priced_times(counting, old.batch_size, 1.0, 1.0, spec.kernel_launch_overhead_s)
    assert times["forward_s"] == [u["forward_s"] for u in raw["units"]]
    assert times["backward_s"] == [u["backward_s"] for u in raw["units"]]
    assert times["forward_overhead_s"] == [u["forward_overhead_s"] for u in raw["units"]]
    assert times["loss_forward_s"] == raw["loss_forward_s"] > 0
    # and re-pricing for the same device keeps them
    again = reprice(old, spec)
    assert [u.forward_s for u in again.units] == [u.forward_s for u in old.units]
    path = tmp_path / "profile.json"
    old.save(path)
    written = json.loads(path.read_text())
    assert written["counting"]["units"] == meta["analytic_units"] and written["meta"] == {
        "note": meta["note"]
    }
    assert Profile.load(path) == old

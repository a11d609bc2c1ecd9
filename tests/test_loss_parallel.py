"""Loss parallelism (``PlanRequest.loss_parallel``): an LM head's logits sharded over TP, the
cross-entropy on the shards (torchtitan's default, Megatron's only mode), against the gathered
logits ``autopipe run`` runs; priced by hand, refused by the runtime's rule, emitted."""

from __future__ import annotations

import dataclasses

import pytest
from autopipe.planner import plan
from autopipe.planner.mesh_costs import Topology, device_profile, ring_collective_s

from autopipe.core.cluster import Cluster, Device
from autopipe.core.mesh_rules import loss_parallel_problem
from autopipe.core.profile import Profile, UnitProfile
from autopipe.core.request import PlanRequest

HIDDEN_BYTES = 10**7
"""The head's input, [tokens, h] in bf16, at the profile's batch."""
LOGITS = 10**9
"""Logit elements [tokens, vocab] at the profile's batch (bf16: 2 bytes each)."""


def _head() -> UnitProfile:
    return UnitProfile(
        name="output", kind="LMHead", forward_s=4e-2, backward_s=8e-2,
        parameter_count=10**8, parameter_bytes=2 * 10**8,
        # saved: its input and the fp32 log-softmax; at its peak the loss's 12 bytes per logit
        activation_bytes=HIDDEN_BYTES + 4 * LOGITS, peak_bytes=HIDDEN_BYTES + 12 * LOGITS,
        output_bytes=2 * LOGITS, tp_parameter_count=10**8, tp_compute_fraction=1.0,
        tp_collective_bytes=(2 * HIDDEN_BYTES + 2 * LOGITS) // 4,
        tp_gathered_output_bytes=2 * LOGITS,
    )  # fmt: skip


def _profile(blocks: int = 4) -> Profile:
    us = [
        UnitProfile(
            name=f"layers.{i}",
            kind="Block",
            forward_s=1e-2,
            backward_s=2e-2,
            parameter_count=10**8,
            parameter_bytes=2 * 10**8,
            activation_bytes=10**9,
            peak_bytes=10**9,
            output_bytes=HIDDEN_BYTES,
            tp_parameter_count=10**8,
            tp_compute_fraction=1.0,
            tp_collective_bytes=2 * HIDDEN_BYTES,
        )  # fmt: skip
        for i in range(blocks)
    ]
    return Profile(
        units=[*us, _head()], cut_bytes=[HIDDEN_BYTES] * blocks, batch_size=1,
        device="H100-SXM-80GB", dtype="bfloat16", mode="analytic", bytes_per_parameter=2,
        tp_plan={"layers.*": "x", "output": "colwise_gather_output"}, tp_degrees=[2, 4, 8],
    )  # fmt: skip


def test_loss_parallel_shards_the_logits_and_drops_their_gather() -> None:
    """T = 4 on 400 GB/s. Gathered (autopipe run's head): every rank holds the whole logits,
    so the head saves and peaks at its whole bytes, and each pass charges 2 rings of
    C = (2 x input + logits) / 4. Loss parallel: 1/4 of the bytes, and C less the logits."""
    top = Topology(8, 400e9, 50e9)
    gathered = device_profile(_profile(), 4, top).units[-1]
    sharded = device_profile(_profile(), 4, dataclasses.replace(top, loss_parallel=True)).units[-1]
    assert gathered.activation_bytes == HIDDEN_BYTES + 4 * LOGITS
    assert gathered.peak_bytes == HIDDEN_BYTES + 12 * LOGITS
    assert sharded.activation_bytes == (HIDDEN_BYTES + 4 * LOGITS) // 4
    assert sharded.peak_bytes == (HIDDEN_BYTES + 12 * LOGITS) // 4
    # by hand: ring(x) = 3/4 x / 400e9 s; gathered C = 5e6 + 5e8 B, sharded C = 5e6 B
    assert gathered.forward_s == pytest.approx(4e-2 / 4 + 2 * 0.75 * 505e6 / 400e9)
    assert sharded.forward_s == pytest.approx(4e-2 / 4 + 2 * 0.75 * 5e6 / 400e9)
    assert sharded.backward_s == pytest.approx(8e-2 / 4 + 2 * ring_collective_s(5e6, 4, 400e9))
    # a block (no gathered output) is priced alike either way
    blocks = [device_profile(_profile(), 4, t).units[0] for t in (top, dataclasses.replace(top, loss_parallel=True))]  # fmt: skip
    assert blocks[0].forward_s == blocks[1].forward_s
    assert blocks[0].activation_bytes == blocks[1].activation_bytes == 10**9 // 4


def _request(**options: object) -> PlanRequest:
    return PlanRequest(
        cluster=Cluster([Device.from_spec("h100", memory_bytes=10**15)] * 8), batch_size=8,
        microbatches=4, schedule="1f1b", tensor_parallel=4, data_parallel=1, gpus_per_node=8,
        baselines=False, **options,  # type: ignore[arg-type]
    )  # fmt: skip


def test_a_gathered_colwise_input_stays_whole_on_every_tp_rank() -> None:
    """torch's DTensor ColwiseParallel under sequence parallelism saves the all-gathered input
    of its matmul (torchtitan's output layer: ``input_layouts=Shard(1)``), so
    ``tp_gathered_input_bytes`` of the head's saved bytes are whole on each of the T ranks and
    only the rest is split: T = 4, loss parallel, (A - g) / 4 + g, the peak alike; 0 prices
    as before."""
    top = Topology(8, 400e9, 50e9, loss_parallel=True)
    p = _profile()
    p.units[-1].tp_gathered_input_bytes = HIDDEN_BYTES
    head = device_profile(p, 4, top).units[-1]
    assert head.activation_bytes == (4 * LOGITS) // 4 + HIDDEN_BYTES
    assert head.peak_bytes == (12 * LOGITS) // 4 + HIDDEN_BYTES
    before = device_profile(_profile(), 4, top).units[-1]
    assert before.activation_bytes == (HIDDEN_BYTES + 4 * LOGITS) // 4
    assert head.forward_s == before.forward_s  # bytes only


def test_a_loss_parallel_plan_is_priced_so_and_autopipe_run_refuses_it() -> None:
    gathered = plan(_profile(), _request())
    sharded = plan(_profile(), _request(loss_parallel=True))
    assert sharded.request is not None and sharded.request.loss_parallel
    # the last stage's peak: the head's transient is 1/T of the gathered one's (12 - 4 bytes
    # per logit above what it saves), its saved bytes too
    assert sharded.mesh.peak_bytes < gathered.mesh.peak_bytes
    assert sharded.iteration_time_s < gathered.iteration_time_s  # no logits all-gather
    assert loss_parallel_problem(gathered) is None
    line = loss_parallel_problem(sharded)
    assert line is not None and line.startswith("loss-parallel:") and "\n" not in line
    assert "re-plan without --loss-parallel" in line
    t1 = dataclasses.replace(_request(loss_parallel=True), tensor_parallel=1, data_parallel=2)
    one = plan(_profile(), t1)
    assert loss_parallel_problem(one) is None  # T = 1: nothing is gathered


def test_emit_says_what_was_priced() -> None:
    """torchtitan 0.2.2's ``[parallelism] disable_loss_parallel`` (default false) is written
    with T > 1; 0.3.0, which always shards the logits, says so when the plan gathers them."""
    from autopipe.planner.emit_torchtitan import _trainer_keys, torchtitan_fields

    gathered = plan(_profile(), _request())
    sharded = plan(_profile(), _request(loss_parallel=True))
    assert _trainer_keys(gathered)["parallelism"]["disable_loss_parallel"] is True
    assert _trainer_keys(sharded)["parallelism"]["disable_loss_parallel"] is False
    assert "always runs loss parallel" in torchtitan_fields(gathered, "0.3.0").note
    assert "loss parallel" not in torchtitan_fields(sharded, "0.3.0").note


def test_the_cli_flag_reaches_the_request(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    from pathlib import Path

    from autopipe.cli import main
    from autopipe.core.plan import load_plan

    folder = Path(str(tmp_path))
    path, out = folder / "profile.json", folder / "plan.json"
    _profile().save(path)
    base = ["plan", str(path), "--gpus", "8", "--tensor-parallel", "4", "--batch-size", "8",
            "--microbatches", "4", "--schedule", "1f1b", "--json", str(out), "-q"]  # fmt: skip
    assert main([*base, "--loss-parallel"]) == 0, capsys.readouterr().err
    assert load_plan(out).request.loss_parallel
    assert main(base) == 0, capsys.readouterr().err
    assert not load_plan(out).request.loss_parallel

"""autopipe.core.request: the PlanRequest value, its mesh switch and its JSON."""

from __future__ import annotations

import dataclasses
import json

import pytest

from autopipe.core.cluster import Cluster, Device
from autopipe.core.request import PlanRequest
from autopipe.core.vocabulary import DEFAULT_CHECKPOINT


def test_defaults_are_the_documented_ones() -> None:
    r = PlanRequest()
    assert (r.gpus, r.cluster, r.batch_size) == (None, None, None)
    assert (r.microbatches, r.schedule, r.virtual_stages) == ("auto", "gpipe", "auto")
    assert r.checkpoint == DEFAULT_CHECKPOINT and r.strategy == "dp" and r.optimizer == "auto"
    assert (r.headroom, r.baselines, r.time_limit_s) == (0.10, True, 30.0)
    assert not r.plans_mesh


@pytest.mark.parametrize(
    ("fields", "mesh"),
    [
        ({}, False),
        ({"gpus": 8, "schedule": "1f1b"}, False),
        ({"tensor_parallel": 2}, True),
        ({"tensor_parallel": "auto"}, True),
        ({"data_parallel": 4}, True),
        ({"shard": "optimizer"}, True),
        ({"tensor_parallel": 1, "data_parallel": 1, "shard": "none"}, False),
    ],
)
def test_plans_mesh_exactly_when_t_d_or_sharding_is_asked(fields: dict, mesh: bool) -> None:
    assert PlanRequest(**fields).plans_mesh is mesh


def test_a_request_is_a_frozen_hashable_value() -> None:
    r = PlanRequest(gpus=4, microbatches=[2, 4, 8])  # type: ignore[arg-type]
    assert r.microbatches == (2, 4, 8)  # a list is kept as a tuple
    assert hash(r) == hash(PlanRequest(gpus=4, microbatches=(2, 4, 8)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.gpus = 2  # type: ignore[misc]
    again = dataclasses.replace(r, microbatches=8)
    assert again.microbatches == 8 and again.gpus == 4 and r.microbatches == (2, 4, 8)


def test_json_round_trip_with_a_cluster_and_an_unlimited_link() -> None:
    cluster = Cluster(
        [Device("a", 10**9, 2.0, 5e9, 1e-5), Device("b", None, 1.0)], host_throughput=1.5
    )
    r = PlanRequest(
        cluster=cluster, microbatches=(4, 8), schedule="auto", memory_per_device=3 * 10**9
    )
    data = r.to_dict()
    text = json.dumps(data, allow_nan=False)  # strict JSON: the infinite link is null
    assert data["microbatches"] == [4, 8]
    assert data["cluster"]["devices"][1]["link_bandwidth_bytes_per_s"] is None
    back = PlanRequest.from_dict(json.loads(text))
    assert back == r
    assert back.cluster is not None and back.cluster.devices[1].link_bandwidth_bytes_per_s == float(
        "inf"
    )
    assert back.cluster.host_throughput == 1.5


def test_from_dict_ignores_keys_a_newer_writer_added() -> None:
    data = PlanRequest(gpus=2, microbatches=4).to_dict()
    data["some_future_field"] = {"x": 1}
    assert PlanRequest.from_dict(data) == PlanRequest(gpus=2, microbatches=4)
    assert PlanRequest.from_dict({}) == PlanRequest()

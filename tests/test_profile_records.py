"""autopipe.core.profile_records: how a profile was made, read back from plain JSON."""

from __future__ import annotations

import dataclasses
import json

from autopipe.core.profile_records import CountedBlocks, Counting, Measurement, SizeMeasurement


def test_measurement_round_trip_with_its_per_size_records() -> None:
    m = Measurement(
        microbatch_sizes=[8, 4],
        warmup=2,
        repeat=5,
        threads=2,
        clock="thread_cpu",
        reference=True,
        reference_scale={"forward": 1.02, "backward": 0.98},
        per_size=[
            SizeMeasurement(8, [0.1, 0.2], [0.2, 0.4], [10, 20]),
            SizeMeasurement(4, [0.06, 0.11], [0.1, 0.2], [5, 10]),
        ],
    )
    back = Measurement.from_dict(json.loads(json.dumps(dataclasses.asdict(m))))
    assert back == m
    assert all(isinstance(s, SizeMeasurement) for s in back.per_size)


def test_keys_a_newer_writer_added_are_ignored() -> None:
    data = {"microbatch_sizes": [2], "clock": "wall", "gpu_temperature": 60}
    assert Measurement.from_dict(data) == Measurement(microbatch_sizes=[2], clock="wall")
    size = {"microbatch_size": 2, "forward_s": [1.0], "extra": True}
    assert SizeMeasurement.from_dict(size) == SizeMeasurement(2, forward_s=[1.0])
    blocks = {"container": "model.layers", "blocks": 80, "counted": 3, "head": 1, "x": 0}
    assert CountedBlocks.from_dict(blocks) == CountedBlocks("model.layers", 80, 3, head=1)
    counting = {"loss": {"forward": {}}, "seconds": 1.5, "future": []}
    assert Counting.from_dict(counting) == Counting(loss={"forward": {}}, seconds=1.5)

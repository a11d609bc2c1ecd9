"""Per-micro-batch random streams (autopipe.runtime.rng): what a micro-batch draws does not
depend on the order the schedule runs the tasks in, and the caller's generator is kept."""

from __future__ import annotations

import torch
from autopipe.runtime.rng import MicrobatchRNG, draw_base_seed, microbatch_seed

CPU = torch.device("cpu")


def seeded_draws(seed: int, n: int) -> torch.Tensor:
    gen = torch.Generator()
    gen.manual_seed(seed)
    return torch.rand(n, generator=gen)


def test_seeds_follow_the_base_and_wrap() -> None:
    assert microbatch_seed(100, 0) == 100 and microbatch_seed(100, 7) == 107
    assert microbatch_seed(2**62 - 1, 3) == 2
    torch.manual_seed(5)
    first = draw_base_seed()
    torch.manual_seed(5)
    assert draw_base_seed() == first and 0 <= first < 2**62
    assert draw_base_seed() != first  # one draw from the default generator each


def test_a_stream_is_the_microbatch_seed_continued_across_tasks() -> None:
    """Micro-batch 1's two tasks (two stages) draw one stream, as the unsplit model would."""
    rng = MicrobatchRNG(base_seed=40)
    with rng.stream(1, CPU):
        a = torch.rand(3)
    with rng.stream(0, CPU):
        other = torch.rand(3)
    with rng.stream(1, CPU):
        b = torch.rand(3)
    assert torch.equal(torch.cat([a, b]), seeded_draws(41, 6))
    assert torch.equal(other, seeded_draws(40, 3))


def test_results_do_not_depend_on_the_task_order() -> None:
    def draws(order: list[int]) -> dict[int, list[torch.Tensor]]:
        rng = MicrobatchRNG(base_seed=9)
        out: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}
        for i in order:
            with rng.stream(i, CPU):
                out[i].append(torch.nn.functional.dropout(torch.ones(8), 0.5))
        return out

    fill_drain = draws([0, 1, 0, 2, 1, 2])
    sequential = draws([0, 0, 1, 1, 2, 2])
    for i in range(3):
        assert all(torch.equal(x, y) for x, y in zip(fill_drain[i], sequential[i], strict=True))
    assert not torch.equal(fill_drain[0][0], fill_drain[1][0])


def test_the_callers_generator_is_left_as_it_was() -> None:
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    rng = MicrobatchRNG(base_seed=1)
    with rng.stream(0, CPU):
        torch.rand(100)
    assert torch.equal(torch.rand(4), expected)

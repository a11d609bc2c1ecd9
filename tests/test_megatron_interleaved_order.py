"""autopipe's interleaved 1F1B order (``autopipe/core/schedules.py``, torch's
``ScheduleInterleaved1F1B``) against Megatron-Core's ``forward_backward_pipelining_with_interleaving``
(megatron/core/pipeline_parallel/schedules.py, Megatron-Core 0.16 as installed), whose order
comes from two of its functions, called here:

- ``get_schedule_table``: micro-batches in groups of ``G`` (``--microbatch-group-size-per-
  virtual-pipeline-stage``, default the pipeline size P); each group goes through model chunk
  0, then chunk 1, ..., the last group taking every micro-batch left. A rank's k-th forward
  runs entry k, its k-th backward the same entry with the chunk mirrored (``V - 1 - chunk``,
  ``get_model_chunk_id(..., forward=False)``);
- ``get_pp_rank_microbatches``: the warm-up forwards, ``min(2 (P - rank - 1) + (V - 1) G,
  V M)``; then one forward and one backward in turn, then the remaining backwards.

docs/cost-model.md, "Megatron's interleaved order".
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from autopipe.core.schedules import rank_order
from autopipe.core.timeline import Action

schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")


def megatron_order(rank: int, p: int, v: int, m: int, group: int) -> list[Action]:
    """Rank ``rank``'s compute actions under Megatron-Core's interleaved schedule (chunk ``c``
    of a rank is model chunk ``c * P + rank``, the loop placement both use)."""
    table = schedules.get_schedule_table(m, v, group)
    pp_group = SimpleNamespace(size=lambda: p, rank=lambda: rank)
    p2p = SimpleNamespace(pp_group=pp_group, virtual_pipeline_model_parallel_size=v)
    total, _, warm, _ = schedules.get_pp_rank_microbatches(m, v, group, p2p_communicator=p2p)

    def forward(k: int) -> Action:
        mb, chunk = table[k]
        return Action(chunk * p + rank, mb, "forward")

    def backward(k: int) -> Action:
        mb, chunk = table[k]
        return Action((v - 1 - chunk) * p + rank, mb, "backward")

    order = [forward(k) for k in range(warm)]
    for k in range(total - warm):
        order += [forward(warm + k), backward(k)]
    order += [backward(k) for k in range(total - warm, total)]
    return order


@pytest.mark.parametrize(
    ("p", "v", "m"), [(2, 2, 4), (4, 2, 8), (4, 3, 12), (4, 2, 16), (8, 2, 16), (3, 4, 9)]
)
def test_the_default_group_is_megatrons_order_when_p_divides_m(p: int, v: int, m: int) -> None:
    """M a multiple of P (which Megatron-LM before the group-size option required for the
    interleaved schedule): torch's rounds of P micro-batches are Megatron's default groups."""
    for rank in range(p):
        assert rank_order("interleaved-1f1b", p, v, m, rank) == megatron_order(rank, p, v, m, p)


@pytest.mark.parametrize(("p", "v", "m"), [(4, 2, 6), (4, 2, 10), (4, 3, 7), (2, 2, 3)])
def test_other_m_is_megatrons_order_with_torchs_round_as_the_group(p: int, v: int, m: int) -> None:
    """M not a multiple of P: torch runs ``max(1, M // P)`` rounds of ``M // rounds``
    micro-batches (the ``rounds`` rule: M must be a multiple of the rounds), which is
    Megatron's order with ``G = M // rounds``, not its default ``G = P`` (whose last group
    takes the remainder): the two differ on some rank."""
    rounds = max(1, m // p)
    group = m // rounds
    assert m % rounds == 0  # torch's own rule, which these M meet
    for rank in range(p):
        assert rank_order("interleaved-1f1b", p, v, m, rank) == megatron_order(rank, p, v, m, group)
    assert any(
        rank_order("interleaved-1f1b", p, v, m, r) != megatron_order(r, p, v, m, p)
        for r in range(p)
    )

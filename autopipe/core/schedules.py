"""The pipeline schedules a plan may name: where each model chunk runs, and in what order
every rank runs its work. Torch-free.

A plan cuts the model into ``K x V`` contiguous chunks (``K`` ranks, ``V`` virtual stages per
rank). :func:`autopipe.core.schedule_rules.chunk_ranks` places them as
torch.distributed.pipelining does, and :func:`rank_orders` gives each rank's compute actions
(forward, full backward, and the zero-bubble schedules' input-gradient ``backward_input`` /
weight-gradient ``backward_weight``) in the order torch's schedule class runs them. The
orders are written from the schedules' documented rules (the papers, and the facts of torch
2.13's ``torch/distributed/pipelining/schedules.py``), not copied; ``tests/test_schedules.py``
compares them with torch's own for many ``(K, V, M)``.

======================  ===================================  ==============  ================
name                    torch class                          placement       V
======================  ===================================  ==============  ================
``gpipe``               ``ScheduleGPipe``                    chunk s on s    1
``1f1b``                ``Schedule1F1B``                     chunk s on s    1
``interleaved-1f1b``    ``ScheduleInterleaved1F1B``          loop            >= 1
``looped-bfs``          ``ScheduleLoopedBFS``                loop            >= 1
``interleaved-zb``      ``ScheduleInterleavedZeroBubble``    loop            >= 1
``zbv``                 ``ScheduleZBVZeroBubble``            V-shape         2
``dualpipev``           ``ScheduleDualPipeV``                V-shape         2
======================  ===================================  ==============  ================

Loop placement: chunk ``c`` on rank ``c mod K``. V-shape: rank ``r`` holds chunks ``r`` and
``2K - 1 - r`` (chunks ``K - 1`` and ``K`` meet on the last rank, so the model goes down the
ranks and comes back up). Every generator costs O(K V M).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from autopipe.core.schedule_rules import check_virtual_stages
from autopipe.core.timeline import Action
from autopipe.core.vocabulary import SINGLE_SCHEDULES, V_SHAPE_SCHEDULES

__all__ = ["rank_order", "rank_orders", "virtual_stage_choices"]


def virtual_stage_choices(
    schedule: str, num_ranks: int, num_units: int, most: int = 4
) -> list[int]:
    """The V values the planner tries for ``schedule``: 1 for GPipe and 1F1B, 2 for the
    V-shaped schedules, ``1..most`` for the looped ones; only those with ``K x V`` chunks
    of at least one unit each. O(most)."""
    if schedule in SINGLE_SCHEDULES:
        options = [1]
    elif schedule in V_SHAPE_SCHEDULES:
        options = [2]
    else:
        options = list(range(1, most + 1))
    return [v for v in options if num_ranks * v <= num_units]


def rank_orders(
    schedule: str, num_ranks: int, virtual_stages: int, microbatches: int
) -> list[list[Action]]:
    """Each rank's compute actions, in the order torch's schedule class runs them
    (:func:`rank_order` for every rank). O(K V M)."""
    return [
        rank_order(schedule, num_ranks, virtual_stages, microbatches, r) for r in range(num_ranks)
    ]


def rank_order(
    schedule: str, num_ranks: int, virtual_stages: int, microbatches: int, rank: int
) -> list[Action]:
    """Rank ``rank``'s compute actions, in the order torch's schedule class runs them.

    ``Action.stage`` is the chunk index (0 .. K V - 1), ``Action.phase`` one of
    ``forward``, ``backward`` (the whole backward), ``backward_input``, ``backward_weight``.
    DualPipeV's overlapped forward+backward pairs are listed as their two actions, forward
    first (torch runs them one after the other). Raises ValueError for a V the schedule
    cannot run; the runtime's other rules (e.g. M >= K for 1F1B) are
    :mod:`autopipe.core.schedule_rules`. O(V M).
    """
    if microbatches < 1 or num_ranks < 1:
        raise ValueError("a schedule needs at least one rank and one micro-batch")
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank {rank} is not one of 0..{num_ranks - 1}")
    why = check_virtual_stages(schedule, virtual_stages)
    if why is not None:
        raise ValueError(why)
    k, v, m, r = num_ranks, virtual_stages, microbatches, rank
    if schedule == "gpipe":
        return _gpipe(r, m)
    if schedule == "1f1b":
        return _one_f_one_b(r, k, m)
    if schedule == "looped-bfs":
        return _looped_bfs(r, k, v, m)
    if schedule == "interleaved-1f1b":
        return _interleaved(r, k, v, m, zero_bubble=False)
    if schedule == "interleaved-zb":
        return _interleaved(r, k, v, m, zero_bubble=True)
    if schedule == "zbv":
        return _zbv(r, k, m)
    return _dualpipev(r, k, m)


# -- one stage per rank -------------------------------------------------------------------


def _gpipe(rank: int, m: int) -> list[Action]:
    """Fill-drain: every forward, then every backward, in micro-batch order."""
    return [Action(rank, i, "forward") for i in range(m)] + [
        Action(rank, i, "backward") for i in range(m)
    ]


def _one_f_one_b(rank: int, k: int, m: int) -> list[Action]:
    """PipeDream-flush: ``K - rank - 1`` warm-up forwards, then one forward and one
    backward at a time, then the remaining backwards. (torch's ``_step_microbatches``
    counts ``K - rank`` warm-up forwards and then runs backward first: the same order.)"""
    warm = min(k - rank - 1, m)
    order = [Action(rank, i, "forward") for i in range(warm)]
    for i in range(m - warm):
        order += [Action(rank, warm + i, "forward"), Action(rank, i, "backward")]
    return order + [Action(rank, i, "backward") for i in range(m - warm, m)]


# -- loop placement -----------------------------------------------------------------------


def _looped_bfs(rank: int, k: int, v: int, m: int) -> list[Action]:
    """Breadth first (Lamy-Poirier 2022): each local chunk in model order runs all its
    forwards; then each local chunk in reverse order runs its backwards, the last
    micro-batch first."""
    local = [rank + j * k for j in range(v)]
    order = [Action(c, i, "forward") for c in local for i in range(m)]
    return order + [Action(c, i, "backward") for c in reversed(local) for i in reversed(range(m))]


def _interleaved(rank: int, k: int, v: int, m: int, *, zero_bubble: bool) -> list[Action]:
    """Interleaved 1F1B (Narayanan et al. 2021, torch's flexible-M variant) and its
    zero-bubble form (Qi et al. 2024, ZB-1P).

    Micro-batches go in rounds of ``P = M // max(1, M // K)``: the forward stream takes P
    micro-batches through local chunk 0, then P through local chunk 1, ... (wrapping
    around); the backward stream does the same from the last local chunk down. A rank first
    runs ``min((V - 1) P + f (K - 1 - rank), V M)`` warm-up forwards (``f`` = 2, or 1 for
    zero bubble), then alternates one forward and one backward until the forwards run out,
    then runs the remaining backwards. With zero bubble the backward is the input gradient
    only, and after the first ``rank`` of the paired steps every backward is followed by the
    weight gradient of the oldest backward still waiting for one; the rest come last.
    """
    rounds = max(1, m // k)
    per_round = m // rounds
    total = v * m
    warm = min((v - 1) * per_round + (1 if zero_bubble else 2) * (k - 1 - rank), total)
    seen: dict[str, dict[int, int]] = {"forward": {}, "backward": {}}

    def next_action(step: int, phase: str, chunk_of: Callable[[int], int]) -> Action:
        chunk = chunk_of(step)
        counts = seen[phase]
        mb = counts.get(chunk, 0)
        counts[chunk] = mb + 1
        return Action(chunk, mb, phase)

    def fwd_chunk(step: int) -> int:
        return ((step // per_round) % v) * k + rank

    def bwd_chunk(step: int) -> int:
        return (v - 1 - (step // per_round) % v) * k + rank

    backward_phase = "backward_input" if zero_bubble else "backward"
    order = [next_action(i, "forward", fwd_chunk) for i in range(warm)]
    pending: deque[Action] = deque()  # input gradients whose weight gradient is still to run
    for j in range(total):  # the j-th backward; forwards still to run go before it
        if warm + j < total:
            order.append(next_action(warm + j, "forward", fwd_chunk))
        back = next_action(j, "backward", bwd_chunk)
        order.append(Action(back.stage, back.microbatch, backward_phase))
        if zero_bubble:
            pending.append(back)
            if j >= rank:
                w = pending.popleft()
                order.append(Action(w.stage, w.microbatch, "backward_weight"))
    order += [Action(w.stage, w.microbatch, "backward_weight") for w in pending]
    return order


# -- V-shape placement --------------------------------------------------------------------


class _Counter:
    """Per-chunk counters of the actions issued so far (the next micro-batch of each)."""

    def __init__(self) -> None:
        self.count: dict[tuple[int, str], int] = {}

    def take(self, chunk: int, phase: str) -> int:
        key = (chunk, phase)
        mb = self.count.get(key, 0)
        self.count[key] = mb + 1
        return mb

    def get(self, chunk: int, phase: str) -> int:
        return self.count.get((chunk, phase), 0)


def _zbv(rank: int, k: int, m: int) -> list[Action]:
    """ZB-V (Qi et al. 2024, section 6) on chunks ``a = rank`` (going down) and
    ``b = 2K - 1 - rank`` (coming back).

    It is laid out for ``n = max(2K - 1, M)`` micro-batches and the actions of micro-batches
    ``>= M`` are then dropped: ``2(K - rank) - 1`` forwards of a; ``rank`` pairs (forward b,
    forward a); ``K - rank`` triples (forward b, B b, W b); then, while chunk b is behind
    chunk a or a has micro-batches left, (forward a if any left, B a, W a, forward b, B b,
    W b); cool-down: ``rank`` pairs (B a, B b), ``K - rank`` pairs (B a, W a), then the
    weight gradients still owed, chunk b's before chunk a's. (B = input gradient.)
    """
    n = max(2 * k - 1, m)
    a, b = rank, 2 * k - 1 - rank
    c = _Counter()
    out: list[Action] = []

    def add(chunk: int, phase: str) -> None:
        out.append(Action(chunk, c.take(chunk, phase), phase))

    for _ in range(2 * (k - rank) - 1):
        add(a, "forward")
    for _ in range(rank):
        add(b, "forward")
        add(a, "forward")
    for _ in range(k - rank):
        add(b, "forward")
        add(b, "backward_input")
        add(b, "backward_weight")
    while c.get(b, "forward") < c.get(a, "forward") or c.get(a, "forward") < n:
        if c.get(a, "forward") < n:
            add(a, "forward")
        add(a, "backward_input")
        add(a, "backward_weight")
        add(b, "forward")
        add(b, "backward_input")
        add(b, "backward_weight")
    for _ in range(rank):
        add(a, "backward_input")
        add(b, "backward_input")
    for _ in range(k - rank):
        add(a, "backward_input")
        add(a, "backward_weight")
    for chunk in (b, a):
        while c.get(chunk, "backward_weight") < c.get(chunk, "backward_input"):
            add(chunk, "backward_weight")
    return [x for x in out if x.microbatch < m]


def _dualpipev(rank: int, k: int, m: int) -> list[Action]:
    """DualPipeV (DeepSeek-V3's DualPipe folded onto a V, as torch 2.13 lays it out) on
    chunks ``a = rank`` and ``b = 2K - 1 - rank``. Needs ``M >= 2K`` (torch refuses fewer).

    1. ``2(K - rank - 1)`` forwards of a; 2. ``rank + 1`` pairs (forward a, forward b);
    3. ``K - rank - 1`` times (B b, the oldest owed W, forward b); 4. ``M - 2K + rank + 1``
    times the overlapped pairs (forward a + full backward b) and (forward b + full backward
    a), except that the last rank's first pair is not overlapped (the same two actions);
    5. ``K - rank - 1`` times (full backward b, then forward b + full backward a);
    6. ``rank + 1`` pairs (backward b, backward a), full backwards for the first half and
    split ones (B) after it, the switch falling between b and a for even ranks and before b
    for odd ones; 7. ``K - rank - 1`` times (the oldest owed W, backward a, split if the
    switch happened); 8. ``rank + 1`` owed Ws. B = input gradient; a W is owed by every B,
    oldest first. Full backwards count as their chunk's input and weight gradient.
    """
    order = _DualPipeVOrder(rank, k)
    _dualpipev_warmup(order, rank, k)
    _dualpipev_steady(order, rank, k, m)
    _dualpipev_cooldown(order, rank, k)
    return order.out


class _DualPipeVOrder:
    """One DualPipeV rank's actions as they are issued, on chunks ``a = rank`` and
    ``b = 2K - 1 - rank``: each action takes its chunk's next micro-batch; a B owes a W,
    which :meth:`pay` issues, oldest first."""

    def __init__(self, rank: int, k: int) -> None:
        self.a, self.b = rank, 2 * k - 1 - rank
        self.c = _Counter()
        self.owed: deque[Action] = deque()
        self.out: list[Action] = []

    def add(self, chunk: int, phase: str) -> None:
        if phase == "backward":  # the full backward takes the input-gradient counter
            mb = self.c.take(chunk, "backward_input")
            self.c.take(chunk, "backward_weight")
        else:
            mb = self.c.take(chunk, phase)
            if phase == "backward_input":
                self.owed.append(Action(chunk, mb, "backward_weight"))
        self.out.append(Action(chunk, mb, phase))

    def pay(self) -> None:
        if self.owed:
            self.out.append(self.owed.popleft())


def _dualpipev_warmup(order: _DualPipeVOrder, rank: int, k: int) -> None:
    """Steps 1 to 3 of :func:`_dualpipev`: forwards of a, pairs of forwards, then
    (B b, the oldest owed W, forward b)."""
    a, b = order.a, order.b
    for _ in range(2 * (k - rank - 1)):
        order.add(a, "forward")
    for _ in range(rank + 1):
        order.add(a, "forward")
        order.add(b, "forward")
    for _ in range(k - rank - 1):
        order.add(b, "backward_input")
        order.pay()
        order.add(b, "forward")


def _dualpipev_steady(order: _DualPipeVOrder, rank: int, k: int, m: int) -> None:
    """Steps 4 and 5 of :func:`_dualpipev`: the overlapped pairs, then (full backward b,
    forward b + full backward a)."""
    a, b = order.a, order.b
    for _ in range(m - 2 * k + rank + 1):
        order.add(a, "forward")
        order.add(b, "backward")
        order.add(b, "forward")
        order.add(a, "backward")
    for _ in range(k - rank - 1):
        order.add(b, "backward")
        order.add(b, "forward")
        order.add(a, "backward")


def _dualpipev_cooldown(order: _DualPipeVOrder, rank: int, k: int) -> None:
    """Steps 6 to 8 of :func:`_dualpipev`: pairs of backwards (full, then split after the
    switch), (the oldest owed W, backward a), then the Ws still owed."""
    a, b = order.a, order.b
    split = False
    steps = rank + 1
    for i in range(steps):
        if i == steps // 2 and rank % 2 == 1:
            split = True
        order.add(b, "backward_input" if split else "backward")
        if i == steps // 2 and rank % 2 == 0:
            split = True
        order.add(a, "backward_input" if split else "backward")
    for _ in range(k - rank - 1):
        order.pay()
        order.add(a, "backward_input" if split else "backward")
    for _ in range(rank + 1):
        order.pay()

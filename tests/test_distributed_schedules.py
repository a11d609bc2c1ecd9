"""Every schedule torch.distributed.pipelining runs, on 2 gloo ranks, against one process.

One launch of 2 ranks runs every case in a loop (:func:`distributed_cases.run_correctness`):
for each of the seven schedules the loss and every parameter's gradient equal single-process
training on the whole batch, for two SGD steps; the multi-stage schedules run V = 2 chunks
per rank (loop placement, or the V-shape for zbv and dualpipev). Each schedule also runs a
tied embedding / LM head with a re-materialized chunk. The zero-bubble schedules also run a
chunk whose split weight pass would miss a parameter (it runs unsplit) and a chunk sending
views and saved tensors on (own copies). Plans torch would refuse are refused by every rank
with one line naming the rule. The 4-rank run is marked slow.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from distributed_cases import free_port, job_key, run_correctness, spawn_ranks

from autopipe.core.schedule_rules import chunk_ranks, violations
from autopipe.core.vocabulary import TORCH_CLASSES

TOL = 1e-5
"""Loss and gradient agreement (absolute), as the GPipe / 1F1B tests use."""

SCHEDULE_V = {
    "gpipe": 1,
    "1f1b": 1,
    "interleaved-1f1b": 2,
    "looped-bfs": 2,
    "interleaved-zb": 2,
    "zbv": 2,
    "dualpipev": 2,
}


def _ckpt(virtual: int) -> list[bool]:
    """Re-materialize one middle chunk (the second of K x V = 2 x V)."""
    return [c == 1 for c in range(2 * virtual)]


JOBS_2: list[dict[str, Any]] = [
    # Every schedule on the tiny GPT (9 units in 2 x V chunks).
    *(
        dict(model="gpt", stages=2, virtual=v, microbatches=4, schedule=s)
        for s, v in SCHEDULE_V.items()
    ),
    # Tied embedding and head (with V = 2 and the V-shape both on rank 0) and a
    # re-materialized chunk, every schedule; M = 8 for a second micro-batch count.
    *(
        dict(model="gpt_tied", stages=2, virtual=v, microbatches=8, schedule=s, checkpoint=_ckpt(v))
        for s, v in SCHEDULE_V.items()
    ),
    # pos_emb alone in chunk 1: the zero-bubble weight pass would miss its gradient.
    dict(model="gpt_leak", stages=2, virtual=2, microbatches=4, schedule="interleaved-zb"),
    dict(model="gpt_leak", stages=2, virtual=2, microbatches=4, schedule="zbv"),
    # Views and saved tensors sent on, an expanded input gradient sent back.
    *(
        dict(model="views", stages=2, virtual=2, microbatches=4, schedule=s)
        for s in ("interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev")
    ),
    dict(model="views", stages=2, virtual=2, microbatches=2, schedule="zbv", checkpoint=_ckpt(2)),
]

REFUSED_2: list[tuple[dict[str, Any], str]] = [
    (dict(model="skip", stages=2, microbatches=1, schedule="1f1b"), "microbatches-vs-stages"),
    (
        dict(model="gpt", stages=2, virtual=2, microbatches=2, schedule="dualpipev"),
        "microbatches-vs-stages",
    ),
    (
        dict(model="gpt", stages=2, virtual=2, microbatches=4, schedule="zbv", ranks=[0, 1, 0, 1]),
        "placement",
    ),
]
"""(plan torch would refuse, the rule the message names)."""


def _run(world_size: int, jobs: list[dict[str, Any]], tmp_path: Path) -> dict[int, dict]:
    spawn_ranks(run_correctness, world_size, (world_size, free_port(), str(tmp_path), jobs), 240)
    return {r: torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)}


def _check(results: dict[int, dict], world_size: int, jobs: list[dict[str, Any]]) -> dict:
    """Assert every job matched one process on every rank; the worst errors per job."""
    from distributed_cases import case

    worst = {}
    for job in jobs:
        key = job_key(job, world_size)
        model = case(job["model"], job["stages"] * job.get("virtual", 1))[0]
        per_rank = [results[rank][key] for rank in range(world_size)]
        for rank, r in enumerate(per_rank):
            assert r["grad_err"] < TOL, (key, rank, r)
            if r["holds_last"]:
                assert 0 <= r["loss_err"] < TOL and 0 <= r["loss2_err"] < TOL, (key, rank, r)
            else:
                assert r["loss_err"] == -1.0, (key, rank, r)  # only the loss rank has it
        # Every parameter of the model got a gradient on some rank, and one rank per
        # replica computes the loss.
        covered = set().union(*(r["names"] for r in per_rank))
        names: dict[int, set[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), set()).add(name)
        assert covered <= set().union(*names.values()), key
        assert all(covered & aliases for aliases in names.values()), key
        assert sum(r["holds_last"] for r in per_rank) == world_size // job["stages"], key
        worst[key] = (
            max(r["grad_err"] for r in per_rank),
            max(max(r["loss_err"], r["loss2_err"]) for r in per_rank),
        )
    return worst


def test_every_schedule_on_two_ranks_matches_one_process(tmp_path: Path) -> None:
    jobs = JOBS_2 + [dict(job, refused=True) for job, _ in REFUSED_2]
    results = _run(2, jobs, tmp_path)
    worst = _check(results, 2, JOBS_2)
    for key, (grad, loss) in worst.items():
        print(f"{key}: max |grad diff| {grad:.1e}, max |loss diff| {loss:.1e}")
    # Unsplit backwards where expected (and only there): a parameter the weight pass would
    # miss, and re-materialized chunks (one each) under the zero-bubble schedules.
    unsplit = {k: sum(results[r][k]["unsplit"] for r in range(2)) for k in worst}
    zero_bubble = ("interleaved-zb", "zbv", "dualpipev")
    expected = {
        job_key(j, 2): 1.0
        for j in JOBS_2
        if j["model"] == "gpt_leak" or (j.get("checkpoint") and j["schedule"] in zero_bubble)
    }
    assert {k: n for k, n in unsplit.items() if n} == expected
    # A plan torch would refuse: refused on every rank, one line naming the rule.
    for job, rule in REFUSED_2:
        key = job_key(dict(job, refused=True), 2)
        messages = {results[r][key]["refused"] for r in range(2)}
        assert len(messages) == 1, messages
        (message,) = messages
        assert rule in message and "\n" not in message, message
        assert message.startswith("the plan cannot run: "), message


JOBS_4: list[dict[str, Any]] = [
    *(
        dict(model="gpt", stages=4, virtual=v, microbatches=8, schedule=s, checkpoint=None)
        for s, v in SCHEDULE_V.items()
    ),
    dict(
        model="gpt_tied",
        stages=4,
        virtual=2,
        microbatches=8,
        schedule="zbv",
        checkpoint=[c in (1, 6) for c in range(8)],
    ),
    dict(model="gpt_tied", stages=2, virtual=2, microbatches=4, schedule="interleaved-zb"),
]


@pytest.mark.slow
def test_every_schedule_on_four_ranks_matches_one_process(tmp_path: Path) -> None:
    """K = 4 (V = 2: 8 chunks), and K = 2 x D = 2 data-parallel replicas."""
    worst = _check(_run(4, JOBS_4, tmp_path), 4, JOBS_4)
    for key, (grad, loss) in worst.items():
        print(f"{key}: max |grad diff| {grad:.1e}, max |loss diff| {loss:.1e}")


# -- the rules, torch-free, and against torch's own constructors ------------------------------


def test_chunk_placement_is_loop_or_v_shape() -> None:
    assert chunk_ranks("interleaved-1f1b", 4, 2) == [0, 1, 2, 3, 0, 1, 2, 3]
    assert chunk_ranks("zbv", 4, 2) == [0, 1, 2, 3, 3, 2, 1, 0]
    assert chunk_ranks("1f1b", 3, 1) == [0, 1, 2]


@pytest.mark.parametrize(
    ("schedule", "K", "V", "M", "rule"),
    [
        ("1f1b", 4, 1, 3, "microbatches-vs-stages"),
        ("gpipe", 2, 2, 4, "stages-per-rank"),
        ("zbv", 2, 3, 4, "stages-per-rank"),
        ("dualpipev", 2, 2, 3, "microbatches-vs-stages"),
        ("interleaved-1f1b", 4, 2, 9, "rounds"),
        ("interleaved-zb", 2, 2, 5, "rounds"),
    ],
)
def test_a_broken_rule_is_named_in_one_line(
    schedule: str, K: int, V: int, M: int, rule: str
) -> None:
    (line,) = violations(schedule, K, V, M, batch_size=M)
    assert line.startswith(f"{rule}: ") and "\n" not in line


def _torch_accepts(schedule: str, K: int, V: int, M: int) -> bool:
    """Whether torch's schedule class accepts rank 0's stages (a fake process group of K)."""
    from torch.distributed import pipelining
    from torch.distributed.pipelining import PipelineStage

    multi = schedule not in ("gpipe", "1f1b")
    if not multi and V != 1:
        return False  # the class takes one stage: it has no way to run V of them
    x = torch.zeros(2, 2)
    n = K * V
    try:
        ranks = chunk_ranks(schedule, K, V)
        stages = [
            PipelineStage(
                torch.nn.Linear(2, 2), c, n, torch.device("cpu"), input_args=(x,), output_args=(x,)
            )
            for c in range(n)
            if ranks[c] == 0
        ]
        cls = getattr(pipelining, TORCH_CLASSES[schedule])
        cls(stages if multi else stages[0], n_microbatches=M, loss_fn=lambda out, _: out.sum())
    except (ValueError, RuntimeError, AssertionError, IndexError):
        return False
    return True


def test_the_rules_are_what_torch_enforces() -> None:
    """The planner's pre-flight (the runtime checks the same) accepts exactly what torch
    2.13's constructors accept, over a grid."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    disagree = []
    for K in (2, 4):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=K)
        try:
            for schedule in TORCH_CLASSES:
                for V in (1, 2, 3):
                    for M in range(1, 2 * K * V + 3):
                        ours = not violations(schedule, K, V, M, batch_size=M)
                        if ours != _torch_accepts(schedule, K, V, M):
                            disagree.append((schedule, K, V, M, ours))
        finally:
            dist.destroy_process_group()
    assert not disagree, disagree


def test_a_tied_parameter_two_chunks_of_a_rank_share_keeps_the_first_chunks_init() -> None:
    """From a meta model without a state_dict, the V-shape's rank 0 holds the tied embedding
    and head (chunks 0 and 3) as one parameter initialised as chunk 0 alone would be (as
    the copy on another rank would be), not overwritten by the head's init."""
    import copy

    from autopipe.runtime.distributed.pipeline import materialize_chunks
    from autopipe.runtime.planned_stages import partition
    from distributed_cases import case, make_plan

    model, inputs, _, units = case("gpt_tied", 4)
    plan = make_plan(units, 4, 8, "zbv", None, 2)

    def meta_model() -> torch.nn.Module:
        meta = copy.deepcopy(model).to("meta")
        meta.head.weight = meta.tok_emb.weight  # .to() unties; a meta build keeps the tie
        return meta

    both = materialize_chunks(partition(meta_model(), inputs, plan), plan, [0, 3], init_seed=5)
    alone = materialize_chunks(partition(meta_model(), inputs, plan), plan, [0], init_seed=5)
    tied = both[0].body.get_parameter("tok_emb.weight")
    assert tied is both[1].body.get_parameter("head.weight")
    torch.testing.assert_close(tied, alone[0].body.get_parameter("tok_emb.weight"), rtol=0, atol=0)

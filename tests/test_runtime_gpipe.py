"""GPipe (torchgpipe-compatible): gradients equal the unpipelined model, API and errors."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from autopipe.runtime import GPipe
from autopipe.runtime.batchnorm import DeferredBatchNorm
from autopipe.runtime.rng import draw_base_seed
from runtime_helpers import assert_close, assert_same_grads, load_example, reference_forward
from torch import nn

MODES = ("always", "except_last", "never")
CHUNKS = (1, 2, 4, 7)
# "cpu" and "cpu:0" are different device keys, so this layout runs stages on worker threads
# (one per device) as GPUs would; an all-"cpu" pipeline runs in the caller's thread.
LAYOUTS = {"one-device": ["cpu"] * 4, "threaded": ["cpu", "cpu:0", "cpu", "cpu:0"]}


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(12, 32),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(32, 32),
        nn.GELU(),
        nn.Linear(32, 5),
    )


def cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return load_example("resnet").resnet(widths=(4, 8), blocks_per_stage=1, num_classes=5)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunks", CHUNKS)
def test_mlp_matches_unpipelined(mode: str, chunks: int, layout: str) -> None:
    model, x = mlp(), torch.randn(11, 12)
    reference = copy.deepcopy(model)
    pipe = GPipe(model, balance=[2, 1, 3], devices=LAYOUTS[layout], chunks=chunks, checkpoint=mode)
    torch.manual_seed(5)
    out = pipe(x)
    out.square().mean().backward()
    expected = reference_forward(reference, (x,), chunks, seed=5)
    expected.square().mean().backward()
    assert_close(out, expected, "output")
    assert_same_grads(pipe, reference)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunks", CHUNKS)
def test_cnn_with_batchnorm_matches_microbatched_model(mode: str, chunks: int) -> None:
    """BatchNorm normalises each micro-batch with its own statistics (GPipe), so the
    reference is the unpipelined model run micro-batch by micro-batch: outputs, gradients
    and running statistics (updated once per micro-batch, never by a recomputation) agree."""
    model, x = cnn(), torch.randn(14, 3, 8, 8)
    reference = copy.deepcopy(model)
    pipe = GPipe(model, balance=[1, 2, 3], devices=["cpu"] * 3, chunks=chunks, checkpoint=mode)
    torch.manual_seed(1)
    out = pipe(x)
    out.logsumexp(1).sum().backward()
    expected = reference_forward(reference, (x,), chunks, seed=1)
    expected.logsumexp(1).sum().backward()
    assert_close(out, expected, "output")
    assert_same_grads(pipe, reference)
    for (name, buf), ref in zip(pipe.named_buffers(), reference.buffers(), strict=True):
        assert_close(buf, ref, f"buffer {name}")


@pytest.mark.parametrize("mode", MODES)
def test_deferred_batch_norm_tracks_the_whole_minibatch(mode: str) -> None:
    """With deferred_batch_norm the running statistics move once per mini-batch, with the
    statistics of everything the layer saw in that mini-batch (PyTorch's own update applied
    to the concatenated micro-batch inputs), while outputs still use per-micro-batch
    statistics. The first BatchNorm sees the same input as in the unsplit model, so its
    running statistics equal the unsplit model's."""
    model, x = cnn(), torch.randn(12, 3, 8, 8) * 2 + 0.5
    unsplit, microbatched = copy.deepcopy(model), copy.deepcopy(model)
    pipe = GPipe(
        model,
        balance=[2, 2, 2],
        devices=["cpu"] * 3,
        chunks=4,
        checkpoint=mode,
        deferred_batch_norm=True,
    )
    assert any(isinstance(m, DeferredBatchNorm) for m in pipe.modules())
    norms = [m for m in microbatched.modules() if isinstance(m, nn.BatchNorm2d)]
    expected = {id(bn): [b.clone() for b in bn.buffers()] for bn in norms}
    seen: dict[int, list[torch.Tensor]] = {id(bn): [] for bn in norms}
    for bn in norms:
        bn.register_forward_pre_hook(lambda m, args: seen[id(m)].append(args[0].detach()))
    for _ in range(2):
        torch.manual_seed(2)
        out = pipe(x)
        out.sum().backward()
        unsplit(x)
        for v in seen.values():
            v.clear()
        assert_close(out, reference_forward(microbatched, (x,), 4, seed=2), "output")
        for bn in norms:
            mean, var, count = expected[id(bn)]
            torch.nn.functional.batch_norm(
                torch.cat(seen[id(bn)]), mean, var, training=True, momentum=bn.momentum
            )
            count += 1
    pipe_norms = [m for m in pipe.modules() if isinstance(m, DeferredBatchNorm)]
    assert len(pipe_norms) == len(norms)
    for k, (got, bn) in enumerate(zip(pipe_norms, norms, strict=True)):
        for buf, want in zip(got.buffers(), expected[id(bn)], strict=True):
            assert_close(buf, want, f"BatchNorm {k} buffer")
    first_unsplit = next(m for m in unsplit.modules() if isinstance(m, nn.BatchNorm2d))
    for buf, want in zip(pipe_norms[0].buffers(), first_unsplit.buffers(), strict=True):
        assert_close(buf, want, "first BatchNorm vs unsplit model")


def test_eval_mode_equals_model_and_never_checkpoints() -> None:
    model, x = cnn(), torch.randn(9, 3, 8, 8)
    reference = copy.deepcopy(model).eval()
    pipe = GPipe(model, balance=[3, 3], devices=["cpu"] * 2, chunks=4, checkpoint="always").eval()
    assert_close(pipe(x), reference(x), "eval output")
    assert not pipe.last_timeline.of("recompute")
    pipe.train()
    with torch.no_grad():
        out = pipe(x)
    assert not out.requires_grad


def test_training_loss_curve_matches_gradient_accumulation() -> None:
    model, x, y = mlp(), torch.randn(16, 12), torch.randint(0, 5, (16,))
    reference = copy.deepcopy(model)
    pipe = GPipe(model, balance=[3, 3], devices=["cpu"] * 2, chunks=4)
    opt_pipe = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    curve_pipe, curve_ref = [], []
    for step in range(4):
        for opt, run, curve in (
            (opt_pipe, lambda s=step: (torch.manual_seed(s), pipe(x))[1], curve_pipe),
            (opt_ref, lambda s=step: reference_forward(reference, (x,), 4, seed=s), curve_ref),
        ):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(run(), y)
            loss.backward()
            opt.step()
            curve.append(loss.item())
    assert curve_pipe == pytest.approx(curve_ref, rel=1e-5)
    assert curve_pipe[-1] < curve_pipe[0]


class Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom in stage 2")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_exception_in_stage_2_of_4_propagates_promptly(layout: str) -> None:
    layers = [nn.Linear(4, 4), nn.Linear(4, 4), Boom(), nn.Linear(4, 4)]
    pipe = GPipe(nn.Sequential(*layers), balance=[1, 1, 1, 1], devices=LAYOUTS[layout], chunks=8)
    threads_before = threading.active_count()
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="boom in stage 2"):
        pipe(torch.randn(16, 4))
    assert time.perf_counter() - start < 1.0
    # The workers survive: the pipeline still runs, and no thread was leaked.
    ok = GPipe(
        nn.Sequential(nn.Linear(4, 4), nn.ReLU()), balance=[1, 1], devices=["cpu"] * 2, chunks=2
    )
    assert ok(torch.randn(4, 4)).shape == (4, 4)
    assert threading.active_count() <= threads_before + 2  # at most the two device workers


def test_uneven_and_small_batches() -> None:
    pipe = GPipe(mlp(), balance=[3, 3], devices=["cpu"] * 2, chunks=4, checkpoint="never")
    pipe(torch.randn(10, 12)).sum().backward()
    sizes = {r.microbatch for r in pipe.last_timeline.of("forward")}
    assert sizes == {0, 1, 2, 3}
    pipe(torch.randn(2, 12)).sum().backward()  # fewer samples than chunks: 2 micro-batches
    assert {r.microbatch for r in pipe.last_timeline.of("forward")} == {0, 1}


def test_tuple_inputs_and_outputs() -> None:
    class Pair(nn.Module):
        def forward(
            self, xs: tuple[torch.Tensor, torch.Tensor]
        ) -> tuple[torch.Tensor, torch.Tensor]:
            a, b = xs
            return a + b, a * b

    class First(nn.Module):
        def forward(self, xs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return xs[0] - xs[1]

    pipe = GPipe(
        nn.Sequential(Pair(), Pair(), First()), balance=[1, 1, 1], devices=["cpu"] * 3, chunks=3
    )
    a, b = torch.randn(6, 2, requires_grad=True), torch.randn(6, 2)
    out = pipe((a, b))
    out.sum().backward()
    s, p = a + b, a * b
    assert_close(out, (s + p) - s * p, "tuple pipeline")
    assert a.grad is not None


@pytest.mark.parametrize("layout", LAYOUTS)
def test_timeline_records_every_task_and_exports_chrome_trace(tmp_path, layout: str) -> None:
    pipe = GPipe(
        mlp(), balance=[2, 2, 2], devices=LAYOUTS[layout][:3], chunks=4, checkpoint="except_last"
    )
    pipe(torch.randn(8, 12)).sum().backward()
    tl = pipe.last_timeline
    for phase, count in (("forward", 12), ("backward", 12), ("recompute", 9)):
        assert len(tl.of(phase)) == count, phase
    fwd = {(r.stage, r.microbatch): r for r in tl.of("forward")}
    bwd = {(r.stage, r.microbatch): r for r in tl.of("backward")}
    for (j, i), rec in fwd.items():
        if j > 0:  # a stage starts a micro-batch only after the previous stage finished it
            assert rec.start_s >= fwd[(j - 1, i)].end_s
            assert bwd[(j - 1, i)].start_s >= bwd[(j, i)].end_s
    for rec in tl.of("recompute"):  # recomputation nests in its backward
        outer = bwd[(rec.stage, rec.microbatch)]
        assert outer.start_s <= rec.start_s <= rec.end_s <= outer.end_s
    path = tmp_path / "trace.json"
    tl.save_chrome_trace(path)
    import json

    events = json.loads(path.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == 33


def test_rng_streams_leave_the_caller_generator_alone() -> None:
    pipe = GPipe(mlp(), balance=[3, 3], devices=["cpu"] * 2, chunks=3)
    torch.manual_seed(9)
    pipe(torch.randn(6, 12))
    after = torch.rand(3)
    torch.manual_seed(9)
    torch.randn(6, 12)
    draw_base_seed()
    assert torch.equal(after, torch.rand(3))


def test_behaves_like_sequential() -> None:
    model = mlp()
    layers = list(model)
    pipe = GPipe(model, balance=[2, 4], devices=["cpu", "cpu"], chunks=2)
    assert len(pipe) == 6
    assert pipe[0] is layers[0] and pipe[-1] is layers[-1] and pipe[-6] is layers[0]
    assert list(pipe) == layers
    assert [n for n, _ in pipe.named_children()] == [str(i) for i in range(6)]
    assert set(pipe.state_dict()) == set(nn.Sequential(*layers).state_dict())
    assert pipe.balance == [2, 4] and pipe.chunks == 2 and pipe.checkpoint == "except_last"
    assert pipe.devices == [torch.device("cpu")] * 2
    assert [len(p) for p in pipe.partitions] == [2, 4]
    with pytest.raises(IndexError):
        pipe[6]
    with pytest.raises(IndexError):
        pipe[-7]


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"balance": [2, 2]}, ValueError),  # does not sum to len(module)
        ({"balance": [6, 0]}, ValueError),
        ({"balance": [3, 3], "chunks": 0}, ValueError),
        ({"balance": [3, 3], "checkpoint": "sometimes"}, ValueError),
        ({"balance": [2, 2, 2], "devices": ["cpu", "cpu"]}, IndexError),
        ({"balance": None}, ValueError),
    ],
)
def test_constructor_errors(kwargs: dict, error: type[Exception]) -> None:
    kwargs.setdefault("devices", ["cpu"] * 3)
    with pytest.raises(error):
        GPipe(mlp(), **kwargs)


def test_module_errors() -> None:
    with pytest.raises(TypeError):
        GPipe(nn.Linear(2, 2), balance=[1])  # type: ignore[arg-type]
    lin = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="duplicate children"):
        GPipe(nn.Sequential(lin, nn.ReLU(), lin), balance=[1, 2], devices=["cpu"] * 2)
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    b.weight = a.weight
    with pytest.raises(ValueError, match="shared"):
        GPipe(nn.Sequential(a, b), balance=[1, 1], devices=["cpu"] * 2)
    GPipe(nn.Sequential(a, b), balance=[2], devices=["cpu"])  # same partition is fine


def test_moving_and_bad_io_are_refused() -> None:
    pipe = GPipe(mlp(), balance=[3, 3], devices=["cpu"] * 2)
    for call in (lambda: pipe.to("cpu"), pipe.cuda, pipe.cpu, lambda: pipe.to(torch.zeros(1))):
        with pytest.raises(TypeError, match="cannot be moved"):
            call()
    with pytest.raises(TypeError):
        pipe([torch.randn(2, 12)])  # type: ignore[arg-type]
    bad = GPipe(nn.Sequential(nn.Linear(2, 2), nn.Flatten(0)), balance=[1, 1], devices=["cpu"] * 2)
    bad[1].forward = lambda x: "not a tensor"  # type: ignore[method-assign]
    with pytest.raises(TypeError):
        bad(torch.randn(2, 2))

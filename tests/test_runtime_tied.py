"""Tied parameters across devices in one process (autopipe.runtime.tied): one Parameter, a
replica per other device, the replicas' gradients summed into the Parameter's."""

from __future__ import annotations

import copy

import torch
from autopipe.profiler.units import trace_units
from autopipe.runtime import Pipeline
from autopipe.runtime.planned_stages import TiedParameter
from autopipe.runtime.tied import TiedReplicas
from runtime_helpers import assert_close, load_example, reference_forward
from test_runtime_pipeline import assert_model_grads
from torch import nn


def test_tied_weights_on_different_devices_train_as_one_parameter() -> None:
    """Embedding and head tied, on stages on different devices ("cpu" and "cpu:0" are
    distinct to the runtime): a replica on the second device, one summed gradient, and the
    replica follows the parameter after an optimizer step."""
    torch.manual_seed(0)
    gpt = load_example("gpt")
    model = gpt.build_model(
        vocab_size=64, seq_len=8, d_model=16, n_layer=2, n_head=2, tie_weights=True
    )
    reference = copy.deepcopy(model)
    idx = torch.randint(0, 64, (4, 8))
    ug = trace_units(model, idx)
    pipe = Pipeline(
        ug.graph_module,
        {k: (0 if u < 2 else 1) for k, u in ug.node_unit.items()},
        ["cpu", "cpu:0"],
        microbatches=2,
        checkpoint=[False, False],
    )
    assert len(pipe._tied) == 1
    names = [n for n, _ in pipe.named_parameters()]
    assert "head.weight" not in {n.partition(".")[2].partition(".")[2] for n in names}
    for step in range(2):
        for m in (model, reference):
            m.zero_grad()
        torch.manual_seed(step)
        pipe(idx).pow(2).mean().backward()
        torch.manual_seed(step)
        reference_forward(reference, (idx,), 2, seed=step).pow(2).mean().backward()
        assert_model_grads(model, reference)
        for m in (model, reference):
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.5 * p.grad
    assert model.head.weight is model.tok_emb.weight  # the user's model is untouched


class TiedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(3, 4, bias=False)
        self.head = nn.Linear(3, 4, bias=False)
        self.head.weight = self.emb.weight


def stages_of(model: TiedModel) -> tuple[nn.Module, nn.Module]:
    """Two stage modules holding the user's submodules (as a stage GraphModule does)."""
    first, second = nn.Module(), nn.Module()
    first.emb, second.head = model.emb, model.head
    return first, second


TIED = [TiedParameter("emb.weight", [0, 1], {0: ["emb.weight"], 1: ["head.weight"]})]


def test_a_replica_on_the_other_device_and_the_gradient_summed_into_the_parameter() -> None:
    torch.manual_seed(0)
    model = TiedModel()
    param = model.emb.weight
    first, second = stages_of(model)
    devices = [torch.device("cpu"), torch.device("cpu", 0)]
    replicas = TiedReplicas([first, second], devices, TIED, list(model.modules()))
    assert len(replicas) == 1
    replica = second.head.weight
    assert replica is not param and not isinstance(replica, nn.Parameter)
    assert torch.equal(replica, param) and replica.requires_grad
    # The user's modules keep the Parameter: the stage got a private copy of ``head``.
    assert model.head.weight is param and second.head is not model.head
    x, y = torch.randn(5, 3), torch.randn(5, 3)
    (first.emb(x).square().sum() + second.head(y).sum()).backward()
    expected = 2 * (x @ param.detach().t()).t() @ x + torch.ones(4, 5) @ y
    assert_close(param.grad, expected, "summed gradient")
    assert replica.grad is None  # folded into the Parameter at the end of backward

    with torch.no_grad():
        param.add_(1.0)
    assert not torch.equal(replica, param)
    replicas.refresh()
    assert torch.equal(replica, param)


def test_stages_on_one_device_share_the_parameter_itself() -> None:
    model = TiedModel()
    first, second = stages_of(model)
    cpu = torch.device("cpu")
    replicas = TiedReplicas([first, second], [cpu, cpu], TIED, list(model.modules()))
    assert len(replicas) == 0
    assert second.head.weight is model.emb.weight

"""The nested walk's recomputations (``remat.planning._nested_walk``): what a segment's recomputation runs on top of."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

import remat
from remat.planning._nested import Node, costs_of, simulate, to_plan


class _ScaledTanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, s: float) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(x)
        ctx.s = s
        return torch.tanh(x) * s

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        (x,) = ctx.saved_tensors
        return g * (1 - torch.tanh(x) ** 2) * ctx.s, None


class _Custom(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ScaledTanh.apply(self.fc(x), 1.5) + x


class _WrittenView(nn.Module):
    """Its output is a view written in place: the backward makes the base's gradient and a copy of it
    (``CopySlices``) before it reads a saved tensor."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        y.mul_(0.5)
        return y.relu_()


class _Chain(nn.Module):
    def __init__(self, body: list[nn.Module], d: int = 16) -> None:
        super().__init__()
        self.embed, self.body, self.head = nn.Embedding(11, d), nn.Sequential(*body), nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.head(self.body(self.embed(x))).float() ** 2).mean()


def _grads(model: nn.Module, x: torch.Tensor) -> dict:
    torch.manual_seed(0)
    model(x).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def _predicted_and_measured(body: list[nn.Module], shape) -> tuple[int, int]:  # noqa: ANN001
    torch.manual_seed(0)
    model, x = _Chain(body).double(), torch.randint(0, 11, (4, 16))
    reference = _grads(model, x)
    prof = remat.profile(model, x, repeat=1, warmup=0)
    c = costs_of(prof)
    nodes = shape(c, c.chain.policies.index)
    assignment, segments = to_plan(c, nodes)
    plan = replace(
        remat.plan(prof, strategy="none"),
        assignment={b.name: assignment[b.name] for b in prof.blocks},
        segments=segments,
        predicted_peak_bytes=simulate(c, nodes),
    )
    remat.apply(model, plan)
    try:
        grads = _grads(model, x)
        measured = remat.measure(model, x, repeat=1, warmup=0).peak_bytes
    finally:
        remat.remove(model)
    assert all(torch.equal(grads[n], reference[n]) for n in reference)
    return plan.predicted_peak_bytes, measured


@pytest.fixture(autouse=True)
def _deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def test_a_recomputation_runs_on_top_of_what_the_last_blocks_backward_made():
    # NOTE [What a segment's last block makes before its recomputation]: the segment ends at a block whose
    # backward makes two outputs' worth of gradients before it reads a saved tensor, and its recomputation of
    # the blocks before runs on top of them: predicted 8192 B (one output) under the measured peak before.
    d = 16
    body = [_Custom(d), _Custom(d), _WrittenView(d), _WrittenView(d)]
    predicted, measured = _predicted_and_measured(
        body,
        lambda c, p: (Node(0, end=3, children=(Node(0, end=2, children=(Node(0, p("keep")),)),)), Node(3, p("keep"))),
    )
    assert measured == predicted


@pytest.mark.parametrize("nested", [False, True])
def test_a_segment_holds_its_input_through_a_recomputation_whose_first_block_lets_go_of_it(nested):
    # NOTE [Outputs the parent keeps that nothing saves]: a Dropout kept inside the segment does not save its
    # input, so the keep run frees it in the Dropout's forward; the segment holds it until that block's
    # backward. Predicted one output (8192 B) under the measured peak before.
    d = 16
    body = [_Custom(d), nn.Dropout(0.2), nn.Dropout(0.2), _Custom(d)]

    def shape(c, p):  # noqa: ANN001, ANN202
        inner = Node(1, end=3, children=(Node(1, p("keep")),))
        if nested:
            return Node(0, p("selective")), Node(1, end=4, children=(inner,))
        return Node(0, p("keep")), inner, Node(3, p("keep"))

    predicted, measured = _predicted_and_measured(body, shape)
    assert measured == predicted

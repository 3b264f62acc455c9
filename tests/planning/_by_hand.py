"""Nested plans made by hand, applied and measured: the walk's prediction beside the step's peak, its gradients and
buffers checked against the model's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

import torch
from torch import nn

import remat
from remat.planning._nested import Costs, Node, costs_of, simulate, to_plan

Shape = Callable[[Costs, Callable[[str], int]], tuple[Node, ...]]
"""The plan's nodes from the nested view and a policy's index by name."""


class ByHand(NamedTuple):
    predicted: int
    measured: int
    costs: Costs
    nodes: tuple[Node, ...]


def step_grads(model: nn.Module, x: torch.Tensor, start: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The gradients and buffers of one step (``model(x)`` is the loss) from the buffers ``start``."""
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(start[n])
    torch.manual_seed(0)
    model(x).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return {**grads, **{n: b.clone() for n, b in model.named_buffers()}}


def measured_plan(model: nn.Module, x: torch.Tensor, shape: Shape) -> ByHand:
    """The nested plan ``shape`` makes, predicted by the walk and measured; its gradients and buffers are the
    model's, bit for bit."""
    start = {n: b.clone() for n, b in model.named_buffers()}
    reference = step_grads(model, x, start)
    prof = remat.profile(model, x, repeat=1, warmup=0)
    c = costs_of(prof)
    if c is None:
        raise AssertionError("the model has no nested view")
    nodes = shape(c, c.chain.policies.index)
    assignment, segments = to_plan(c, nodes)
    plan = replace(
        remat.plan(prof, strategy="none"),
        assignment={b.name: assignment[b.name] for b in prof.blocks},
        segments=segments,
        predicted_peak_bytes=simulate(c, nodes),
    )
    return ByHand(plan.predicted_peak_bytes, measured_step(model, x, plan, start, reference), c, nodes)


def measured_step(
    model: nn.Module, x: torch.Tensor, plan: remat.Plan, start: dict[str, torch.Tensor], reference: dict
) -> int:
    """The peak of a step under ``plan``, applied and removed again; its gradients and buffers are ``reference``,
    bit for bit."""
    remat.apply(model, plan)
    try:
        grads = step_grads(model, x, start)
        measured = remat.measure(model, x, repeat=1, warmup=0).peak_bytes
    finally:
        remat.remove(model)
    assert grads.keys() == reference.keys() and all(torch.equal(grads[n], reference[n]) for n in reference)
    return measured

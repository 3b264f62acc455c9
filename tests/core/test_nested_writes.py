"""Checkpointed calls inside another checkpoint whose inputs are written in place (remat.core._nested_writes, and
the copies a region keeps of what its forward wrote: NOTE [What recomputation must not repeat])."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat.core import _nested_writes as nested_writes


@pytest.fixture(autouse=True)
def _deterministic():
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def _layers():
    torch.manual_seed(0)
    return nn.Linear(8, 8), nn.Linear(8, 8)


def _grads(fn, x, layers):
    wanted = [x, *(p for layer in layers for p in layer.parameters())]
    return torch.autograd.grad(fn(x).square().sum(), wanted)


def _assert_equal(got, want):
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_an_input_written_after_an_inner_call_is_refused_not_recomputed_from():
    g, h = _layers()

    def inner(y):
        return torch.tanh(h(y)) * y

    def outer(x):
        y = g(x)
        z = remat.checkpoint(inner, y)
        y.add_(1)  # after the call: recomputing inner from y would see y + 1
        return z * y

    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(remat.RecomputeError, match=r"after the call \(version 0 -> 1"):
        _grads(outer, x, (g, h))  # one level: refused as before
    with pytest.raises(remat.RecomputeError, match="inside another checkpoint's recomputation"):
        _grads(lambda x: remat.checkpoint(outer, x), x, (g, h))  # before: wrong gradients, and no error


@pytest.mark.parametrize("writes", ["before the call", "another tensor after it", "a clone after it"])
def test_writes_the_inner_call_does_not_read_later_are_fine(writes):
    g, h = _layers()

    def outer(x, checkpoint):
        y = g(x)
        if writes == "before the call":
            y.add_(1)
        z = checkpoint(lambda t: torch.tanh(h(t)) * t, y)
        other = y.clone() if writes == "a clone after it" else g(z)
        other.add_(1)
        return z * other

    x = torch.randn(4, 8, requires_grad=True)
    want = _grads(lambda x: outer(x, lambda f, t: f(t)), x, (g, h))
    got = _grads(lambda x: remat.checkpoint(outer, x, lambda f, t: remat.checkpoint(f, t)), x, (g, h))
    _assert_equal(got, want)


def test_an_inner_function_that_writes_its_own_input_recomputes_from_the_value_before():
    g, h = _layers()

    def inner(y):
        y.mul_(2)
        return torch.tanh(h(y)) * y

    def outer(x, checkpoint):
        y = g(x)
        return checkpoint(inner, y) * y

    x = torch.randn(4, 8, requires_grad=True)
    want = _grads(lambda x: outer(x, lambda f, t: f(t)), x, (g, h))
    _assert_equal(_grads(lambda x: outer(x, remat.checkpoint), x, (g, h)), want)
    # before: the outer recomputation handed the inner one its tensor after the write: wrong gradients
    _assert_equal(_grads(lambda x: remat.checkpoint(outer, x, remat.checkpoint), x, (g, h)), want)


def test_a_record_goes_with_its_storage_and_never_matches_another():
    t = torch.zeros(4, 8)
    t.add_(1)
    before = nested_writes.now()
    nested_writes.remember([t], [0])
    key = nested_writes._view(t)
    assert nested_writes.recorded(t, before) == (0, 1) and nested_writes.recorded(t.detach(), before) == (0, 1)
    assert nested_writes.recorded(t, nested_writes.now()) is None  # made before the region's forward ended
    assert nested_writes.recorded(t[1:], before) is None  # another view of the storage
    assert nested_writes.recorded(torch.zeros(4, 8), before) is None  # the same view of another storage
    del t
    assert key not in nested_writes._versions

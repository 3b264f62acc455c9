"""Reading where the host generators stand (``remat.core._host_clock``), and a checkpointed call that draws
from them on a later call only (NOTE [Host generators in recomputation])."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from conftest import twin
from torch import nn

import remat
from remat.core import _host_clock, _host_rng
from remat.core._host_clock import host_clock
from remat.errors import HostDrawError


@pytest.fixture(params=["layout", "states"])
def clock(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways of reading: the positions where they lie, and (a layout that does not check) the states."""
    monkeypatch.setattr(_host_clock, "_readers", {})
    if request.param == "states":
        monkeypatch.setattr(_host_clock, "_python_layout_holds", lambda: False)
        monkeypatch.setattr(_host_clock, "_numpy_layout_holds", lambda numpy: False)
    return request.param


@pytest.mark.parametrize(
    "draw",
    [
        lambda: random.random(),
        lambda: random.getrandbits(8),
        lambda: [random.random() for _ in range(312)],  # 624 words: the same position, a rewritten key
        lambda: np.random.rand(),
        lambda: np.random.randint(0, 10, size=5),
        lambda: np.random.rand(624),
    ],
    ids=["random", "getrandbits", "624-words", "np-rand", "np-randint", "np-624"],
)
def test_the_clock_moves_with_every_draw(clock: str, draw) -> None:
    before = host_clock()
    assert host_clock() == before
    draw()
    assert host_clock() != before


def test_this_interpreter_reads_the_positions_where_they_lie() -> None:
    _host_clock._readers.clear()
    host_clock()
    assert _host_clock._readers["python"] is not None
    assert _host_clock._readers["numpy"] is not None


class _DrawsLater(nn.Module):
    """Draws its mask from NumPy's generator only when told to: not on its first call."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 16)
        self.draw = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if self.draw:
            h = h * torch.from_numpy(np.random.rand(64) < 0.5).to(x.dtype)
        return x + self.b(h)


@pytest.fixture(autouse=True)
def _nothing_seen_drawing_later(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_host_rng, "_DRAWS_LATER", type(_host_rng._DRAWS_LATER)())


def _step(model: nn.Module, x: torch.Tensor) -> tuple[list[torch.Tensor], float]:
    np.random.seed(3)
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    return [p.grad for p in model.parameters()], float(np.random.rand())


@pytest.mark.parametrize("policy", ["full", "selective", "selective-ops"])
def test_a_draw_on_a_later_call_stops_the_forward_and_the_step_run_again_is_exact(clock: str, policy: str) -> None:
    torch.manual_seed(0)
    reference = nn.Sequential(*(_DrawsLater() for _ in range(2)))
    model = twin(reference)
    for block in model:
        remat.wrap(block, policy=policy)
    x = torch.randn(8, 16)
    _step(model, x)  # the first calls draw nothing: remat learns so
    for block in (*model, *reference):
        block.draw = True
    model.zero_grad(set_to_none=True)
    with pytest.raises(HostDrawError, match="not on its first checkpointed call"):
        model(x)
    assert all(p.grad is None for p in model.parameters())  # stopped before any gradient
    grads, after = _step(model, x)
    expected, expected_after = _step(reference, x)
    assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))
    assert after == expected_after


def test_a_later_draw_is_wrong_without_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    # What the check prevents: the same later draw, with the clock blind, trains another function.
    monkeypatch.setattr("remat.core._host_rng.host_clock", lambda: None)
    torch.manual_seed(0)
    reference = _DrawsLater()
    model = twin(reference)
    remat.wrap(model, policy="full")
    x = torch.randn(8, 16)
    _step(model, x)
    model.draw = reference.draw = True
    grads, _ = _step(model, x)
    expected, _ = _step(reference, x)
    assert not all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))

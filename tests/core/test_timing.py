"""The profiler's time model: recomputation measured directly, forward slowdown pooled over blocks."""

import time

import pytest
import torch
from torch import nn

import remat
from remat.core._recomputing import recompute_observer
from remat.core._timing import extra_time, forward_slowdown


class Sleepy(nn.Module):
    """A tiny block whose recomputation (only) sleeps: its cost is known without timing the CPU."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.seconds = seconds

    def forward(self, x):
        if remat.is_recomputing():
            time.sleep(self.seconds)
        return torch.tanh(self.lin(x))


def test_observer_sees_every_recompute_once():
    seen = []
    record = lambda start, end: seen.append(end - start)  # noqa: E731 (host seconds by default)
    inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    outer = lambda t: torch.sin(remat.checkpoint(inner, t))  # noqa: E731
    x = torch.randn(3, 4, requires_grad=True)
    with recompute_observer(record):
        # The outer recompute reruns inner's forward (a checkpointed call again, not a recompute);
        # inner's own recompute comes later in backward: two recomputations, told apart.
        remat.checkpoint(outer, x).sum().backward()
        assert len(seen) == 2
        remat.checkpoint(inner, x, policy="selective").sum().backward()
    assert len(seen) == 3 and all(s >= 0 for s in seen)
    remat.checkpoint(inner, x).sum().backward()  # outside the context: nobody is told
    assert len(seen) == 3


def test_observer_context_restores_the_previous_one():
    outer_seen, inner_seen = [], []
    x = torch.randn(2, 4, requires_grad=True)
    lin = nn.Linear(4, 4)
    with recompute_observer(lambda *marks: outer_seen.append(marks)):
        with recompute_observer(lambda *marks: inner_seen.append(marks)):
            remat.checkpoint(lin, x).sum().backward()
        remat.checkpoint(lin, x).sum().backward()
    assert (len(inner_seen), len(outer_seen)) == (1, 1)


def test_forward_slowdown_is_pooled_and_never_negative():
    assert forward_slowdown({"keep": 2.0, "selective": 2.2, "full": 1.9}) == {
        "keep": 0.0,
        "selective": pytest.approx(0.1),
        "full": 0.0,
    }
    assert forward_slowdown({"keep": 0.0, "full": 1.0}) == {"keep": 0.0, "full": 0.0}
    assert extra_time("keep", recompute_s=1.0, fwd_s=1.0, slowdown=0.5) == 0.0
    assert extra_time("selective", recompute_s=0.3, fwd_s=2.0, slowdown=0.1) == pytest.approx(0.5)


def test_profile_charges_each_block_its_measured_recompute():
    torch.manual_seed(0)
    model = nn.Sequential(Sleepy(0.0), Sleepy(0.15), Sleepy(0.0))
    x = torch.randn(4, 8)
    prof = remat.profile(model, x, blocks=["0", "1", "2"], repeat=1, warmup=0)
    extra = {b.name: b.extra_time_s for b in prof.blocks}
    assert all(e["keep"] == 0.0 for e in extra.values())
    # sleep() guarantees the lower bound; the other blocks are a few microseconds of work
    assert extra["1"]["full"] >= 0.15 and extra["1"]["selective"] >= 0.15
    assert extra["1"]["full"] > max(extra["0"]["full"], extra["2"]["full"])
    assert prof.blocks[1].fwd_time_s < 0.15  # the forward itself does not sleep

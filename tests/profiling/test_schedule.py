"""remat.profiling._schedule: selective-ops' traced step is where selective learns its structure."""

import pytest
import torch
from conftest import measure_wrapped
from torch import nn

import remat
from remat.core._memo import STRUCTURES
from remat.core._step import training_step
from remat.profiling._schedule import trace_schedule
from remat.zoo import build


def test_schedule_learns_in_selective_ops_trace_only_when_both_are_profiled():
    assert trace_schedule(("keep", "selective", "selective-ops", "full")) == [
        ("keep", "keep", False),
        ("selective-ops", "selective", False),
        ("selective", "selective", False),
        ("full", "full", False),
    ]
    assert trace_schedule(("keep", "selective-ops", "selective")) == [
        ("keep", "keep", False),
        ("selective-ops", "selective", False),
        ("selective", "selective", False),
    ]
    assert trace_schedule(("keep", "selective", "full")) == [
        ("keep", "keep", False),
        ("selective", "selective", True),
        ("full", "full", False),
    ]
    assert trace_schedule(("keep", "selective-ops")) == [
        ("keep", "keep", False),
        ("selective-ops", "selective-ops", False),
    ]


def _costs(prof, policy):
    return (
        [(b.name, b.saved_bytes[policy], b.bwd_flops[policy]) for b in prof.blocks],
        prof.predict_peak({b.name: policy for b in prof.blocks}),
    )


@pytest.mark.parametrize("trained_before", [False, True])
def test_one_profile_of_both_selective_policies_equals_a_profile_of_each(trained_before):
    # GPT-2's blocks have cheap submodules (LayerNorm, GELU): by module and op-level keep different bytes.
    zoo = build("gpt2", layers=2, hidden=64, heads=2, seq=32, batch=2, vocab=128)
    if trained_before:  # the blocks learned their structure in training: the profile learns it again
        blocks = [m for n, m in zoo.model.named_modules() if n in ("transformer.h.0", "transformer.h.1")]
        for m in blocks:
            remat.wrap(m, policy="selective")
        for _ in range(2):
            training_step(zoo.model, zoo.inputs, zoo.loss_fn)
        assert all(m in STRUCTURES for m in blocks)
        for m in blocks:
            remat.unwrap(m)
        zoo.model.zero_grad(set_to_none=True)
    both = remat.profile(
        zoo.model, zoo.inputs, zoo.loss_fn, warmup=0, repeat=1, policies=("keep", "selective", "selective-ops", "full")
    )
    alone = {
        p: remat.profile(zoo.model, zoo.inputs, zoo.loss_fn, warmup=0, repeat=1, policies=("keep", p))
        for p in ("selective", "selective-ops")
    }
    for policy, prof in alone.items():
        assert _costs(both, policy) == _costs(prof, policy), policy
    assert _costs(both, "selective") != _costs(both, "selective-ops")  # the test can tell them apart


class _GeluBlock(nn.Module):
    """Its activation a submodule: selective by module learns it as a cheap region."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


class _SharedTwice(nn.Module):
    """One block called twice per step (weight sharing)."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.first, self.shared, self.last, self.head = _GeluBlock(d), _GeluBlock(d), _GeluBlock(d), nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        x = self.shared(self.shared(x))
        return self.head(self.last(x)).logsumexp(-1).mean()


@pytest.mark.parametrize("others", ["keep", "full"])
def test_selective_ops_of_a_block_called_twice_is_traced_op_level_on_both_calls(others):
    # selective-ops' traced step runs the blocks under "selective" (they learn on the side): a block's second
    # call in that step must not take the by-module path its first call just learned.
    torch.manual_seed(0)
    model, x = _SharedTwice(), torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(1))
    prof = remat.profile(model, x, warmup=0, repeat=1)
    assignment = {"first": others, "shared": "selective-ops", "last": others}
    assert prof.predict_peak(assignment) == measure_wrapped(model, x, assignment).peak_bytes

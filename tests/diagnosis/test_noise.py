"""The doctor on models whose step without checkpointing differs from itself (remat.diagnosis._noise)."""

from __future__ import annotations

import itertools
import json
import warnings

import torch
import torch.utils.checkpoint as tc
from conftest import assert_state_equal
from torch import nn

import remat
from remat.core._state import capture
from remat.diagnosis._findings import StepRecord
from remat.diagnosis._noise import differences

# Counts forwards of the model itself (a counter the doctor cannot snapshot, as it restores lists it sees).
FORWARDS = itertools.count()


def diagnose(model, inputs, **options):
    options.setdefault("measure_cost", False)
    before = capture(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = remat.doctor(model, inputs, lambda out: out.sum(), **options)
    assert not caught, [str(w.message) for w in caught]
    assert_state_equal(before, capture(model))
    json.dumps(report.to_dict())
    return report


class Reseeding(nn.Module):
    """Re-seeds the global generator from the OS each step, as Hugging Face's Reformer does in training,
    then draws dropout inside a correct checkpoint (the RNG state is preserved)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.block = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Dropout(0.5), nn.Linear(32, 16))

    def forward(self, x):
        self.seed = torch.seed()  # kept, as Reformer keeps its layers' seeds for their backward
        return tc.checkpoint(self.block, self.inp(x), use_reentrant=False)


def test_a_model_that_reseeds_is_not_blamed_on_its_checkpointing():
    torch.manual_seed(0)
    report = diagnose(Reseeding(), torch.randn(8, 16))
    # Before: wrong-gradients and rng-stream-changed, though the checkpoint is correct.
    assert report.codes() == ["not-reproducible"], report.codes()
    assert not report.errors
    (finding,) = report.findings
    # torch.seed() draws from the OS: the masks, and so the order (worst first), differ from run to run
    noisy = {"inp.weight", "inp.bias", "block.0.weight", "block.0.bias", "block.3.weight"}
    assert set(finding.params) == noisy  # block.3.bias's gradient does not depend on the mask: still compared
    assert set(finding.modules) == {"block.0", "inp", "block.3"} and finding.numbers["params"] == 5
    listed = finding.message.split("the gradients of 5 parameters (")[1].split(")")[0]
    assert set(listed.split(", ")) == {"block.0", "inp", "block.3.weight"}
    assert finding.numbers["rng_streams"] == 1.0
    assert finding.numbers["python"] == 1 and "1 Python attribute (<root>.seed)" in finding.message
    assert "random number streams" in finding.message and "torch.seed()" in finding.fix


_CALLS = itertools.count(1)


class NoisyBranchAndRealBug(nn.Module):
    """Branch ``a`` is scaled by a global counter the doctor cannot restore; branch ``b`` recomputes dropout
    with preserve_rng_state=False, a real bug that must still be found."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.Linear(32, 16))

    def forward(self, x):
        scale = float(next(_CALLS))
        return self.a(x) * scale + tc.checkpoint(self.b, x, use_reentrant=False, preserve_rng_state=False)


def test_noise_in_one_branch_leaves_the_real_bug_in_the_other_found():
    torch.manual_seed(0)
    report = diagnose(NoisyBranchAndRealBug(), torch.randn(8, 16))
    assert set(report.codes()) == {"wrong-gradients", "rng-not-preserved", "rng-stream-changed", "not-reproducible"}
    wrong = next(f for f in report.findings if f.code == "wrong-gradients")
    assert "b.0.weight" in wrong.params and not any(p.startswith("a.") for p in wrong.params)
    noise = next(f for f in report.findings if f.code == "not-reproducible")
    assert set(noise.params) == {"a.weight", "a.bias"} and noise.modules == ("a",)
    assert noise.numbers["rng_streams"] == 0.0  # the counter is not a random stream: that check still ran
    assert report.codes().index("not-reproducible") > report.codes().index("rng-stream-changed")


class Clean(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.block = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, x):
        next(FORWARDS)
        return tc.checkpoint(self.block, self.inp(x), use_reentrant=False)


class RealBug(Clean):
    def forward(self, x):
        next(FORWARDS)
        # Reentrant on raw data, as seed 000: the output needs no grad, so nothing inside is trained.
        return tc.checkpoint(lambda t: self.block(self.inp(t)), x, use_reentrant=True) + self.inp.bias.sum()


def test_the_extra_plain_step_runs_only_when_the_steps_differ():
    start = next(FORWARDS)
    assert diagnose(Clean(), torch.randn(8, 16)).codes() == []
    middle = next(FORWARDS)
    assert middle - start == 3  # two steps, and the next() above
    report = diagnose(RealBug(), torch.randn(8, 16))
    assert next(FORWARDS) - middle == 4  # three steps
    assert "frozen-by-checkpoint" in report.codes() and "not-reproducible" not in report.codes()


def _record(**changes) -> StepRecord:
    base = dict(
        loss=1.0,
        grads={"w": torch.ones(3), "v": None},
        buffers={"n": torch.zeros(2)},
        python={("m", "t"): float("nan")},
        calls=[],
        forward_calls={},
        backward_calls={},
        completed={},
        rng=[torch.arange(4)],
    )
    return StepRecord(**{**base, **changes})


def test_differences_see_each_kind_and_nothing_else():
    same = differences(_record(), _record(), 1e-4, 1e-6)
    assert not same  # NaN equals NaN, None equals None
    assert differences(_record(), _record(grads={"w": torch.ones(3) * (1 + 1e-5), "v": None}), 1e-4, 1e-6).grads == ()
    d = differences(_record(), _record(grads={"w": torch.ones(3) * 2, "v": torch.ones(1)}), 1e-4, 1e-6)
    assert d.grads == ("v", "w") and d.max_grad_error == float("inf")  # one gets a gradient only once: worst
    assert differences(_record(), _record(buffers={"n": torch.ones(2)}), 1e-4, 1e-6).buffers == ("n",)
    assert differences(_record(), _record(python={("m", "t"): 1.0}), 1e-4, 1e-6).python == (("m", "t"),)
    assert differences(_record(), _record(rng=[torch.arange(4) + 1]), 1e-4, 1e-6).rng
    assert not differences(_record(), _record(grads={"w": torch.ones(3), "v": torch.zeros(1)}), 1e-4, 1e-6)

"""Property tests: the budget holds on generated models whose data flow is not a chain.

Each generated model mixes what real models do: a tensor built in forward and given to
every block (added or multiplied in), long skips (a block's input is the sum of the
previous output and one from two blocks back), blocks that also return an auxiliary
loss term, dropout, BatchNorm, and planning in eval mode. Properties (issue #21):

* the peak model never under-predicts a mixed assignment; it is exact within 0.5%
  without auxiliary outputs, and within 5% with them (NOTE [Where a recomputation
  runs]: an early recomputation is replayed at its position in the segment that hosts
  it, on the safe side where that position is ambiguous);
* every plan ``remat.auto`` returns measures within its budget, and a lower budget
  never gives a higher measured peak.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import remat

POLICIES = ("keep", "selective", "full")
AUX_SLACK = 0.05


class GenBlock(nn.Module):
    def __init__(self, d: int, mult: int, drop: float, bn: bool, shared: str | None, aux: bool) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, mult * d), nn.Linear(mult * d, d)
        self.drop = nn.Dropout(drop)
        self.bn = nn.BatchNorm1d(d) if bn else None
        self.shared, self.aux = shared, aux

    def forward(self, x: torch.Tensor, shared: torch.Tensor | None = None) -> torch.Tensor | tuple:
        h = self.fc1(x)
        if self.shared == "add":
            h = h + shared
        elif self.shared == "mul":
            h = h * shared
        y = self.fc2(self.drop(nn.functional.gelu(h)))
        if self.bn is not None:
            y = self.bn(y.transpose(1, 2)).transpose(1, 2)
        y = x + y
        return (y, y.pow(2).mean()) if self.aux else y


class GenModel(nn.Module):
    def __init__(self, spec: dict) -> None:
        super().__init__()
        d, mult = spec["d"], spec["mult"]
        self.blocks = nn.ModuleList(
            GenBlock(d, mult, spec["drop"], bn, shared if spec["shared"] else None, aux)
            for bn, shared, aux in spec["blocks"]
        )
        self.shared = nn.Linear(d, mult * d) if spec["shared"] else None
        self.skip = spec["skip"]
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared(x) if self.shared is not None else None
        outs, aux = [], 0.0
        for i, block in enumerate(self.blocks):
            inp = x + outs[i - 2] if self.skip and i >= 2 else x
            out = block(inp, shared) if block.shared else block(inp)
            if isinstance(out, tuple):
                out, term = out
                aux = aux + term
            outs.append(out)
            x = out
        return self.head(x).logsumexp(-1).mean() + 0.01 * aux


block_specs = st.tuples(st.booleans(), st.sampled_from(["add", "mul"]), st.booleans())
model_specs = st.fixed_dictionaries(
    {
        "d": st.sampled_from([16, 32]),
        "mult": st.sampled_from([2, 4]),
        "drop": st.sampled_from([0.0, 0.1]),
        "shared": st.booleans(),
        "skip": st.booleans(),
        "eval": st.booleans(),
        "blocks": st.lists(block_specs, min_size=3, max_size=5),
    }
)
SETTINGS = settings(
    max_examples=8,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _build(spec: dict) -> tuple[GenModel, torch.Tensor]:
    torch.manual_seed(0)
    model = GenModel(spec)
    if spec["eval"]:
        model.eval()  # as from_pretrained returns it; remat profiles in training mode
    return model, torch.randn(2, 32, spec["d"], generator=torch.Generator().manual_seed(1))


def _measured(model: nn.Module, x: torch.Tensor, assignment: dict[str, str]) -> int:
    for name, policy in assignment.items():
        remat.wrap(model.get_submodule(name), policy=policy)
    return _measured_as_applied(model, x)


def _measured_as_applied(model: nn.Module, x: torch.Tensor) -> int:
    """Peak of a training step with the plan auto put on ``model``, which is then removed."""
    mode = model.training
    try:
        model.train()
        return remat.measure(model, x, repeat=1, warmup=0).peak_bytes
    finally:
        remat.remove(model)
        model.train(mode)


@SETTINGS
@given(
    spec=model_specs,
    picks=st.lists(st.lists(st.sampled_from(POLICIES), min_size=5, max_size=5), min_size=3, max_size=3),
)
def test_the_peak_model_never_under_predicts(spec: dict, picks: list[list[str]]) -> None:
    model, x = _build(spec)
    prof = remat.profile(model, x, repeat=1, warmup=0)
    names = [b.name for b in prof.blocks]
    assert len(names) == len(spec["blocks"])
    for pick in picks:
        assignment = dict(zip(names, pick))
        predicted, measured = prof.predict_peak(assignment), _measured(model, x, assignment)
        assert measured <= predicted, (assignment, predicted, measured)
        # Aux outputs: their early recomputation is replayed at its position in the segment hosting it
        # (NOTE [Where a recomputation runs]); once charged at the segment's peak (up to +30%). Where it
        # begins among ops that allocate nothing is taken on the safe side: a 30-example search found
        # +2.5% (2172 B on a 16-wide model), so aux models get a 5% slack.
        slack = AUX_SLACK if any(aux for _, _, aux in spec["blocks"]) else 0.005
        assert predicted - measured <= slack * measured, (assignment, predicted, measured)


@SETTINGS
@given(spec=model_specs)
def test_auto_keeps_every_budget_and_lower_budgets_never_measure_higher(spec: dict) -> None:
    model, x = _build(spec)
    measured_peaks = []
    for budget in (0.85, 0.6):
        try:
            plan = remat.auto(model, x, budget, repeat=1, warmup=0)
        except remat.RematError as exc:
            assert "measured" in str(exc) or "below the lowest peak" in str(exc)
            break
        measured = _measured_as_applied(model, x)  # nested segments included
        assert plan.measured_peak_bytes == measured <= plan.budget_bytes
        measured_peaks.append(measured)
    assert measured_peaks == sorted(measured_peaks, reverse=True)


@pytest.mark.parametrize("aux", [False, True])
def test_a_generated_model_is_planned_in_training_mode(aux: bool) -> None:
    spec = {
        "d": 16,
        "mult": 2,
        "drop": 0.1,
        "shared": True,
        "skip": True,
        "eval": True,
        "blocks": [(False, "add", aux), (True, "mul", False), (False, "add", aux)],
    }
    model, x = _build(spec)
    prof = remat.profile(model, x, repeat=1, warmup=0)
    assert prof.training and not model.training
    assert prof.predict_peak({}) == _measured(model, x, {})

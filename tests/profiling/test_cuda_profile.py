"""Real profiles on CUDA count what the allocator counts (skipped without CUDA).

Predicted peaks within 1% of ``remat.measure`` (``torch.cuda.max_memory_allocated``),
and plans at 0.8 / 0.6 / 0.45 of the un-checkpointed peak never over their budget.
"""

import pytest
import torch
from conftest import measure_assignment

import remat
from remat.zoo import build

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
MODELS = {"gpt2": {}, "llama": {}}  # zoo defaults: 6 blocks each


def _on_cuda(name):
    pytest.importorskip("transformers")
    zoo = build(name, **MODELS[name])
    zoo.model.to("cuda")
    zoo.inputs = {k: v.to("cuda") for k, v in zoo.inputs.items()}
    return zoo


def _measured(zoo, assignment):
    return measure_assignment(zoo, assignment, warmup=1)


@pytest.mark.parametrize("name", list(MODELS))
def test_allocator_level_profile_on_cuda(name):
    zoo = _on_cuda(name)
    prof = remat.profile(zoo.model, zoo.inputs, zoo.loss_fn, repeat=2, warmup=1)
    names = [b.name for b in prof.blocks]
    for assignment in (
        {},
        {n: "full" for n in names},
        {n: "selective" for n in names},
        {n: ("full", "keep")[i % 2] for i, n in enumerate(names)},
    ):
        measured = _measured(zoo, assignment).peak_bytes
        predicted = prof.predict_peak(assignment)
        assert abs(predicted - measured) <= 0.01 * measured, (assignment, predicted, measured)
    for fraction in (0.8, 0.6, 0.45):
        plan = remat.plan(prof, fraction)
        measured = _measured(zoo, plan.assignment).peak_bytes
        assert measured <= plan.budget_bytes, (fraction, measured, plan.budget_bytes)
        assert abs(plan.predicted_peak_bytes - measured) <= 0.01 * measured, (
            fraction,
            plan.predicted_peak_bytes,
            measured,
        )

"""remat.auto for compiled execution: the budget holds for the compiled step, measured."""

import json

import pytest
import torch

import remat
from remat import zoo
from remat.core.measure import compiled_peak

#: Activations (attention maps with dropout) outweigh the weights, so a budget needs checkpointing.
GPT2 = {"layers": 3, "hidden": 32, "heads": 2, "vocab": 64, "seq": 128, "batch": 4}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_auto_compiled_plan_holds_its_budget_under_compile():
    built = zoo.build("gpt2", **GPT2)
    plan = remat.auto(built.model, built.inputs, budget=0.7, compiled="aot_eager")
    assert plan.execution == "compiled" and plan.checkpointed
    measured = compiled_peak(built.model, built.inputs, None, backend="aot_eager")
    assert measured == plan.measured_peak_bytes  # the figure auto verified is the compiled step's
    assert measured <= plan.budget_bytes
    # The budget is a fraction of the compiled step's peak without checkpointing, which is below eager's.
    assert plan.budget_bytes / 0.7 < 0.9 * plan.baseline_peak_bytes
    assert remat.Plan.from_json(plan.to_json()).execution == "compiled"


def test_plan_json_without_execution_loads_as_eager():
    built = zoo.build("gpt2", **{**GPT2, "seq": 16})
    plan = remat.plan(remat.profile(built.model, built.inputs), strategy="all")
    data = json.loads(plan.to_json())
    del data["execution"]
    data["schema"] = 2
    assert remat.Plan.from_json(json.dumps(data)).execution == "eager"


@pytest.mark.parametrize("options", [{"verify": False}, {"fake": True}])
def test_auto_compiled_needs_a_verified_real_step(options):
    built = zoo.build("gpt2", **{**GPT2, "seq": 16})
    before = {n: p.detach().clone() for n, p in built.model.named_parameters()}
    with pytest.raises(remat.RematError, match="compiled=True verifies every candidate"):
        remat.auto(built.model, built.inputs, budget=0.7, compiled=True, **options)
    assert all(torch.equal(before[n], p) for n, p in built.model.named_parameters())
    assert not any(remat.is_wrapped(m) for m in built.model.modules())

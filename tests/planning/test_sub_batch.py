"""auto below every one-level plan, on a device that fits only nested ones: its reference runs on a slice.

NOTE [A reference on a slice of the batch] in remat.planning._sub_batch.
"""

import copy
import logging

import pytest
import torch
from _device import SimulatedDevice, resting
from conftest import gpu_for
from test_verify import Block, Collects, _untouched
from torch import nn

import remat
from remat.planning import _candidates
from remat.planning import apply as apply_module
from remat.planning._sub_batch import batch_size, reference_batch, sliced
from remat.profiling import _assemble


class Looped(nn.Module):
    """Seed 002's model: one parameter, a function of small ops looped in ``forward``, no submodules."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(24):
            for _ in range(4):
                x = x + self.a
            x = x.tanh()
        return x


def _chain():
    torch.manual_seed(0)
    return nn.Sequential(*(Block() for _ in range(12))), torch.randn(32, 32, 32)


def _vgg():
    # one level saves nothing on single layers, and each ReLU(inplace=True) writes its input: nested plans only
    torch.manual_seed(0)
    layers = []
    for c_in, c_out in ((3, 8), (8, 8), (8, 16)):
        layers += [nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)), torch.randn(8, 3, 32, 32)


def _looped():
    torch.manual_seed(0)
    return Looped(), torch.randn(64, 128)


def _grads(model, x):
    model.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    loss.backward()
    out = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), out


def _floors(model, x):
    prof = remat.profile(model, x, fake=True, target="cpu")
    nested = remat.plan(prof, strategy="none").min_peak_bytes
    return nested, remat.plan(prof, strategy="none", nested=False).min_peak_bytes


@pytest.mark.parametrize("build", [_chain, _vgg, _looped], ids=["chain", "flat-conv", "seed-002"])
def test_a_device_only_nested_plans_fit_gets_a_verified_plan_within_it(build):
    model, x = build()
    nested, one_level = _floors(model, x)
    assert nested < one_level
    budget = (nested + one_level) // 2
    loss, reference = _grads(model, x)
    device = SimulatedDevice(budget, resting(model, x), snapshots_on_host=True)  # a GPU's: no OOM is expected
    with device:
        plan = remat.auto(model, x, budget, repeat=1, warmup=0)
    try:
        assert plan.segments and device.peak <= budget and not device.refused, (device.peak, budget)
        assert plan.measured_peak_bytes <= budget
        assert any("on the first" in n and "samples" in n for n in plan.notes), plan.notes
        assert any(n.startswith("Verified:") and "on the first" in n for n in plan.notes), plan.notes
        got_loss, got = _grads(model, x)
        assert torch.equal(loss, got_loss) and all(torch.equal(reference[n], got[n]) for n in reference)
    finally:
        remat.remove(model)


class Tabled(nn.Module):
    """Flux's inputs: each sample's tokens, and a table of one row per token every sample reads."""

    def __init__(self, n: int = 12, d: int = 32) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(d) for _ in range(n)))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.blocks(x + ids)


def test_a_table_every_sample_reads_is_handed_whole_to_the_slice():
    # Each input had to share the first dimension: Flux's img_ids (a row per token) left its reference unsliced.
    torch.manual_seed(0)
    model, batch = Tabled(), {"x": torch.randn(32, 24, 32), "ids": torch.randn(24, 32)}
    prof = remat.profile(model, batch, fake=True, target="cpu")
    nested = remat.plan(prof, strategy="none").min_peak_bytes
    budget = (nested + remat.plan(prof, strategy="none", nested=False).min_peak_bytes) // 2
    reference = copy.deepcopy(model)
    reference(**batch).square().mean().backward()
    device = SimulatedDevice(budget, resting(model, *batch.values()), snapshots_on_host=True)
    with device:
        plan = remat.auto(model, batch, budget, repeat=1, warmup=0)
    try:
        assert plan.segments and device.peak <= budget and not device.refused, (device.peak, budget)
        assert any(n.startswith("Verified:") and "on the first" in n for n in plan.notes), plan.notes
        model(**batch).square().mean().backward()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters(), strict=True))
    finally:
        remat.remove(model)


def test_without_a_slice_the_reference_runs_out_where_only_nested_plans_fit(monkeypatch):
    # What the slice is for: the whole batch's reference does not fit the same device.
    monkeypatch.setattr(_candidates, "reference_batch", lambda *args: None)
    model, x = _looped()
    nested, one_level = _floors(model, x)
    budget = (nested + one_level) // 2
    device = SimulatedDevice(budget, resting(model, x))
    with device, pytest.raises(remat.RematError, match="ran out of device memory") as err:
        remat.auto(model, x, budget, repeat=1, warmup=0)
    assert "not compared on a slice" not in str(err.value) and device.refused
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_a_nested_plan_that_computes_another_function_is_caught_on_the_slice(monkeypatch, caplog):
    # The profile misses the parent's reads (as in test_verify); the comparison on the slice catches the segments.
    torch.manual_seed(0)
    model, x = Collects(), torch.randn(32, 32, 32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    monkeypatch.setattr(_assemble, "_unchained", lambda *args: ())
    prof = remat.profile(model, x, fake=True, target="cpu")
    nested = remat.plan(prof, strategy="none").min_peak_bytes
    one_level = remat.plan(prof, strategy="none", nested=False).min_peak_bytes
    budget = (nested + one_level) // 2
    monkeypatch.setattr(apply_module, "make_profile", lambda *a, **k: prof)
    device = SimulatedDevice(budget, resting(model, x))
    with caplog.at_level(logging.INFO, logger="remat"), device, pytest.raises(remat.RematError, match="cannot be met"):
        remat.auto(model, x, budget)
    assert any("changed the step's loss and gradients" in r.getMessage() for r in caplog.records)
    assert device.peak <= budget and _untouched(model, before)


def test_a_slice_that_runs_out_is_halved(monkeypatch):
    model, x = _looped()
    nested, one_level = _floors(model, x)
    budget = (nested + one_level) // 2
    asked = []

    def too_many(batch, predicted, fixed, limit):  # the whole batch less one: over the device
        asked.append(batch)
        return batch - 1

    monkeypatch.setattr(_candidates, "reference_batch", too_many)
    device = SimulatedDevice(budget, resting(model, x))
    with device:
        plan = remat.auto(model, x, budget, repeat=1, warmup=0)
    try:
        assert asked == [64] and device.refused and device.peak <= budget
        assert any("on the first 31 of the batch's 64 samples" in n for n in plan.notes), plan.notes
    finally:
        remat.remove(model)


def _loss_of_the_whole_batch(x):
    """A loss that closes over a target of the whole batch (a VAE's reconstruction loss): it fails on a slice."""
    target = torch.randn_like(x)
    return lambda out: (out - target).square().mean()


def test_a_loss_fn_of_the_whole_batch_is_compared_on_the_whole_batch():
    # NOTE [A step that depends on the batch size]: the sliced reference raised a shape mismatch, and auto said
    # the user's training step had failed.
    model, x = _chain()
    loss_fn = _loss_of_the_whole_batch(x)
    nested, one_level = _floors(model, x)
    budget = (nested + one_level) // 2
    ref = copy.deepcopy(model)
    ref_loss = loss_fn(ref(x))
    ref_loss.backward()
    plan = remat.auto(model, x, budget, loss_fn=loss_fn, repeat=1, warmup=0)
    try:
        assert plan.segments and plan.measured_peak_bytes <= budget
        assert any("on the whole batch, over the budget: the step on its first" in n for n in plan.notes), plan.notes
        assert any(n.startswith("Verified:") and "on the first" not in n for n in plan.notes), plan.notes
        loss = loss_fn(model(x))
        loss.backward()
        assert torch.equal(loss, ref_loss)
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    finally:
        remat.remove(model)


def test_a_loss_fn_of_the_whole_batch_on_a_device_only_nested_plans_fit_says_why_there_is_no_slice():
    model, x = _chain()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    nested, one_level = _floors(model, x)
    budget = (nested + one_level) // 2
    device = SimulatedDevice(budget, resting(model, x))
    with device, pytest.raises(remat.RematError, match="ran out of device memory") as err:
        remat.auto(model, x, budget, loss_fn=_loss_of_the_whole_batch(x), repeat=1, warmup=0)
    assert "not on a slice: the step on its first" in str(err.value) and "batch size" in str(err.value)
    assert device.refused and _untouched(model, before)


def test_the_batch_is_the_first_dimension_most_inputs_share():
    x, mask = torch.randn(4, 3), torch.ones(4, 7)
    assert batch_size({"x": x, "mask": mask, "step": torch.tensor(3), "n": 2}) == 4
    assert batch_size((x, mask, torch.ones(9, 3), torch.ones(1, 9))) == 4  # tables every sample reads
    assert batch_size((x, torch.ones(9, 1))) == 4  # as many inputs: the first dimension of more elements
    assert batch_size((x, torch.ones(6, 2))) is None  # as many inputs and elements
    assert batch_size((torch.tensor(1.0),)) is None
    leaf, table = torch.randn(4, 3, requires_grad=True), torch.ones(9, 3)
    cut = sliced({"x": leaf, "ids": table, "step": torch.tensor(3)}, 2, 4)
    assert cut["x"].shape == (2, 3) and cut["x"].is_leaf and cut["x"].requires_grad
    assert cut["x"].untyped_storage().data_ptr() == leaf.untyped_storage().data_ptr()  # a view: no new bytes
    assert cut["ids"] is table and cut["step"].dim() == 0


def test_the_slice_is_sized_for_the_budget_above_the_fixed_bytes():
    # 1000 fixed bytes, 8000 more on 64 samples: 4000 of room (less a tenth) holds 28 samples
    assert reference_batch(64, 9000, 1000, 5000) == 28
    assert reference_batch(64, 4000, 1000, 5000) == 64  # the whole batch fits
    assert reference_batch(64, 9000, 1000, 1000) is None  # no room above the fixed bytes
    assert reference_batch(64, 9000, 1000, 1050) is None  # not one sample's worth
    # one sample's worth is a slice: batches of 2 or 3 have one (NOTE [A reference on a slice of the batch])
    assert reference_batch(64, 9000, 1000, 1200) == 1 and reference_batch(64, 9000, 1000, 1300) == 2
    assert reference_batch(2, 9000, 1000, 6000) == 1 and reference_batch(1, 9000, 1000, 6000) is None
    assert reference_batch(64, 9000, 1000, 8999) == 32  # at most half: a slice is only taken below the whole


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpu_only_nested_plans_fit_gets_a_verified_plan_within_it(on_a_smaller_gpu):
    # A VGG-style flat chain of tens of MiB (the caching allocator's rounding small beside it), deterministic
    # kernels (no adaptive pooling, whose CUDA backward is not), capped between its nested and one-level floors.
    torch.manual_seed(0)
    layers = []
    for c_in, c_out in ((3, 32), (32, 32), (32, 64), (64, 64)):
        layers += [nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)]
    model = nn.Sequential(*layers, nn.Conv2d(64, 1, 1), nn.Flatten(), nn.Linear(64 * 64, 10)).cuda()
    x = torch.randn(16, 3, 64, 64, device="cuda")
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        loss, reference = _grads(model, x)
        prof = remat.profile(model, x, repeat=1, warmup=0)
        nested = remat.plan(prof, strategy="none").min_peak_bytes
        one_level = remat.plan(prof, strategy="none", nested=False).min_peak_bytes
        budget = (nested + one_level) // 2
        on_a_smaller_gpu(gpu_for(budget))
        plan = remat.auto(model, x, budget, repeat=1, warmup=0)
        try:
            assert torch.cuda.max_memory_allocated() <= budget + (budget >> 5)
            assert plan.segments and plan.measured_peak_bytes <= budget
            assert any("on the first" in n for n in plan.notes), plan.notes
            got_loss, got = _grads(model, x)
            assert torch.equal(loss, got_loss) and all(torch.equal(reference[n], got[n]) for n in reference)
        finally:
            remat.remove(model)
    finally:
        torch.use_deterministic_algorithms(deterministic)

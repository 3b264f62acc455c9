"""remat.auto's verification: a plan it applies fits its budget and trains the same function.

NOTE [A verified plan trains the same function] in remat.planning._verify; the segments'
own refusals in remat.core._segment, what the profile sees in remat.planning._nested.
"""

import copy
import dataclasses
import logging

import pytest
import torch
from torch import nn

import remat
from remat.core._segment import NotAChain
from remat.planning import _verify_step as step_module
from remat.planning import apply as apply_module
from remat.profiling import _assemble


class Block(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(x)))


class Offsets(nn.Module):
    """The parent writes each block's output in place before the next block (``x += offset``)."""

    def __init__(self, n: int = 8, d: int = 32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.offsets = nn.Parameter(torch.randn(n, d) * 0.1)
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x)
            x += self.offsets[i]
        return self.head(x).logsumexp(-1).mean()


class Collects(nn.Module):
    """The parent sums every block's output into the loss (deep supervision, hidden states)."""

    def __init__(self, n: int = 8, d: int = 32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = []
        for block in self.blocks:
            x = block(x)
            hidden.append(x)
        return self.head(x).logsumexp(-1).mean() + 0.1 * sum(h.mean() for h in hidden[:-1])


class Noisy(Block):
    """A block whose recomputation is another function: it scales its input only when recomputed (as a forward
    with a side effect recomputation repeats would; draws from Python's generator are replayed now: NOTE [Host
    generators in recomputation])."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x * (1.5 if remat.is_recomputing() else 1.0))  # what fc1 keeps differs


def _x() -> torch.Tensor:
    return torch.randn(32, 32, 32)


def _floors(prof: remat.Profile) -> tuple[int, int]:
    """(the nested floor were the chain pure, the one-level floor)."""
    pure = dataclasses.replace(prof, unchained=())
    return (
        remat.plan(pure, strategy="none").min_peak_bytes,
        remat.plan(prof, strategy="none", nested=False).min_peak_bytes,
    )


def _nested_plan(prof: remat.Profile, first: str, last: str) -> remat.Plan:
    keep = remat.plan(prof, strategy="none", nested=False)
    return dataclasses.replace(keep, assignment={**keep.assignment, last: "full"}, segments=((first, last),))


def _untouched(model: nn.Module, before: dict) -> bool:
    no_forward = not any("forward" in m.__dict__ for m in model.modules())
    return no_forward and all(torch.equal(p, before[n]) and p.grad is None for n, p in model.named_parameters())


def test_the_profile_sees_a_parent_that_writes_block_outputs_in_place():
    torch.manual_seed(0)
    model = Offsets()
    prof = remat.profile(model, _x(), repeat=1, warmup=0)
    assert prof.unchained == tuple(f"blocks.{i}" for i in range(7))
    nested_floor, one_level = _floors(prof)
    assert nested_floor < one_level  # a pure chain would nest; this one does not
    assert remat.plan(prof, strategy="none").min_peak_bytes == one_level


def test_a_segment_refuses_an_in_place_write_between_its_blocks():
    torch.manual_seed(0)
    model = Offsets()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    prof = remat.profile(model, _x(), repeat=1, warmup=0)
    plan = _nested_plan(prof, "blocks.2", "blocks.5")
    # the profile saw the writes: apply refuses the plan and leaves the model as it was
    with pytest.raises(NotAChain, match="read outside the next block"):
        remat.apply(model, plan)
    assert _untouched(model, before)
    # a plan that does not carry them (made by hand, or from another profile) is refused as the segment runs
    remat.apply(model, dataclasses.replace(plan, unchained=()))
    try:
        with pytest.raises(NotAChain, match="unchanged"):
            model(_x())
    finally:
        remat.remove(model)


def test_auto_refuses_a_budget_only_a_wrong_nested_plan_reaches():
    # Below the one-level floor only a nested plan fits, and on this parent a segment
    # computes another function: auto refuses instead of training it.
    torch.manual_seed(0)
    model, x = Offsets(), _x()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    prof = remat.profile(model, x, repeat=1, warmup=0)
    nested_floor, one_level = _floors(prof)
    with pytest.raises(remat.RematError, match="cannot be met"):
        remat.auto(model, x, (nested_floor + one_level) // 2, repeat=1, warmup=0)
    assert _untouched(model, before)


def test_auto_compares_gradients_where_the_profile_missed_a_read(monkeypatch, caplog):
    # The profile's view of the parent is the first guard; the gradient comparison is the last.
    torch.manual_seed(0)
    model, x = Collects(), _x()
    monkeypatch.setattr(_assemble, "_unchained", lambda *args: ())
    prof = remat.profile(model, x, repeat=1, warmup=0)
    nested_floor, one_level = _floors(prof)
    assert nested_floor < one_level
    monkeypatch.setattr(apply_module, "make_profile", lambda *a, **k: prof)
    with caplog.at_level(logging.INFO, logger="remat"), pytest.raises(remat.RematError, match="cannot be met") as e:
        remat.auto(model, x, (nested_floor + one_level) // 2)
    assert any("changed the step's loss and gradients" in r.getMessage() for r in caplog.records)
    # only nested plans reach the budget: the error says why there are none
    assert "changed the step's loss and gradients" in str(e.value) and "one level deep" in str(e.value)
    assert not any("forward" in m.__dict__ for m in model.modules())


class DrawsBetween(nn.Module):
    """The parent draws a random number after each block (a noise term of its own), and the blocks use dropout: a
    nested segment recomputes its blocks' draws after the parent's, so its step computes other masks."""

    def __init__(self, n: int = 16, d: int = 64) -> None:
        super().__init__()

        def block() -> nn.Module:  # two sub-layers of layers: full-fine has something to checkpoint
            return nn.Sequential(
                nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Dropout(0.1)), nn.Sequential(nn.Linear(d, d), nn.Tanh())
            )

        self.blocks = nn.ModuleList(block() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = x.new_zeros(())
        for block in self.blocks:
            x = block(x)
            noise = noise + torch.rand(())
        return x.square().mean() + 0.01 * noise


def test_auto_says_why_plans_were_one_level_when_the_finer_try_fails_too():
    # Only nested plans reach the budget, and they compute other masks: auto goes finer (full-fine), which does
    # not reach it either. The error of that last try once said only that the budget was below every plan.
    torch.manual_seed(0)
    model, x = DrawsBetween().train(), torch.randn(512, 64)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    fine = remat.profile(model, x, repeat=1, warmup=0, policies=("keep", "full", "full-fine"))
    nested_floor = remat.plan(fine, strategy="none").min_peak_bytes
    one_level = remat.plan(fine, strategy="none", nested=False).min_peak_bytes
    assert nested_floor < 0.8 * one_level and apply_module.may_go_finer(model, None, None, {})  # the premise
    with pytest.raises(remat.RematError, match="cannot be met") as e:
        remat.auto(model, x, (nested_floor + one_level) // 2, repeat=1, warmup=0)
    assert "changed the step's loss and gradients" in str(e.value) and "one level deep" in str(e.value)
    assert str(e.value).count("changed the step's") == 1
    assert isinstance(e.value.__context__, remat.RematError)  # the finer try's error: it ran
    assert _untouched(model, before)


def test_auto_refuses_a_one_level_plan_that_changes_the_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(*(Noisy() for _ in range(4)))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(remat.RematError, match=r"differed from the step without checkpointing.*gradients of") as err:
        remat.auto(model, _x(), 0.6, repeat=1, warmup=0)
    assert "left without checkpointing" in str(err.value)
    assert _untouched(model, before)


def test_auto_compares_plans_with_the_step_without_checkpointing_on_a_slice_of_the_batch():
    # Below the peak without checkpointing the reference was the lowest-peak plan (every block full here), which
    # recomputes as wrongly as the plan at the floor: auto applied a verified plan training another function.
    # NOTE [The step verified plans are compared with]
    torch.manual_seed(0)
    model, x = nn.Sequential(*(Noisy() for _ in range(4))), _x()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    options = {"repeat": 1, "warmup": 0, "policies": ("keep", "full")}
    floor = remat.plan(remat.profile(model, x, **options), strategy="none", nested=False).min_peak_bytes
    pattern = r"differed from the step without checkpointing, on the first \d+ of the batch's 32 samples"
    with pytest.raises(remat.RematError, match=pattern + r" \(first: grad:0.fc1.bias; gradients of 0, 1, 2\)"):
        remat.auto(model, x, floor, **options)
    assert _untouched(model, before)


def _assert_trains_as(twin: nn.Module, model: nn.Module, x: torch.Tensor) -> None:
    """``model``'s step (under its plan) gives every gradient ``twin``'s (without checkpointing) gives."""
    for net in (twin, model):
        torch.manual_seed(1)
        net(x).square().mean().backward()
    for (n, a), (_, b) in zip(twin.named_parameters(), model.named_parameters()):
        assert torch.equal(a.grad, b.grad), n


def test_a_batch_of_three_is_compared_on_one_sample():
    # A slice had two samples at least: batches of 2 or 3 (long-sequence fine-tuning) were compared with the
    # lowest-peak plan, which at the floor is the plan itself: a block recomputing another function passed.
    torch.manual_seed(0)
    model, x = nn.Sequential(*(Noisy() for _ in range(4))), torch.randn(3, 512, 32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    options = {"repeat": 1, "warmup": 0, "policies": ("keep", "full")}
    floor = remat.plan(remat.profile(model, x, **options), strategy="none", nested=False).min_peak_bytes
    pattern = r"differed from the step without checkpointing, on the first 1 of the batch's 3 samples"
    with pytest.raises(remat.RematError, match=pattern):
        remat.auto(model, x, floor, **options)
    assert _untouched(model, before)


def test_where_the_batch_cannot_be_sliced_the_notes_say_what_the_comparison_cannot_see():
    torch.manual_seed(0)
    model, x = nn.Sequential(*(Block() for _ in range(6))), torch.randn(1, 1536, 32)
    plan = remat.auto(model, x, 0.6, repeat=1, warmup=0)
    try:
        said = " ".join(plan.notes)
        assert "not compared on a slice: a batch of 1 sample has no smaller slice" in said, said
        assert "compared with the lowest-peak one-level plan, not with it: a block whose recomputation" in said
    finally:
        remat.remove(model)


def test_a_reference_out_of_memory_on_its_smallest_slice_leaves_the_lowest_peak_plan_as_reference(monkeypatch):
    # auto raised here, on the device the user has, while the plans it would have verified fit.
    torch.manual_seed(0)
    model, x = nn.Sequential(*(Block() for _ in range(6))), _x()
    twin = copy.deepcopy(model)
    measure_peak, refused = step_module.measure_peak, []

    def no_room_without_checkpointing(model, inputs, loss_fn, loop):
        if not any(remat.is_wrapped(m) for m in model.modules()):
            refused.append(inputs.shape[0])
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return measure_peak(model, inputs, loss_fn, loop)

    monkeypatch.setattr(step_module, "measure_peak", no_room_without_checkpointing)
    plan = remat.auto(model, x, 0.5, repeat=1, warmup=0)
    try:
        said = " ".join(plan.notes)
        assert refused and refused[-1] == 1 and plan.verified, (refused, said)
        assert "The step without checkpointing ran out of device memory on its first 1 of the batch's 32" in said
        assert "compared with the lowest-peak one-level plan, not with it" in said
        _assert_trains_as(twin, model, x)
    finally:
        remat.remove(model)


def test_a_verified_plan_says_what_was_compared_and_trains_the_same_function():
    torch.manual_seed(0)
    model, x = nn.Sequential(*(Block() for _ in range(6))), _x()
    twin = copy.deepcopy(model)
    plan = remat.auto(model, x, 0.5, repeat=1, warmup=0)
    try:
        assert plan.checkpointed and any("bit for bit" in n for n in plan.notes)
        _assert_trains_as(twin, model, x)
    finally:
        remat.remove(model)


def test_an_interrupt_during_verification_leaves_the_model_unplanned(monkeypatch):
    torch.manual_seed(0)
    model, x = nn.Sequential(*(Block() for _ in range(4))), _x()
    prof = remat.profile(model, x, repeat=1, warmup=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    monkeypatch.setattr(apply_module, "make_profile", lambda *a, **k: prof)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(step_module, "measure_peak", interrupted)
    with pytest.raises(KeyboardInterrupt):
        remat.auto(model, x, 0.5)
    assert _untouched(model, before)

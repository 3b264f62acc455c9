"""Units from the execution: a module the forward calls again and again is a block called several times.

NOTE [Units from the execution] in remat.profiling._called.
"""

import contextlib

import pytest
import torch
from _device import SimulatedDevice, resting
from torch import nn

import remat
from remat.core._step import input_tensors
from remat.profiling._called import called_more_than_once


class Recurrent(nn.Module):
    """One weight-tied cell applied ``steps`` times: the tree repeats nothing, the execution does."""

    def __init__(self, d: int = 64, steps: int = 6) -> None:
        super().__init__()
        self.embed = nn.Linear(16, d)
        self.cell = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.head = nn.Linear(d, 1)
        self.steps = steps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for _ in range(self.steps):
            h = h + self.cell(h)
        return self.head(h).square().mean()


def _albert():
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = tf.AlbertConfig(
        vocab_size=64,
        embedding_size=16,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
    )
    ids = torch.randint(0, 64, (4, 16))
    return tf.AlbertForMaskedLM(config).train(), {"input_ids": ids, "labels": ids}


def _grads(model, inputs):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    loss = out.loss if hasattr(out, "loss") else out
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def test_the_top_most_module_called_more_than_once_is_the_unit():
    torch.manual_seed(0)
    model, x = Recurrent(), torch.randn(8, 32, 16)
    before = [p.detach().clone() for p in model.parameters()]
    # the cell is called 6 times; its layers too, but they are inside it; embed and head once
    assert called_more_than_once(model, x, training=True) == ["cell"]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and model.training
    assert called_more_than_once(nn.Sequential(nn.Linear(4, 4)), torch.randn(2, 4), training=True) == []


@pytest.mark.parametrize("real", [False, True])
def test_a_forward_that_fails_raises_its_error_and_leaves_no_hook(real):
    torch.manual_seed(0)
    model = Recurrent()
    with pytest.raises(RuntimeError, match="15"):
        called_more_than_once(model, torch.randn(8, 32, 15), training=True, real=real)  # the wrong width
    assert not any(m._forward_pre_hooks for m in model.modules())


def _wrong_labels(inputs: dict) -> dict:
    return {**inputs, "labels": inputs["labels"][:2]}  # two rows of labels for a batch of four


def test_a_step_that_fails_says_so_where_its_units_come_from_the_execution():
    # Once swallowed: ALBERT's units come from the execution alone, and the traced cut (which cannot bind
    # transformers 5's **kwargs forward) then said "found no blocks", not what the user's step did wrong.
    model, inputs = _albert()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(remat.RematError) as err:
        remat.profile(model, _wrong_labels(inputs), repeat=1, warmup=0)
    message = str(err.value)
    assert (
        "found no blocks" not in message
        and "Expected input batch_size (64) to match target batch_size (32)." in message
    )
    assert "AlbertForMaskedLM.forward" in message and isinstance(err.value.__cause__, ValueError)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items()) and model.training
    assert [b.name for b in remat.profile(model, inputs, repeat=1, warmup=0).blocks] == [
        "albert.encoder.albert_layer_groups.0"
    ]


def test_a_fake_profile_that_finds_no_units_says_what_its_fake_forward_raised():
    # On fake tensors a failure may be their refusal of an op, so the traced cut is still tried; where it fails
    # too, its message carries what the fake forward raised.
    model, inputs = _albert()
    try:
        remat.profile(model, _wrong_labels(inputs), fake=True, target="cpu", repeat=1, warmup=0)
    except remat.RematError as err:
        message = str(err)
    else:
        pytest.fail("a fake profile of a step that fails returned a profile")
    if "found no blocks" in message:  # the traced cut failed too
        # transformers 5: the step's own error; 4.x: fake tensors' refusal of its padding check, which reads values
        assert "on fake tensors, raised" in message
        assert "target batch_size (32)" in message or "DataDependentOutputException" in message
    else:  # the traced cut ran, and the profiled step raised the error itself
        assert "target batch_size (32)" in message
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


def test_a_flat_chain_called_once_keeps_its_layers():
    # The tree's fallback (single layers of the top-most chain) stands unless a looped module holds them all.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.GELU(), nn.Linear(16, 1))
    prof = remat.profile(model, torch.randn(8, 16), repeat=1, warmup=0)
    assert [b.name for b in prof.blocks] == ["0", "1", "2", "3", "4"]


def _fake_forward_runs(model, inputs, blocks) -> bool:
    """Whether fake tensors run ``model``'s forward (not ALBERT's on transformers 4.x: its padding check reads
    input_ids' values)."""
    try:
        remat.profile(model, inputs, blocks=blocks, fake=True, target="cpu", policies=("keep",))
    except remat.RematError as err:
        if "reads a tensor's value" in str(err):
            return False
        raise
    return True


def test_a_forward_fake_tensors_cannot_run_is_counted_for_real_where_the_profile_is_real():
    model, inputs = _albert()
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    rng = torch.get_rng_state()

    def refuses(*args):
        raise RuntimeError("a value fake tensors do not have")

    import remat.profiling._called as called

    real_forward = called._fake_forward
    try:
        called._fake_forward = refuses
        with pytest.raises(RuntimeError, match="fake tensors do not have"):  # a fake profile's: the refusal
            called_more_than_once(model, inputs, training=True)
        assert called_more_than_once(model, inputs, training=True, real=True) == [
            "albert.encoder.albert_layer_groups.0"
        ]
    finally:
        called._fake_forward = real_forward
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers()) and torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters()) and model.training


@pytest.mark.parametrize("build", [lambda: (Recurrent(), torch.randn(8, 32, 16)), _albert], ids=["tied", "albert"])
def test_a_model_that_calls_one_module_at_every_layer_gets_a_verified_plan(build):
    torch.manual_seed(0)
    model, inputs = build()
    prof = remat.profile(model, inputs, repeat=1, warmup=0)
    (block,) = prof.blocks
    assert block.calls >= 3 and block.saved_bytes["full"] < block.saved_bytes["keep"]
    loss, reference = _grads(model, inputs)
    budget = int(0.7 * prof.baseline_peak_bytes)
    if _fake_forward_runs(model, inputs, [block.name]):  # on a device of the budget: planned on fake tensors, within it
        device = SimulatedDevice(budget, resting(model, *input_tensors(inputs)))
    else:  # profiled for real, as any model fake tensors cannot run (README, Limitations)
        device = contextlib.nullcontext(SimulatedDevice(budget))
    with device as held:
        plan = remat.auto(model, inputs, budget, repeat=1, warmup=0)
    try:
        assert plan.checkpointed == {block.name: plan.assignment[block.name]} and held.peak <= budget
        assert plan.measured_peak_bytes <= plan.predicted_peak_bytes <= budget
        assert remat.measure(model, inputs, repeat=1, warmup=0).peak_bytes <= budget
        got_loss, got = _grads(model, inputs)
        assert torch.equal(loss, got_loss) and all(torch.equal(reference[n], got[n]) for n in reference)
    finally:
        remat.remove(model)

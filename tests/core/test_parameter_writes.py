"""A snapshot without the values of parameters puts back what a step wrote of them (remat.core._parameter_writes)."""

import copy

import pytest
import torch
from torch import nn

import remat
from remat.core._memtrack import StorageTracker
from remat.core._state import capture

W = 16


class Quantiser(nn.Module):
    """Moves its codebook in the forward: in place through ``.data`` (dead codes re-initialised), or by assigning
    ``.data`` anew (a momentum encoder's update)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.enc, self.dec = nn.Linear(W, W), nn.Linear(W, W)
        self.codes = nn.Parameter(torch.randn(8, W))
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.enc(x)
        q = self.codes[torch.cdist(z.detach(), self.codes.detach()).argmin(-1)]
        if self.how == "in place":
            self.codes.data[:4] = self.codes.data[:4] * 0.5 + 1.0
        else:
            self.codes.data = 0.9 * self.codes.data + 0.1 * z.detach().mean(0)
        return x + self.dec(z + (q - z).detach()) + (q - z.detach()).square().mean()


def _model(how: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, W), *(Quantiser(how) for _ in range(4)), nn.Linear(W, 1))


@pytest.mark.parametrize("how", ["in place", "assigned"])
def test_a_snapshot_without_parameters_puts_back_what_the_step_wrote(how):
    model, x = _model(how), torch.randn(16, 8)
    before = copy.deepcopy(model.state_dict())
    state = capture(model, parameters=False)
    with StorageTracker():  # as in every profiled or measured step on the CPU
        model(x).square().mean().backward()
    assert not torch.equal(model[1].codes, before["1.codes"])
    state.restore()
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_auto_verifies_a_model_that_writes_its_parameters_and_leaves_them_as_they_were():
    # Each of auto's steps began from what the last one wrote: the plan's step differed from the reference, and
    # auto refused a right plan, leaving the codebooks moved by its steps.
    model, x = _model("in place"), torch.randn(256, 8)
    loss_fn = lambda out: out.square().mean()  # noqa: E731
    reference, before = copy.deepcopy(model), copy.deepcopy(model.state_dict())
    plan = remat.auto(model, x, 0.8, loss_fn=loss_fn, repeat=1, warmup=0)
    try:
        assert plan.checkpointed and plan.verified
        assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())
        for m in (reference, model):
            loss_fn(m(x)).backward()
        for (name, a), b in zip(reference.named_parameters(), model.parameters()):
            assert torch.equal(a.grad, b.grad), name
        assert all(torch.equal(a, b) for a, b in zip(reference.state_dict().values(), model.state_dict().values()))
    finally:
        remat.remove(model)


def test_auto_refuses_a_block_that_assigns_a_parameters_data_and_leaves_the_model_as_it_was():
    # A recomputation reads the .data the forward assigned (NOTE [Parameters a forward writes] in remat.core._region):
    # the comparison with the step without checkpointing sees it, and auto's own steps are put back.
    model, x = _model("assigned"), torch.randn(256, 8)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(remat.RematError, match=r"gradients differed from the step without checkpointing"):
        remat.auto(model, x, 0.8, loss_fn=lambda out: out.square().mean(), repeat=1, warmup=0)
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())
    assert all(remat.is_wrapped(m) is None for m in model.modules())

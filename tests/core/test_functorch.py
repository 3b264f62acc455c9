"""NOTE [Under torch.func transforms]: remat's checkpoint inside vmap, jvp and the differentiating transforms."""

import pytest
import torch
import torch.utils.checkpoint as tc
from torch import nn

import remat
from remat.errors import TransformError


class _Block(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.norm, self.b = nn.Linear(width, width), nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x, *, scale=1.0):
        return x + scale * self.b(torch.relu(self.norm(self.a(x))))


POLICIES = ["full", "selective", "selective-ops"]


@pytest.mark.parametrize("policy", POLICIES)
def test_vmap_runs_a_checkpointed_call_as_torch_does(policy):
    block, x = _Block(), torch.randn(5, 3, 16)
    expected = torch.func.vmap(block)(x)
    got = torch.func.vmap(lambda t: remat.checkpoint(block, t, policy=policy))(x)
    assert torch.equal(got, expected)
    assert torch.equal(torch.func.vmap(lambda t: tc.checkpoint(block, t, use_reentrant=False))(x), expected)


@pytest.mark.parametrize("policy", POLICIES)
def test_jvp_through_a_wrapped_module_equals_the_plain_module(policy):
    plain, wrapped = _Block(), remat.wrap(_Block(), policy=policy)
    x, tangent = torch.randn(4, 16), torch.randn(4, 16)
    out, jvp = torch.func.jvp(plain, (x,), (tangent,))
    got_out, got_jvp = torch.func.jvp(wrapped, (x,), (tangent,))
    assert torch.equal(got_out, out) and torch.equal(got_jvp, jvp)


def test_a_wrapped_modules_keywords_under_a_transform_are_its_own():
    class Scaled(_Block):
        def forward(self, x, *, debug=1.0):  # named like a torch option: still the module's
            return super().forward(x, scale=debug)

    plain, wrapped, x = Scaled(), remat.wrap(Scaled()), torch.randn(5, 3, 16)
    got = torch.func.vmap(lambda t: wrapped(t, debug=0.5))(x)
    assert torch.equal(got, torch.func.vmap(lambda t: plain(t, debug=0.5))(x))


def _loss(params, x, model):
    return torch.func.functional_call(model, params, (x,)).sum()


@pytest.mark.parametrize(
    "transform",
    [
        lambda f: torch.func.grad(f),
        lambda f: torch.func.vmap(torch.func.grad(f), in_dims=(None, 0, None)),
        lambda f: torch.func.jacrev(f),
    ],
    ids=["grad", "vmap-grad", "jacrev"],
)
def test_a_differentiating_transform_is_a_clear_error_where_torch_fails_too(transform):
    wrapped = remat.wrap(_Block())
    params = {n: p.detach() for n, p in wrapped.named_parameters()}
    x = torch.randn(3, 16)
    with pytest.raises(TransformError, match=r"torch\.func\.grad.*remat\.unwrap\(module\)") as caught:
        transform(_loss)(params, x, wrapped)
    assert isinstance(caught.value, RuntimeError)  # what torch raises there (NOTE [Caught like torch's])
    torch_block = _Block()
    torch_block.forward = lambda t, _f=torch_block.forward: tc.checkpoint(_f, t, use_reentrant=False)
    with pytest.raises(RuntimeError, match="saved tensor hooks"):
        transform(_loss)(params, x, torch_block)
    # Unwrapped, the transform runs and gives the plain module's gradients.
    remat.unwrap(wrapped)
    expected = transform(_loss)(params, x, _Block())
    got = transform(_loss)(params, x, wrapped)
    assert all(torch.equal(got[name], expected[name]) for name in expected)

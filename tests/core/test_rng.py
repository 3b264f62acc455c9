"""Selective checkpointing never changes random streams (remat._rng).

On CUDA, SDPA with dropout is one fused op that draws random numbers; a selective
policy saves its output, so recompute skips it. These tests force the same mechanism
on CPU: a policy that saves a random op, and a custom op that draws inside one op.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

import remat
from remat.core import _rng

aten = torch.ops.aten


# torch.library.define with tags (torch >= 2.2) rather than custom_op(tags=...), which torch 2.4 lacks.
torch.library.define("remat_test::fused_dropout", "(Tensor x, float p) -> (Tensor, Tensor)",
                     tags=(torch.Tag.nondeterministic_seeded,))


@torch.library.impl("remat_test::fused_dropout", "CompositeExplicitAutograd")
def _fused_dropout(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dropout drawn inside one op, like CUDA's fused attention kernels."""
    mask = torch.bernoulli(torch.full_like(x, 1 - p))
    return x * mask / (1 - p), mask


@torch.library.register_fake("remat_test::fused_dropout")
def _(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


def _fused_backward(ctx, grad_out, grad_mask):  # noqa: ANN001
    return grad_out * ctx.mask / (1 - ctx.p), None


def _fused_setup(ctx, inputs, output):  # noqa: ANN001
    ctx.mask, ctx.p = output[1], inputs[1]


torch.library.register_autograd("remat_test::fused_dropout", _fused_backward, setup_context=_fused_setup)
fused_dropout = torch.ops.remat_test.fused_dropout


class TwoDropouts(nn.Module):
    """Linear, dropout, linear, randomized leaky ReLU (``rrelu_with_noise``), linear.

    The policies below save the dropout and recompute the rrelu, whose noise is drawn
    from where the dropout left the generator.
    """

    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16)
        self.fused = fused
        self.calls = 0

    def drop(self, x: torch.Tensor) -> torch.Tensor:
        # F.dropout runs native_dropout on CUDA, bernoulli_ and mul on CPU: call the CUDA op directly.
        return fused_dropout(x, 0.5)[0] if self.fused else torch.native_dropout(x, 0.5, self.training)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.c(nn.functional.rrelu(self.b(self.drop(self.a(x))), training=self.training))


def _step(block: TwoDropouts, policy: object | None, seed: int = 0) -> tuple[dict, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    x = torch.randn(8, 16)
    block.zero_grad(set_to_none=True)
    y = block(x) if policy is None else remat.checkpoint(block, x, policy=policy)
    y.square().sum().backward()
    return {n: p.grad.clone() for n, p in block.named_parameters()}, y.detach(), torch.get_rng_state()


def _assert_same_step(block: TwoDropouts, policy: object) -> None:
    ref_grads, ref_out, ref_rng = _step(block, None)
    calls = block.calls
    grads, out, rng = _step(block, policy)
    assert block.calls == calls + 2, "the block was not recomputed"
    assert torch.equal(out, ref_out)
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), f"{name}: max diff {(grads[name] - g).abs().max():.3g}"
    assert torch.equal(rng, ref_rng), "the RNG stream after the step differs"


SAVE_DROPOUT = [aten.addmm.default, aten.native_dropout.default]


def _must_save_dropout(ctx, op, *args, **kwargs):  # noqa: ANN001
    return CheckpointPolicy.MUST_SAVE if op is aten.native_dropout.default else CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("policy", [SAVE_DROPOUT, _must_save_dropout], ids=["op-list", "function"])
def test_saved_dropout_keeps_later_masks(policy: object) -> None:
    _assert_same_step(TwoDropouts(), policy)


def test_op_drawing_inside_one_kernel_is_replayed() -> None:
    _assert_same_step(TwoDropouts(fused=True), [aten.addmm.default, torch.ops.remat_test.fused_dropout.default])


def test_without_the_replay_gradients_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    # The mechanism the tests above guard against, shown by turning remat's replay off.
    monkeypatch.setattr(_rng.RngLedger, "replay", lambda self: None)
    block = TwoDropouts()
    ref_grads, _, _ = _step(block, None)
    grads, _, _ = _step(block, SAVE_DROPOUT)
    assert not all(torch.equal(grads[n], g) for n, g in ref_grads.items())


def test_torch_selective_checkpoint_has_the_flaw() -> None:
    # Why remat does it itself: torch's own selective checkpointing (2.13) skips the draw.
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    block = TwoDropouts()
    ref_grads, _, _ = _step(block, None)
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    block.zero_grad(set_to_none=True)
    ctx = lambda: create_selective_checkpoint_contexts(SAVE_DROPOUT)  # noqa: E731
    checkpoint(block, x, use_reentrant=False, context_fn=ctx).square().sum().backward()
    if all(torch.equal(p.grad, ref_grads[n]) for n, p in block.named_parameters()):
        pytest.skip(f"torch {torch.__version__} replays saved random ops itself")
    assert not torch.equal(block.b.weight.grad, ref_grads["b.weight"])


def test_selective_with_dropout_everywhere_is_exact() -> None:
    torch.manual_seed(1)
    block = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.2, batch_first=True)
    x = torch.randn(3, 10, 32)

    def run(policy: object | None) -> dict:
        torch.manual_seed(5)
        block.zero_grad(set_to_none=True)
        out = block(x) if policy is None else remat.checkpoint(block, x, policy=policy)
        out.sum().backward()
        return {n: p.grad.clone() for n, p in block.named_parameters()}

    ref = run(None)
    for policy in ("selective", "full", [aten.native_dropout.default, aten.addmm.default]):
        got = run(policy)
        assert all(torch.equal(got[n], g) for n, g in ref.items()), policy


def test_ledger_records_only_kept_random_ops() -> None:
    ledger = _rng.RngLedger(_must_save_dropout)
    block = TwoDropouts()
    x = torch.randn(4, 16)
    forward, _ = torch.utils.checkpoint.create_selective_checkpoint_contexts(ledger.decide)
    with forward:
        block(x)
    assert list(ledger.states) == [(aten.native_dropout.default, 0)]  # rrelu is recomputed: not kept
    assert ledger.calls[aten.rrelu_with_noise.default] == 1
    assert ledger.replay() is not None
    assert _rng.RngLedger(lambda *a, **k: CheckpointPolicy.PREFER_RECOMPUTE).replay() is None


def test_generators_of_an_op() -> None:
    g = torch.Generator()
    assert _rng.generators_of((torch.ones(2),), {"generator": g}) == [g]
    assert _rng.generators_of((torch.ones(2),), {}) == [torch.default_generator]
    assert _rng.generators_of((), {"device": "meta"}) == []
    assert _rng.draws_random(aten.native_dropout.default)
    assert _rng.draws_random(aten._scaled_dot_product_flash_attention_for_cpu.default)
    assert not _rng.draws_random(aten.mm.default)


def test_policy_list_of_non_ops_is_refused() -> None:
    with pytest.raises(remat.RematError, match="aten op overloads"):
        remat.checkpoint(nn.Linear(2, 2), torch.ones(1, 2), policy=[aten.mm])

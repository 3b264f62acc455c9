"""Selective checkpointing never changes random streams (remat._rng).

On CUDA, SDPA with dropout is one fused op that draws random numbers; a selective
policy saves its output, so recompute skips it. These tests force the same mechanism
on CPU: a policy that saves a random op, and custom ops that draw inside one kernel,
tagged as random or not (NOTE [Random draws are seen, not named]).
"""

from __future__ import annotations

import functools
import os
import warnings

import pytest
import torch
from conftest import twin
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import remat
from remat.core import _rng
from remat.core._policies import _save_listed

aten = torch.ops.aten


# torch.library.define with tags (torch >= 2.2) rather than custom_op(tags=...), which torch 2.4 lacks.
torch.library.define(
    "remat_test::fused_dropout", "(Tensor x, float p) -> (Tensor, Tensor)", tags=(torch.Tag.nondeterministic_seeded,)
)


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

NOISY_CALLS = [0]
"""Runs of noisy_scale's kernel: a kept op is not run again in recompute."""


@torch.library.custom_op("remat_test::noisy_scale", mutates_args=())
def noisy_scale(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dropout drawn inside one kernel, with no random tag: what a Triton or flash-attention kernel is to remat."""
    NOISY_CALLS[0] += 1
    mask = torch.bernoulli(torch.full_like(x, 1 - p))
    return x * mask / (1 - p), mask


@noisy_scale.register_fake
def _(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


noisy_scale.register_autograd(_fused_backward, setup_context=_fused_setup)


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


class NoisyThenDropouts(nn.Module):
    """Linear, a custom op drawing inside one kernel (untagged), linear, nn.Dropout, linear, torch.dropout.

    Saving only the custom op, every dropout after it is recomputed and draws from where
    the custom op left the generator.
    """

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16)
        self.drop = nn.Dropout(0.3)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.drop(torch.relu(self.b(noisy_scale(self.a(x), 0.5)[0])))
        return torch.dropout(self.c(h), 0.2, self.training)


def _rng_states(device: torch.device) -> list[torch.Tensor]:
    return [torch.get_rng_state(), *([torch.cuda.get_rng_state(device)] if device.type == "cuda" else [])]


def _step(block: nn.Module, policy: object | None, seed: int = 0, **options: object) -> tuple[dict, torch.Tensor, list]:
    device = next(block.parameters()).device
    torch.manual_seed(seed)
    x = torch.randn(8, 16, device=device)
    block.zero_grad(set_to_none=True)
    plain = policy is None and not options
    y = block(x) if plain else remat.checkpoint(block, x, policy=policy or "full", **options)
    y.square().sum().backward()
    return {n: p.grad.clone() for n, p in block.named_parameters()}, y.detach(), _rng_states(device)


def _max_diff(grads: dict, ref: dict) -> float:
    return max((grads[n] - g).abs().max().item() for n, g in ref.items())


def _assert_same_step(block: nn.Module, policy: object | None, **options: object) -> None:
    ref_grads, ref_out, ref_rng = _step(block, None)
    calls = block.calls
    grads, out, rng = _step(block, policy, **options)
    assert block.calls == calls + 2, "the block was not recomputed"
    assert torch.equal(out, ref_out)
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), f"{name}: max diff {(grads[name] - g).abs().max():.3g}"
    assert all(torch.equal(a, b) for a, b in zip(rng, ref_rng)), "the RNG stream after the step differs"


SAVE_DROPOUT = [aten.addmm.default, aten.native_dropout.default]


def _must_save_dropout(ctx, op, *args, **kwargs):  # noqa: ANN001
    return CheckpointPolicy.MUST_SAVE if op is aten.native_dropout.default else CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("policy", [SAVE_DROPOUT, _must_save_dropout], ids=["op-list", "function"])
def test_saved_dropout_keeps_later_masks(policy: object) -> None:
    _assert_same_step(TwoDropouts(), policy)


def test_op_drawing_inside_one_kernel_is_replayed() -> None:
    _assert_same_step(TwoDropouts(fused=True), [aten.addmm.default, torch.ops.remat_test.fused_dropout.default])


def _must_save_noisy(ctx, op, *args, **kwargs):  # noqa: ANN001
    return CheckpointPolicy.MUST_SAVE if op is noisy_scale._opoverload else CheckpointPolicy.PREFER_RECOMPUTE


NOISY_POLICIES = {
    "op-list": dict(policy=[aten.addmm.default, torch.ops.remat_test.noisy_scale.default]),
    "op-list-custom-op": dict(policy=[noisy_scale]),
    "function": dict(policy=_must_save_noisy),
    "torch-context-fn": dict(context_fn=functools.partial(create_selective_checkpoint_contexts, _must_save_noisy)),
    "torch-context-fn-list": dict(
        context_fn=functools.partial(create_selective_checkpoint_contexts, [torch.ops.remat_test.noisy_scale.default])
    ),
}


@pytest.mark.parametrize("options", NOISY_POLICIES.values(), ids=NOISY_POLICIES.keys())
def test_a_kept_op_drawing_inside_one_kernel_is_seen_and_replayed(options: dict) -> None:
    # Not tagged as random: remat sees that it moved the generator (NOTE [Random draws are seen, not named]).
    block = NoisyThenDropouts()
    before = NOISY_CALLS[0]
    _assert_same_step(block, options.pop("policy", None), **options)
    assert NOISY_CALLS[0] == before + 2, "the custom op was recomputed, not kept"  # once per step: no rerun


@pytest.fixture
def _cuda_deterministic():
    # As tests/core/test_cuda_gradients.py: cuBLAS needs a fixed workspace to be bit-reproducible.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["op-list", "function", "torch-context-fn"])
def test_a_kept_cuda_kernel_drawing_inside_is_replayed(name: str, _cuda_deterministic: None) -> None:
    # On CUDA the draw moves the Philox offset of the device's generator, on the host at launch.
    block = NoisyThenDropouts().cuda()
    ledger = _rng.RngLedger(functools.partial(_save_listed, {noisy_scale._opoverload}))
    forward, _ = create_selective_checkpoint_contexts(ledger.decide)
    with forward:
        block(torch.randn(4, 16, device="cuda"))
    ((key, moved),) = ledger.states.items()
    assert key == (noisy_scale._opoverload, 0) and [g.device.type for g, _ in moved] == ["cuda"]
    options = dict(NOISY_POLICIES[name])
    _assert_same_step(block, options.pop("policy", None), **options)


def test_a_kept_op_drawing_inside_one_kernel_without_the_replay_is_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    # What the test above guards against (gradients off by ~10): recompute skips the kept draw, the dropouts
    # after it draw other masks.
    block = NoisyThenDropouts()
    ref, _, _ = _step(block, None)
    monkeypatch.setattr(_rng.RngLedger, "replay", lambda self: None)
    grads, _, _ = _step(block, [noisy_scale])
    assert _max_diff(grads, ref) > 1.0


class _CountingGELU(nn.GELU):
    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        return super().forward(x)


class _NoisyNorm(nn.Module):
    """Cheap by its ops' names (a LayerNorm, an untagged custom op), but it draws: never a region."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return noisy_scale(self.norm(x), 0.5)[0]


class _NoisyBlock(nn.Module):
    """Linear, _NoisyNorm, linear (it saves _NoisyNorm's output: a region would drop it and rerun), GELU, linear."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.mid, self.b = nn.Linear(16, 32), _NoisyNorm(), nn.Linear(32, 32)
        self.act, self.c, self.drop = _CountingGELU(), nn.Linear(32, 16), nn.Dropout(0.3)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.drop(self.c(self.act(self.b(self.mid(self.a(x))))))


def test_selective_by_module_never_makes_a_drawing_submodule_a_region() -> None:
    from remat.core._memo import STRUCTURES

    block = _NoisyBlock()
    ref, ref_out, _ = _step(block, None)
    for call in ("learns op-level", "by module"):
        gelu = _CountingGELU.calls
        grads, out, _ = _step(block, "selective")
        assert torch.equal(out, ref_out), call
        assert _max_diff(grads, ref) == 0.0, call
    assert _CountingGELU.calls == gelu + 2, "the GELU region was not recomputed"
    (structure,) = STRUCTURES[block].values()
    assert sorted(type(ref()).__name__ for ref, _ in structure.regions) == ["LayerNorm", "_CountingGELU"]


def test_a_kept_draw_that_cannot_be_replayed_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # As under CUDA graph capture: the generator's state cannot be read, the kept op is known to draw.
    monkeypatch.setattr(_rng, "read_state", lambda generator: None)
    block = TwoDropouts(fused=True)
    with pytest.raises(remat.RematError, match="cannot be read"):
        _step(block, [aten.addmm.default, fused_dropout.default])
    _step(block, [aten.addmm.default])  # nothing kept draws: nothing to replay


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


def test_ledger_records_only_kept_ops_that_moved_a_generator() -> None:
    ledger = _rng.RngLedger(functools.partial(_save_listed, {aten.addmm.default, noisy_scale._opoverload}))
    forward, _ = create_selective_checkpoint_contexts(ledger.decide)
    with forward:
        NoisyThenDropouts()(torch.randn(4, 16))
    ((key, moved),) = ledger.states.items()
    assert key == (noisy_scale._opoverload, 0)  # kept addmm drew nothing; the dropouts are recomputed
    assert [g for g, _ in moved] == [torch.default_generator]
    assert ledger.calls[noisy_scale._opoverload] == 1 and aten.addmm.default not in ledger.calls  # not followed


def test_ledger_reads_after_the_op_when_torch_asks_before_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch without SelectiveCheckpointContext.op_output asks the policy before running the op.
    monkeypatch.setattr(_rng, "POLICY_AFTER_OP", False)
    kept, recomputed = noisy_scale._opoverload, aten.bernoulli.default
    ledger = _rng.RngLedger(lambda ctx, func, *args, **kwargs: func is kept)
    ctx = torch.utils.checkpoint.SelectiveCheckpointContext(is_recompute=False)
    ledger.decide(ctx, kept)
    assert ledger.states == {}  # not run yet
    torch.rand(3)  # the kept op runs and draws
    after = torch.get_rng_state()
    ledger.decide(ctx, recomputed)
    torch.rand(3)  # the recomputed op draws: not the kept op's draw
    (((generator, state),),) = ledger.states.values()
    assert list(ledger.states) == [(kept, 0)]
    assert generator is torch.default_generator and torch.equal(state, after)


def test_every_aten_op_that_takes_a_generator_is_tagged_random() -> None:
    # What lets the ledger skip kept aten ops that are not tagged (NOTE [Random draws are seen, not named]).
    untagged = []
    for name in dir(aten):
        packet = getattr(aten, name, None)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if any("Generator" in str(a.type) for a in op._schema.arguments) and not _rng.draws_random(op):
                untagged.append(str(op))
    assert untagged == []
    assert _rng.declares_draws(aten.mm.default) and not _rng.declares_draws(noisy_scale._opoverload)


def test_generator_states_are_read_for_real_under_fake_tensors() -> None:
    # A fake-tensor profile runs the ledger: the state must not become a fake tensor (garbage bytes).
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = _rng.read_state(torch.default_generator)
    with FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings():
        warnings.simplefilter("error")
        state, data = _rng.read_state(torch.default_generator)
    assert type(state) is torch.Tensor and data == real[1]


def test_generators_in_use_and_random_tags() -> None:
    assert _rng.generators_in_use()[0] is torch.default_generator
    before = _rng.fingerprint()
    assert _rng.fingerprint() == before
    torch.rand(1)
    assert _rng.fingerprint() != before
    assert _rng.draws_random(aten.native_dropout.default)
    assert _rng.draws_random(aten._scaled_dot_product_flash_attention_for_cpu.default)
    assert not _rng.draws_random(aten.mm.default)
    assert not _rng.draws_random(noisy_scale._opoverload)  # untagged: seen only by what it does


def test_policy_list_of_non_ops_is_refused() -> None:
    with pytest.raises(remat.RematError, match="aten op overloads"):
        remat.checkpoint(nn.Linear(2, 2), torch.ones(1, 2), policy=[aten.mm])


# --- NOTE [Host generators in recomputation] ---------------------------------------------------------------------


class _HostDrawing(nn.Module):
    """A block masking its hidden layer with NumPy's global generator and scaling it with Python's."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import random

        import numpy as np

        keep = torch.from_numpy(np.random.rand(64) < 0.5).to(x.dtype)
        return x + self.b(torch.relu(self.a(x)) * keep * random.random())


def _host_step(model: nn.Module, x: torch.Tensor) -> tuple[list[torch.Tensor], tuple]:
    import random

    import numpy as np

    np.random.seed(1)
    random.seed(1)
    model(x).sum().backward()
    after = (random.random(), float(np.random.rand()))
    return [p.grad for p in model.parameters()], after


@pytest.mark.parametrize("policy", ["full", "selective", "selective-ops"])
def test_a_block_drawing_from_numpy_and_python_is_recomputed_with_the_same_draws(policy: str) -> None:
    torch.manual_seed(0)
    reference = nn.Sequential(*(_HostDrawing() for _ in range(3)))
    model = twin(reference)
    for block in model:
        remat.wrap(block, policy=policy)
    x = torch.randn(8, 16)
    grads, after = _host_step(model, x)
    expected, expected_after = _host_step(reference, x)
    assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))
    assert after == expected_after  # the streams after the step are the reference's


def test_torch_checkpoint_recomputes_host_draws_with_other_numbers() -> None:
    # The flaw remat's recomputation avoids (a contrast: if torch fixes it, this test says so).
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self, block: nn.Module) -> None:
            super().__init__()
            self.block = block

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.block, x, use_reentrant=False)

    torch.manual_seed(0)
    reference = nn.Sequential(*(_HostDrawing() for _ in range(3)))
    model = nn.Sequential(*(Checkpointed(b) for b in twin(reference)))
    x = torch.randn(8, 16)
    grads, _ = _host_step(model, x)
    expected, _ = _host_step(reference, x)
    assert not all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))


def test_a_block_that_draws_nothing_from_the_host_learns_so_on_its_first_call() -> None:
    from remat.core._host_rng import HOST_DRAWS

    torch.manual_seed(0)
    plain, drawing = nn.Linear(16, 16), _HostDrawing()
    for block in (plain, drawing):
        remat.wrap(block, policy="full")
        block(torch.randn(4, 16, requires_grad=True)).sum().backward()
    assert list(HOST_DRAWS[plain].values()) == [False]
    assert list(HOST_DRAWS[drawing].values()) == [True]

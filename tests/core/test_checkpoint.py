"""remat.checkpoint: every guarantee against the un-checkpointed model, bit for bit."""

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tc
from conftest import assert_buffers_equal, assert_grads_equal, step, twin
from torch import nn

import remat
from remat.core._memtrack import StorageTracker
from remat.zoo import SeedCifarCNN


class Counting(nn.Module):
    """Wraps a module and counts its forward calls."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.calls = 0
        self.recomputing = []

    def forward(self, *args, **kwargs):
        self.calls += 1
        self.recomputing.append(remat.is_recomputing())
        return self.inner(*args, **kwargs)


# --- gradients reach parameters whatever the inputs' requires_grad ----------------------------


def test_first_block_on_raw_input_gets_gradients_seed_000():
    ref = SeedCifarCNN()
    model = twin(ref)
    x = torch.randn(8, 3, 32, 32)  # raw data: requires_grad=False
    assert not x.requires_grad
    step(ref, x)
    step(
        model,
        x,
        fn=lambda x: model.head(
            model.flatten(remat.checkpoint(model.cnn_block_2, remat.checkpoint(model.cnn_block_1, x)))
        ),
    )
    assert_grads_equal(ref, model)


def test_whole_network_on_raw_input_gets_gradients_seed_001():
    body = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    ref = nn.ModuleDict({"body": body, "head": nn.Linear(8, 8)})
    model = twin(ref)
    x = torch.randn(4, 2, 3, 16, 16)

    def loss_of(m, ckpt):
        o1 = ckpt(m["body"], x[:, 0])
        o2 = ckpt(m["body"], x[:, 1])
        return ((m["head"](o1) - o2) ** 2).mean()

    loss_of(ref, lambda f, t: f(t)).backward()
    loss_of(model, remat.checkpoint).backward()
    assert_grads_equal(ref, model)
    assert_buffers_equal(ref, model)


def test_reentrant_torch_checkpoint_really_freezes_the_body():
    """The seed bug is real on torch 2.13: this is what remat protects against."""
    body = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.randn(2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = tc.checkpoint(body, x, use_reentrant=True)
    assert not out.requires_grad
    assert body[0].weight.grad is None


# --- bit-equal gradients, RNG stream, dropout -------------------------------------------------


@pytest.mark.parametrize("where", ["inside", "outside", "both"])
def test_dropout_gradients_and_rng_stream_bit_equal(where):
    inner = [nn.Linear(16, 32), nn.GELU()] + ([nn.Dropout(0.5)] if where in ("inside", "both") else [])
    block = nn.Sequential(*inner, nn.Linear(32, 16))
    ref = nn.Sequential(nn.Linear(16, 16), block, nn.Dropout(0.3) if where != "inside" else nn.Identity())
    model = twin(ref)
    x = torch.randn(8, 16)
    out_ref, rng_ref = step(ref, x)
    out, rng = step(model, x, fn=lambda t: model[2](remat.checkpoint(model[1], model[0](t))))
    assert torch.equal(out_ref, out)
    assert torch.equal(rng_ref, rng), "global RNG stream after the step differs"
    assert_grads_equal(ref, model)


# --- buffers updated once per step --------------------------------------------------------------


class EMA(nn.Module):
    """A custom module with a running buffer that its output depends on."""

    def __init__(self):
        super().__init__()
        self.register_buffer("avg", torch.zeros(6))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.training:
            self.avg.mul_(0.9).add_(0.1 * x.detach().mean(0))
            self.steps.add_(1)
        return x * (1 + self.avg)  # output depends on the state: recompute must see the pre-step value


NORMS = [
    lambda: nn.BatchNorm1d(6),
    lambda: nn.BatchNorm1d(6, momentum=None),  # cumulative average reads num_batches_tracked
    lambda: nn.SyncBatchNorm(6),
    lambda: nn.InstanceNorm1d(6, track_running_stats=True, affine=True),
    lambda: EMA(),
]


@pytest.mark.parametrize("make_norm", NORMS, ids=["bn", "bn-cumulative", "syncbn", "instancenorm", "ema"])
def test_running_buffers_updated_exactly_once(make_norm):
    norm = make_norm()
    seq = isinstance(norm, nn.InstanceNorm1d)  # needs (batch, channels, length)
    layer = (lambda: nn.Conv1d(6, 6, 1)) if seq else (lambda: nn.Linear(6, 6))
    ref = nn.Sequential(layer(), norm, nn.ReLU(), layer())
    model = twin(ref)
    x = torch.randn(5, 6, 4) if seq else torch.randn(5, 6)
    for s in range(3):  # several steps: the state carried from one step to the next must agree too
        step(ref, x, seed=s)
        step(model, x, seed=s, fn=lambda t: remat.checkpoint(model, t))
        assert_buffers_equal(ref, model)
        assert_grads_equal(ref, model)


@pytest.mark.parametrize("cls", [nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d])
def test_every_batchnorm_class(cls):
    dims = {nn.BatchNorm1d: (4, 3), nn.BatchNorm2d: (4, 3, 5, 5), nn.BatchNorm3d: (2, 3, 3, 3, 3)}[cls]
    ref = nn.Sequential(cls(3), nn.ReLU())
    model = twin(ref)
    x = torch.randn(*dims, requires_grad=True)
    step(ref, x)
    step(model, x, fn=lambda t: remat.checkpoint(model, t))
    assert_buffers_equal(ref, model)
    assert int(model[0].num_batches_tracked) == 1


def test_plain_torch_checkpoint_updates_batchnorm_twice():
    """Contrast: the test above fails against torch.utils.checkpoint on torch 2.13."""
    bn = nn.BatchNorm1d(3)
    x = torch.randn(4, 3, requires_grad=True)
    tc.checkpoint(bn, x, use_reentrant=False).sum().backward()
    assert int(bn.num_batches_tracked) == 2


# --- autocast, kwargs, nesting, non-tensors, frozen parameters, in-place ops --------------------


def test_autocast_state_restored_in_recompute():
    ref = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    model = twin(ref)
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_ref = ref(x)
        out = remat.checkpoint(model, x)
    assert out.dtype == torch.bfloat16
    out_ref.float().sum().backward()
    out.float().sum().backward()  # recompute runs outside autocast: remat must re-enter it
    assert_grads_equal(ref, model)


def test_kwargs_nested_and_non_tensor_inputs_and_outputs():
    lin = nn.Linear(4, 4)
    ref_lin = twin(lin)

    def fn(pair, *, table, scale, name, nothing=None):
        a, b = pair
        h = lin(a) * scale + table["bias"] + b[0]
        return {"h": h, "parts": (h.sin(), [h.cos()]), "name": name, "n": 3, "none": nothing}

    a, b0, bias = torch.randn(2, 4), torch.randn(2, 4, requires_grad=True), torch.randn(4, requires_grad=True)
    args = ((a, [b0]),)
    kwargs = {"table": {"bias": bias}, "scale": 2.0, "name": "x"}
    out = remat.checkpoint(fn, *args, **kwargs)
    assert out["name"] == "x" and out["n"] == 3 and out["none"] is None
    (out["h"].sum() + out["parts"][0].sum() + out["parts"][1][0].sum()).backward()
    g_b0, g_bias = b0.grad.clone(), bias.grad.clone()
    b0.grad = bias.grad = None
    lin_grads = (lin.weight.grad.clone(), lin.bias.grad.clone())
    lin.weight.grad = lin.bias.grad = None
    h = lin(a) * 2.0 + bias + b0
    parts = (h.sin(), [h.cos()])  # same op order as fn: gradient accumulation order matters for bits
    (h.sum() + parts[0].sum() + parts[1][0].sum()).backward()
    assert torch.equal(g_b0, b0.grad), (g_b0, b0.grad)
    assert torch.equal(g_bias, bias.grad), (g_bias, bias.grad)
    assert torch.equal(lin_grads[0], lin.weight.grad) and torch.equal(lin_grads[1], lin.bias.grad)
    del ref_lin


def test_frozen_parameters_stay_without_gradients():
    ref = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    ref[0].requires_grad_(False)
    model = twin(ref)
    x = torch.randn(3, 4)
    step(ref, x)
    step(model, x, fn=lambda t: remat.checkpoint(model, t))
    assert model[0].weight.grad is None and model[0].bias.grad is None
    assert_grads_equal(ref, model)


@pytest.mark.parametrize("first", ["relu_inplace", "mul_", "add_"])
def test_in_place_op_on_the_input_at_block_start(first):
    ops = {
        "relu_inplace": nn.ReLU(inplace=True),
        "mul_": type("Mul", (nn.Module,), {"forward": lambda self, x: x.mul_(2)})(),
        "add_": type("Add", (nn.Module,), {"forward": lambda self, x: x.add_(1.5)})(),
    }
    ref = nn.ModuleList([nn.Linear(6, 6), nn.Sequential(ops[first], nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))])
    model = twin(ref)
    x = torch.randn(4, 6)
    step(ref, x, fn=lambda t: ref[1](ref[0](t)))
    step(model, x, fn=lambda t: remat.checkpoint(model[1], model[0](t)))
    assert_grads_equal(ref, model)


def test_torch_checkpoint_refuses_in_place_op_on_its_input():
    """Contrast for the test above: torch keeps the mutated input and fails in backward."""
    lin = nn.Linear(4, 4)
    h = lin(torch.randn(2, 4))
    out = tc.checkpoint(lambda t: t.mul_(2).sin(), h, use_reentrant=False)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_input_modified_after_the_call_is_an_error():
    lin = nn.Linear(4, 4)
    h = lin(torch.randn(2, 4))
    out = remat.checkpoint(lambda t: t.sin() * 2, h)
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(remat.RematError, match="modified in place after the call"):
        out.sum().backward()


# --- recomputation happens, and saves memory ----------------------------------------------------


def test_forward_runs_twice_and_is_recomputing_tells_which():
    block = Counting(nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
    x = torch.randn(2, 4, requires_grad=True)
    remat.checkpoint(block, x).sum().backward()
    assert block.calls == 2
    assert block.recomputing == [False, True]
    block.calls = 0
    remat.checkpoint(block, x, policy="keep").sum().backward()
    assert block.calls == 1


def test_no_recompute_without_grad():
    block = Counting(nn.Linear(4, 4))
    with torch.no_grad():
        remat.checkpoint(block, torch.randn(2, 4))
    assert block.calls == 1


def heavy_function(x, a):
    """Seed 002's function, with ``*`` where the seed has ``+``: an add saves nothing for backward."""
    for _ in range(100):
        x = x * a
    return x


def test_seed_002_saved_tensors_and_bytes_drop():
    a = nn.Parameter(torch.tensor(1.0001))
    x = torch.randn(1000, requires_grad=True)

    def saved_during(fn):
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
            with StorageTracker(known=[x, a]) as tracker:
                out = fn()
        return len(packed), tracker.current, out

    n_plain, bytes_plain, out_plain = saved_during(lambda: heavy_function(x, a))
    n_ckpt, bytes_ckpt, out_ckpt = saved_during(lambda: remat.checkpoint(heavy_function, x, a))
    assert torch.equal(out_plain, out_ckpt)
    assert n_plain == 200
    # torch's 0-byte device marker and the inputs x, a (under saved-tensor hooks they go to the
    # hooks, NOTE [Regions inside regions]); nothing from inside the function
    assert n_ckpt == 3
    assert bytes_plain >= 100 * 4000  # every intermediate kept
    assert bytes_ckpt <= 2 * 4000  # the output (and the 0-size device marker)
    out_ckpt.sum().backward()
    g_ckpt = (x.grad.clone(), a.grad.clone())
    x.grad = a.grad = None
    out_plain.sum().backward()
    assert torch.equal(g_ckpt[0], x.grad) and torch.equal(g_ckpt[1], a.grad)


# --- policies, decorator, module wrapping, nesting, double backward ------------------------------


def test_selective_policy_keeps_matmuls_and_matches_gradients():
    ref = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16), nn.LayerNorm(16))
    model = twin(ref)
    x = torch.randn(8, 16, requires_grad=True)
    step(ref, x)
    counter = Counting(model)
    step(counter, x, fn=lambda t: remat.checkpoint(counter, t, policy="selective"))
    assert counter.calls == 2
    assert_grads_equal(ref, model)


class ScoresPlusBias(nn.Module):
    """Attention-style scores written in place: a batched matmul returns ``_unsafe_view`` of its ``bmm``, whose
    version counter is its own, so ``+=`` writes the cached ``bmm`` output without a version change."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        scores = torch.matmul(self.q(x), self.k(x).transpose(-1, -2))
        scores += torch.linspace(0.0, 1.0, scores.shape[-1])  # a position bias, added once
        return torch.softmax(scores, -1) @ x


_KEEP_MATMULS = functools.partial(
    tc.create_selective_checkpoint_contexts,
    [torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default],
)


@pytest.mark.parametrize("policy", ["selective", "selective-ops", "torch-context-fn"])
def test_a_cached_matmul_written_through_its_unsafe_view_is_recomputed(policy):
    # NOTE [Cached outputs written in place] in remat.core._contexts: BigBird's block-sparse attention
    ref = ScoresPlusBias()
    model = twin(ref)
    x = torch.randn(2, 6, 8, requires_grad=True)
    step(ref, x)
    counter = Counting(model)
    if policy == "torch-context-fn":
        step(counter, x, fn=lambda t: remat.checkpoint(counter, t, context_fn=_KEEP_MATMULS))
    else:
        step(counter, x, fn=lambda t: remat.checkpoint(counter, t, policy=policy))
    assert counter.calls == 2
    assert_grads_equal(ref, model)


def test_torch_selective_checkpoint_misses_a_write_through_an_unsafe_view():
    """Contrast for the test above: torch hands the written ``bmm`` output back in recompute."""
    ref = ScoresPlusBias()
    model = twin(ref)
    x = torch.randn(2, 6, 8, requires_grad=True)
    step(ref, x)
    step(model, x, fn=lambda t: tc.checkpoint(model, t, use_reentrant=False, context_fn=_KEEP_MATMULS))
    assert not torch.equal(ref.q.weight.grad, model.q.weight.grad)


def test_decorator_form():
    lin = nn.Linear(4, 4)
    calls = []

    @remat.checkpoint(policy="full")
    def block(x, *, scale):
        calls.append(1)
        return lin(x).relu() * scale

    block(torch.randn(2, 4), scale=3.0).sum().backward()
    assert len(calls) == 2 and lin.weight.grad is not None
    assert block.__name__ == "block"


def test_wrap_keeps_names_and_unwrap_restores():
    ref = SeedCifarCNN()
    model = twin(ref)
    keys = list(model.state_dict())
    names = [n for n, _ in model.named_modules()]
    remat.wrap(model.cnn_block_1)
    remat.wrap(model.cnn_block_2, policy="selective")
    assert list(model.state_dict()) == keys and [n for n, _ in model.named_modules()] == names
    assert remat.is_wrapped(model.cnn_block_1) == "full" and remat.is_wrapped(model.head) is None
    x = torch.randn(4, 3, 32, 32)
    step(ref, x)
    step(model, x)
    assert_grads_equal(ref, model)
    remat.unwrap(model.cnn_block_1)
    remat.unwrap(model.cnn_block_2)
    assert "forward" not in vars(model.cnn_block_1) and remat.is_wrapped(model.cnn_block_2) is None


def test_wrap_rejects_bad_policy_and_leaves_module_alone():
    lin = nn.Linear(2, 2)
    with pytest.raises(remat.RematError, match="policy must be one of"):
        remat.wrap(lin, policy="sometimes")
    assert "forward" not in vars(lin)
    with pytest.raises(remat.RematError, match="unknown policy"):
        remat.checkpoint(lin, torch.randn(1, 2), policy="sometimes")


def test_nested_checkpoints_with_batchnorm():
    inner = nn.Sequential(nn.Linear(5, 5), nn.BatchNorm1d(5), nn.Dropout(0.2))
    ref = nn.Sequential(nn.Linear(5, 5), inner, nn.Tanh())
    model = twin(ref)
    x = torch.randn(6, 5)
    step(ref, x)
    step(model, x, fn=lambda t: remat.checkpoint(lambda u: model[2](remat.checkpoint(model[1], model[0](u))), t))
    assert_grads_equal(ref, model)
    assert_buffers_equal(ref, model)


class _SelfAttention(nn.Module):
    """torchvision's ViT encoder block in short: ``nn.MultiheadAttention`` called with one tensor three times,
    which takes another path (three projections, not one) when query, key and value are not the same object."""

    def __init__(self):
        super().__init__()
        self.attention = nn.MultiheadAttention(16, 2, batch_first=True)
        self.same = []

    def forward(self, q, k, v):
        self.same.append(q is k and k is v)
        return self.attention(q, k, v, need_weights=False)[0]


def test_a_tensor_handed_twice_is_one_tensor_when_recomputed_inside_another_region():
    # Inside another region a call's inputs go to torch one by one (NOTE [Regions inside regions]) and came back
    # as three tensors: nn.MultiheadAttention recomputed along its other path, and torch refused the recomputed
    # values' shapes (torchvision's ViT under full-fine, in remat.auto).
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 16), _SelfAttention(), nn.Tanh())
    model = twin(ref)
    x = torch.randn(3, 5, 16)

    def outer(t):
        h = model[0](t)
        return model[2](remat.checkpoint(model[1], h, h, h))

    step(ref, x, fn=lambda t: ref[2](ref[1](*(ref[0](t),) * 3)))
    step(model, x, fn=lambda t: remat.checkpoint(outer, t))
    assert_grads_equal(ref, model)
    assert model[1].same == [True] * 3  # the forward, the outer recomputation, the inner one's


def test_backward_twice_with_retain_graph():
    ref = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh())
    model = twin(ref)
    x = torch.randn(3, 4)
    out_ref = ref(x).sum()
    out_ref.backward(retain_graph=True)
    out_ref.backward()
    h = model[0](x)
    out = remat.checkpoint(lambda t: model[2](model[1](t.mul_(1.0))), h).sum()
    out.backward(retain_graph=True)
    out.backward()
    assert_grads_equal(ref, model)
    assert_buffers_equal(ref, model)


# --- the seed 000 story end to end -----------------------------------------------------------------


def _train_losses(model, forward, steps=30, batch=32):
    gen = torch.Generator().manual_seed(123)
    images = torch.randn(batch, 3, 32, 32, generator=gen)
    labels = torch.randint(0, 10, (batch,), generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for s in range(steps):
        torch.manual_seed(s)  # dropout masks
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(forward(model, images), labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _seed_forward(ckpt):
    def forward(m, x):
        x = ckpt(m.cnn_block_1, x)
        x = ckpt(m.cnn_block_2, x)
        return m.head(m.flatten(x))

    return forward


def test_thirty_steps_identical_with_remat_and_divergent_with_reentrant_torch():
    ref = SeedCifarCNN()
    with_remat, with_torch = twin(ref), twin(ref)
    initial = twin(ref)
    plain = _train_losses(ref, _seed_forward(lambda f, x: f(x)))
    ours = _train_losses(with_remat, _seed_forward(remat.checkpoint))

    def reentrant(f, x):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return tc.checkpoint(f, x, use_reentrant=True)

    theirs = _train_losses(with_torch, _seed_forward(reentrant))
    assert ours == plain  # identical loss sequence, bit for bit
    assert theirs[0] == plain[0]  # same start ...
    assert theirs[-1] != plain[-1] and max(abs(a - b) for a, b in zip(theirs, plain)) > 1e-3  # ... then diverges
    # The reason: reentrant checkpoint on raw input never trained the conv blocks.
    assert torch.equal(with_torch.cnn_block_1[0].weight, initial.cnn_block_1[0].weight)
    assert not torch.equal(with_remat.cnn_block_1[0].weight, initial.cnn_block_1[0].weight)
    for (n, p), (_, q) in zip(ref.named_parameters(), with_remat.named_parameters()):
        assert torch.equal(p, q), n


def test_side_effect_that_changes_recompute_is_a_clear_error():
    calls = []

    def fn(x):
        calls.append(1)
        return x.sin() if len(calls) == 1 else x[:1].sin()  # data shape differs when rerun

    x = torch.randn(3, 4, requires_grad=True)
    with pytest.raises((remat.RematError, RuntimeError)):
        remat.checkpoint(fn, x * 2).sum().backward()


# Under torch.compile: tests/core/test_compiled.py.

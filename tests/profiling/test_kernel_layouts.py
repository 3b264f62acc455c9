"""Fake tensors laid out as the device's kernels lay out their outputs (``remat.profiling._kernel_layouts``)."""

import contextlib
import copy
import functools
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import measure_wrapped
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat.profiling._kernel_layouts import KernelLayouts
from remat.profiling._shadow import ValueShadows


class _Strides(TorchDispatchMode):
    """Every op's name and the strides of the tensors it returns."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.name().startswith(("prim::", "aten::detach")):
            flat = out if isinstance(out, (tuple, list)) else [out]
            self.seen.append((func.name(), [t.stride() for t in flat if isinstance(t, torch.Tensor)]))
        return out


def _weight(n):
    return torch.ones(n, requires_grad=True)


# Each on a non-contiguous input (a transpose or permute), forward and backward.
OPS = {
    "batch_norm 3-d, training": lambda x3, x4: F.batch_norm(x3.transpose(1, 2), None, None, _weight(8), training=True),
    "batch_norm 3-d, eval": lambda x3, x4: F.batch_norm(
        x3.transpose(1, 2), torch.zeros(8), torch.ones(8), _weight(8), training=False
    ),
    "batch_norm 4-d channels-last": lambda x3, x4: F.batch_norm(
        x4.permute(0, 3, 1, 2), None, None, _weight(8), training=True
    ),
    "batch_norm 4-d permuted": lambda x3, x4: F.batch_norm(
        x4.permute(0, 3, 2, 1), None, None, _weight(8), training=True
    ),
    "layer_norm": lambda x3, x4: F.layer_norm(x3.transpose(0, 1), (8,), _weight(8)),
    "group_norm": lambda x3, x4: F.group_norm(x3.transpose(1, 2), 2, _weight(8)),
    "rms_norm": lambda x3, x4: F.rms_norm(x3.transpose(0, 1), (8,), _weight(8)),
    "softmax": lambda x3, x4: x3.transpose(1, 2).softmax(-1),
    "gelu": lambda x3, x4: F.gelu(x3.transpose(1, 2)),
    "linear": lambda x3, x4: F.linear(x3.transpose(1, 2), _weight(64 * 5).view(5, 64)),
    "conv1d": lambda x3, x4: F.conv1d(x3.transpose(1, 2), _weight(8 * 8 * 3).view(8, 8, 3)),
    "max_pool1d": lambda x3, x4: F.max_pool1d(x3.transpose(1, 2), 2),
    "interpolate": lambda x3, x4: F.interpolate(x3.transpose(1, 2), scale_factor=2),
    "cumsum": lambda x3, x4: x3.transpose(1, 2).cumsum(-1),
}


def _strides(op, fake, layer=KernelLayouts):
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else torch.no_grad():
        x3, x4 = torch.ones(4, 64, 8), torch.ones(2, 4, 4, 8)
    x3.requires_grad_(), x4.requires_grad_()
    seen = _Strides()
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else torch.enable_grad(), layer(), seen:
        OPS[op](x3, x4).sum().backward()
    return seen.seen


@pytest.mark.parametrize("op", list(OPS))
def test_fake_outputs_are_laid_out_as_the_cpu_kernels_lay_them_out(op):
    assert _strides(op, fake=True) == _strides(op, fake=False)


@pytest.mark.parametrize("op", list(OPS))
def test_value_shadows_lay_out_outputs_as_kernel_layouts_does(op):
    # the fake profile lays outputs out inside its value shadows' layer, one dispatch layer fewer per op
    assert _strides(op, fake=True, layer=lambda: ValueShadows(layouts=True)) == _strides(op, fake=False)


@pytest.mark.parametrize("layer", ["stacked", "one layer"])
def test_a_laid_out_output_keeps_the_values_of_its_shadow(layer):
    real = torch.randn(2, 4, 8)
    expected = F.batch_norm(real.transpose(1, 2), None, None, training=True)
    mode, shadows = FakeTensorMode(allow_non_fake_inputs=True), ValueShadows(layouts=layer == "one layer")
    with mode:
        fake = torch.empty_strided(real.shape, real.stride())
    shadows.seed(fake, real)
    with mode, shadows, KernelLayouts() if layer == "stacked" else contextlib.nullcontext():
        out = F.batch_norm(fake.transpose(1, 2), None, None, training=True)
    assert out.stride() == expected.stride() and out.stride() != fake.transpose(1, 2).stride()
    assert torch.allclose(shadows.twin(out), expected)


class _BlockNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2, self.bn = nn.Linear(d, 2 * d), nn.Linear(2 * d, d), nn.BatchNorm1d(d)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        y = x + self.fc2(F.gelu(self.fc1(x)))
        return self.bn(y.transpose(1, 2)).transpose(1, 2)  # BatchNorm between transposes


class _Model(nn.Module):
    def __init__(self, d=8, n=3):
        super().__init__()
        self.embed, self.head = nn.Linear(d, d), nn.Linear(d, 4)
        self.blocks = nn.ModuleList(_BlockNorm(d) for _ in range(n))

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h).logsumexp(-1).mean()


def _grads(model, x, assignment):
    modules = dict(model.named_modules())
    try:
        for name, policy in assignment.items():
            remat.wrap(modules[name], policy=policy)
        model(x).backward()
    finally:
        remat.remove(model)
    return {n: p.grad for n, p in model.named_parameters()}


def test_a_fake_profile_of_batch_norm_between_transposes_is_exact():
    # NOTE [Output layouts of the device's kernels]: the fake BatchNorm kept its input's strides, so the fake
    # step made none of the copies the real one makes after it (a full block predicted one activation low).
    torch.manual_seed(0)
    model, x = _Model(), torch.randn(4, 64, 8)
    real = remat.profile(model, x, repeat=1, warmup=0, policies=("keep", "full"))
    fake = remat.profile(model, x, fake=True, target="cpu", policies=("keep", "full"))
    names = [b.name for b in fake.blocks]
    reference = _grads(copy.deepcopy(model), x, {})
    for k in range(2 ** len(names)):
        pick = [("keep", "full")[k >> i & 1] for i in range(len(names))]
        assignment = dict(zip(names, pick))
        measured = measure_wrapped(model, x, assignment).peak_bytes
        # the fake profile is the real one; the real one is exact on uniform assignments, never under on mixes
        assert fake.predict_peak(assignment) == real.predict_peak(assignment) >= measured, pick
        assert real.predict_peak(assignment) == measured or len(set(pick)) > 1, pick
        twin = copy.deepcopy(model)
        calls = [b.calls for b in twin.blocks]
        grads = _grads(twin, x, assignment)
        assert [b.calls - c - 1 for b, c in zip(twin.blocks, calls)] == [int(p == "full") for p in pick]
        assert all(torch.equal(reference[n], g) for n, g in grads.items()), pick


# --- NOTE [A reduced loss on its unreduced storage] ---------------------------------------------------------------

LOSSES = {
    "mse_loss mean": lambda x, t: F.mse_loss(x, t),
    "mse_loss sum": lambda x, t: F.mse_loss(x, t, reduction="sum"),
    "mse_loss none": lambda x, t: F.mse_loss(x, t, reduction="none"),
    "mse_loss broadcast target": lambda x, t: F.mse_loss(x, t[:1].expand_as(x)),
    "smooth_l1_loss": lambda x, t: F.smooth_l1_loss(x, t),
    "smooth_l1_loss beta 0": lambda x, t: F.smooth_l1_loss(x, t, beta=0.0),
    "binary_cross_entropy": lambda x, t: F.binary_cross_entropy(x.sigmoid(), t.sigmoid()),
    "binary_cross_entropy weighted": lambda x, t: F.binary_cross_entropy(x.sigmoid(), t.sigmoid(), weight=t.abs()),
    "soft_margin_loss": lambda x, t: F.soft_margin_loss(x, t.sign()),
    "l1_loss": lambda x, t: F.l1_loss(x, t),
    "huber_loss": lambda x, t: F.huber_loss(x, t),
    "cross_entropy": lambda x, t: F.cross_entropy(x, t.softmax(1)),
}


def _loss_storage(name, layer=None):
    """Bytes of the storage under ``name``'s loss: real (no ``layer``), or fake under ``layer``."""
    x, t = torch.randn(4, 6, 5, requires_grad=True), torch.randn(4, 6, 5)
    if layer is None:
        return LOSSES[name](x, t).untyped_storage().nbytes()
    mode = FakeTensorMode()
    fx, ft = mode.from_tensor(x).requires_grad_(), mode.from_tensor(t)
    with mode, layer():
        return LOSSES[name](fx, ft).untyped_storage().nbytes()


@pytest.mark.parametrize("layer", [KernelLayouts, lambda: ValueShadows(layouts=True)], ids=["layouts", "shadows"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_a_fake_loss_keeps_the_storage_the_cpu_kernel_keeps(name, layer):
    # mse_loss of a (4, 6, 5) prediction: a 0-d loss on a 480-byte storage on CPU, 4 bytes before in a fake run.
    assert _loss_storage(name, layer) == _loss_storage(name)


def test_a_fake_profile_with_an_mse_loss_is_the_real_one():
    # PatchTST's MSE loss left every fake prediction 188 bytes low, and auto's fake floor was refused by a real step.
    torch.manual_seed(0)
    model, x = _Model(), torch.randn(4, 64, 8)
    target = torch.randn(4, 64, 4)

    def loss_fn(out):
        return F.mse_loss(out, target)

    model.forward = lambda h, _m=model: _m.head(functools.reduce(lambda a, b: b(a), _m.blocks, _m.embed(h)))
    real = remat.profile(model, x, loss_fn, repeat=1, warmup=0, policies=("keep", "full"))
    fake = remat.profile(model, x, loss_fn, fake=True, target="cpu", policies=("keep", "full"))
    assert fake.baseline_peak_bytes == real.baseline_peak_bytes
    names = [b.name for b in real.blocks]
    for pick in (("full",) * len(names), ("keep", "full", "keep")):
        assignment = dict(zip(names, pick))
        assert fake.predict_peak(assignment) == real.predict_peak(assignment), pick


# --- NOTE [Mixed-type norms keep float statistics] ----------------------------------------------------------------

_LOW_X = (4, 6, 5)
NORMS = {
    "layer_norm": lambda x, p: F.layer_norm(x, (5,), p(5), p(5)),
    "layer_norm without parameters": lambda x, p: F.layer_norm(x, (5,)),
    "group_norm": lambda x, p: F.group_norm(x, 2, p(6), p(6)),
    "group_norm weight only": lambda x, p: F.group_norm(x, 3, p(6)),
    "batch_norm training": lambda x, p: F.batch_norm(x, p(6).detach(), p(6).detach() + 1, p(6), p(6), training=True),
    "batch_norm eval": lambda x, p: F.batch_norm(x, p(6).detach(), p(6).detach() + 1, p(6), p(6), training=False),
    "batch_norm no statistics": lambda x, p: F.batch_norm(x, None, None, p(6), p(6), training=True),
}


class _Dtypes(TorchDispatchMode):
    """The dtype and storage bytes of every output of every op."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = out if isinstance(out, (tuple, list)) else [out]
        if not func.name().startswith(("prim::", "aten::detach")):
            self.seen.append([(t.dtype, t.untyped_storage().nbytes()) for t in flat if isinstance(t, torch.Tensor)])
        return out


def _norm_outputs(name, layer=None):
    """Each op's output dtypes and bytes for ``name`` on a bf16 input with float32 parameters, forward and
    backward: real (no ``layer``) or fake under ``layer``."""
    x = torch.randn(*_LOW_X).to(torch.bfloat16).requires_grad_()
    mode = FakeTensorMode() if layer is not None else None
    if mode is not None:
        x = mode.from_tensor(x.detach()).requires_grad_()
    seen = _Dtypes()
    with mode or contextlib.nullcontext():

        def param(n):
            return torch.rand(n).requires_grad_()

        with layer() if layer is not None else contextlib.nullcontext(), seen:
            NORMS[name](x, param).float().sum().backward()
    return seen.seen


@pytest.mark.parametrize("layer", [KernelLayouts, lambda: ValueShadows(layouts=True)], ids=["layouts", "shadows"])
@pytest.mark.parametrize("name", list(NORMS))
def test_a_fake_mixed_type_norm_keeps_the_statistics_the_cpu_kernel_keeps(name, layer):
    # A bf16 LayerNorm with float32 parameters keeps float32 mean and rstd on CPU; its fake kernel returned bf16.
    assert _norm_outputs(name, layer) == _norm_outputs(name)


@pytest.mark.parametrize("cuda", [False, True])
def test_a_bf16_layer_norm_keeps_float_statistics_on_cuda_only(cuda):
    # With bf16 parameters the CPU kernel keeps bf16 statistics (as the fake one), CUDA's its float accumulation type.
    mode = FakeTensorMode()
    with mode, KernelLayouts(cuda=cuda):
        x, w = torch.randn(4, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16)
        _, mean, rstd = torch.ops.aten.native_layer_norm.default(x, [8], w, w, 1e-5)
    ones = torch.ones(8, dtype=torch.bfloat16)
    _, real_mean, _ = torch.ops.aten.native_layer_norm.default(torch.randn(4, 8).bfloat16(), [8], ones, ones, 1e-5)
    assert real_mean.dtype == torch.bfloat16  # the CPU kernel
    assert mean.dtype == rstd.dtype == (torch.float32 if cuda else torch.bfloat16)


# --- the same rules against CUDA's kernels (run by #31's GPU session; skipped without CUDA) -----------------------

_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@_CUDA
@pytest.mark.parametrize("name", [n for n in LOSSES if "beta 0" not in n])
def test_a_cuda_loss_keeps_the_storage_a_fake_run_for_cuda_gives(name):
    x, t = torch.randn(4, 6, 5, device="cuda", requires_grad=True), torch.randn(4, 6, 5, device="cuda")
    real = LOSSES[name](x, t).untyped_storage().nbytes()
    assert _loss_storage(name, lambda: KernelLayouts(cuda=True)) == real


@_CUDA
@pytest.mark.parametrize("parameters", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", ["layer_norm", "group_norm", "batch_norm training"])
def test_cuda_norm_statistics_have_the_dtype_a_fake_run_for_cuda_gives(norm, parameters):
    x = torch.randn(*_LOW_X, device="cuda").bfloat16()
    with _Dtypes() as cuda_seen:
        real = NORMS[norm](x, lambda n: torch.rand(n, device="cuda", dtype=parameters))
    cuda_stats = next(out for out in cuda_seen.seen if len(out) >= 3)[1:3]
    mode = FakeTensorMode()
    with mode, KernelLayouts(cuda=True), _Dtypes() as seen:
        NORMS[norm](mode.from_tensor(x.cpu()), lambda n: torch.rand(n, dtype=parameters))
    fake_stats = next(out for out in seen.seen if len(out) >= 3)[1:3]
    assert real.dtype == torch.bfloat16
    assert [dtype for dtype, _ in fake_stats] == [dtype for dtype, _ in cuda_stats]


# --- NOTE [Grouped matmuls in float32] ------------------------------------------------------------------------

_OFFS = torch.tensor([8, 16, 24], dtype=torch.int32)
#: The four forms of torch._grouped_mm: (mat_a, mat_b) shapes, offsets where a side is 2-d.
GROUPED = {
    "2d x 3d (tokens by experts)": ((24, 8), (3, 8, 16), _OFFS),
    "3d x 2d": ((3, 8, 8), (8, 24), _OFFS),
    "2d x 2d (weight gradient)": ((8, 24), (24, 16), _OFFS),
    "3d x 3d": ((3, 8, 8), (3, 8, 16), None),
}


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="no torch._grouped_mm")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("form", list(GROUPED))
@pytest.mark.parametrize("layer", [KernelLayouts, lambda: ValueShadows(layouts=True)], ids=["layouts", "shadows"])
def test_a_fake_grouped_mm_in_a_type_the_cpu_kernel_runs_is_its_output(layer, form, dtype):
    a_shape, b_shape, offs = GROUPED[form]
    a, b = torch.randn(a_shape, dtype=dtype), torch.randn(b_shape, dtype=dtype)
    real = torch._grouped_mm(a, b, offs)
    mode = FakeTensorMode()
    fa, fb = mode.from_tensor(a), mode.from_tensor(b)
    fo = mode.from_tensor(offs) if offs is not None else None
    with mode, layer():
        fake = torch._grouped_mm(fa, fb, fo)
    assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)
    assert fake.untyped_storage().nbytes() == real.untyped_storage().nbytes()


def test_a_fake_grouped_mm_for_cuda_keeps_the_meta_kernels_check():
    # The meta kernel implements the CUDA kernel's checks: float32 is refused up to torch 2.14 ("Expected inputs of
    # BF16 type") and taken from 2.15, as CUDA's kernel takes it. For a CUDA target remat changes neither.
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("no torch._grouped_mm")
    mode = FakeTensorMode()
    a, b = mode.from_tensor(torch.randn(24, 8)), mode.from_tensor(torch.randn(3, 8, 16))
    offs = mode.from_tensor(_OFFS)

    def outcome(*layers):
        with mode, contextlib.ExitStack() as stack:
            for layer in layers:
                stack.enter_context(layer)
            try:
                out = torch._grouped_mm(a, b, offs)
            except RuntimeError as exc:
                return "refused", str(exc).splitlines()[0]
            return "ran", out.shape, out.stride(), out.dtype

    meta = outcome()
    assert outcome(KernelLayouts(cuda=True)) == meta
    if meta[0] == "refused":
        assert re.search("(?i)bf16|bfloat16", meta[1]), meta

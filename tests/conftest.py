import copy
import warnings

import pytest
import torch
from torch import nn

import remat

#: Small zoo sizes for the profile, plan and conflict tests (seconds each).
SMALL = {
    "seed-cifar": {"batch": 16},
    "gpt2": {"layers": 3, "hidden": 64, "heads": 4, "vocab": 512, "seq": 64, "batch": 2},
    "llama": {"layers": 3, "hidden": 64, "intermediate": 172, "heads": 4, "kv_heads": 2, "vocab": 512, "seq": 64,
              "batch": 2},
}


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.fixture(autouse=True)
def _no_torch_checkpoint_warnings():
    # No torch warning may reach a remat user; tests that use torch's own
    # checkpoint on purpose suppress them locally.
    with warnings.catch_warnings():
        warnings.filterwarnings("error", module="torch.utils.checkpoint")
        yield


def twin(model):
    """An identical copy of ``model`` (weights, buffers, flags)."""
    return copy.deepcopy(model)


def grads(model):
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}


def assert_grads_equal(ref, model):
    gr, gm = grads(ref), grads(model)
    assert gr.keys() == gm.keys()
    for name in gr:
        if gr[name] is None:
            assert gm[name] is None, f"{name}: expected no grad"
        else:
            assert gm[name] is not None, f"{name}: got no gradient"
            assert torch.equal(gr[name], gm[name]), f"{name}: gradients differ"


def assert_buffers_equal(ref, model):
    for (n, a), (_, b) in zip(ref.named_buffers(), model.named_buffers(), strict=True):
        assert torch.equal(a, b), f"buffer {n} differs: {a.flatten()[:4]} vs {b.flatten()[:4]}"


def step(model, x, seed=1, fn=None):
    """Forward + sum-loss + backward under ``seed``; returns (output, rng state after)."""
    torch.manual_seed(seed)
    out = (fn or model)(x)
    out.float().sum().backward()
    return out.detach(), torch.get_rng_state()


def assert_state_equal(a, b):
    """Two remat.core._state snapshots are identical: parameters, grads, flags, buffers, training, RNG."""
    assert a.params.keys() == b.params.keys()
    for name in a.params:
        (da, ga, ra), (db, gb, rb) = a.params[name], b.params[name]
        assert torch.equal(da, db) and ra == rb, name
        assert (ga is None and gb is None) or torch.equal(ga, gb), name
    for name in a.buffers:
        assert torch.equal(a.buffers[name], b.buffers[name]), name
    assert a.training == b.training
    assert torch.equal(a.cpu_rng, b.cpu_rng)


def measure_wrapped(model, inputs, assignment, loss_fn=None, *, warmup=0, repeat=1):
    """``remat.measure`` with every block of ``assignment`` wrapped in its policy (unwrapped after)."""
    modules = dict(model.named_modules())
    try:
        for name, policy in assignment.items():
            remat.wrap(modules[name], policy=policy)
        return remat.measure(model, inputs, loss_fn, warmup=warmup, repeat=repeat)
    finally:
        remat.remove(model)


def measure_assignment(zoo, assignment, *, warmup=0, repeat=1):
    """:func:`measure_wrapped` for a zoo model."""
    return measure_wrapped(zoo.model, zoo.inputs, assignment, zoo.loss_fn, warmup=warmup, repeat=repeat)


class Untouched:
    """What bad input must leave as it was: parameters, gradients, buffers, ``training`` and
    ``requires_grad`` flags, the RNG streams, ``state_dict`` keys, instance-level forwards
    (remat's wrapping) and Hugging Face ``use_cache`` flags. ``Untouched(model)`` snapshots;
    ``.check()`` asserts nothing changed."""

    def __init__(self, model):
        from remat.core._state import capture

        self.model, self.before, self.keys = model, capture(model), list(model.state_dict())
        self.forwards = {n: m.__dict__.get("forward") for n, m in model.named_modules()}
        self.caches = {n: m.config.use_cache for n, m in model.named_modules() if hasattr(m, "config")
                       and hasattr(m.config, "use_cache")}

    def check(self):
        from remat.core._state import capture

        model = self.model
        assert_state_equal(self.before, capture(model))
        assert list(model.state_dict()) == self.keys
        assert {n: m.__dict__.get("forward") for n, m in model.named_modules()} == self.forwards
        assert {n: m.config.use_cache for n, m in model.named_modules() if n in self.caches} == self.caches


class TensorParallelBlock(nn.Module):
    """A pre-norm MLP block; with tensor parallelism its norm and MLP see DTensors."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.act, self.down = nn.LayerNorm(32), nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(self.act(self.up(self.norm(x)))))


@pytest.fixture
def one_rank_group():
    """A one-process gloo group and its 1-device CPU mesh: tensor parallelism's DTensors without a second rank."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed with gloo and no process group yet")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def tensor_parallel(model, mesh):
    """Each TensorParallelBlock of ``model``: sequence-parallel norm, column- then row-parallel MLP."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    for block in model.modules():
        if isinstance(block, TensorParallelBlock):
            parallelize_module(block, mesh, {"norm": SequenceParallel(), "up": ColwiseParallel(),
                                             "down": RowwiseParallel()})
    return model

import copy
import gc
import itertools
import pathlib
import signal
import warnings

import pytest
import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils._pytree import tree_flatten

import remat

#: Small zoo sizes for the profile, plan and conflict tests (seconds each).
SMALL = {
    "seed-cifar": {"batch": 16},
    "gpt2": {"layers": 3, "hidden": 64, "heads": 4, "vocab": 512, "seq": 64, "batch": 2},
    "llama": {
        "layers": 3,
        "hidden": 64,
        "intermediate": 172,
        "heads": 4,
        "kv_heads": 2,
        "vocab": 512,
        "seq": 64,
        "batch": 2,
    },
}


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="also run the tests marked slow (long property runs)")


def _needs_cuda(item) -> bool:
    return any("CUDA" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif"))


#: The test files ``make test-fast`` runs (each well under a minute on a 2-core CPU); every other file is
#: marked ``heavy``: they run whole models through profiles, plans and verification.
_FAST_FILES = {
    "core/test_by_module.py",
    "core/test_by_module_hooks.py",
    "core/test_checkpoint.py",
    "core/test_conflicts.py",
    "core/test_fingerprint.py",
    "core/test_hf.py",
    "core/test_measure.py",
    "core/test_region.py",
    "core/test_rng.py",
    "core/test_state.py",
    "core/test_timing.py",
    "core/test_torch_options.py",
    "core/test_torch_suite.py",
    "profiling/test_shadow.py",
    "profiling/test_trace.py",
    "profiling/test_workspace.py",
    "profiling/test_cuda_kernels.py",
    "profiling/test_cuda_autocast.py",
    "test_api.py",
    "test_benchmarks_doc.py",
    "test_house.py",
}


def _is_heavy(item) -> bool:
    path = pathlib.Path(str(item.fspath)).resolve()
    return path.relative_to(pathlib.Path(__file__).resolve().parent).as_posix() not in _FAST_FILES


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _needs_cuda(item):
            item.add_marker(pytest.mark.gpu)
        if _is_heavy(item):
            item.add_marker(pytest.mark.heavy)
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --slow")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _python_handles_ctrl_c():
    # A shell starts a background job with SIGINT ignored, and Python then installs no handler of its own; the
    # Ctrl-C tests stand for a user at a terminal, whose Python has its default handler.
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    if ignored:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


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
        self.caches = {
            n: m.config.use_cache
            for n, m in model.named_modules()
            if hasattr(m, "config") and hasattr(m.config, "use_cache")
        }

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
            parallelize_module(
                block, mesh, {"norm": SequenceParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}
            )
    return model


class ResidualMLP(nn.Module):
    """``x + Linear(GELU(Linear(x)))``: a block of the chains the input-gradient tests plan."""

    def __init__(self, width, hidden):
        super().__init__()
        self.up, self.act, self.down = nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(self.act(self.up(x)))


def residual_chain(depth=4, width=32, hidden=128, stem=False):
    """An ``nn.Sequential`` of residual MLP blocks; ``stem``: a Linear before them (the input's gradient is then
    made in glue, after the first block's backward)."""
    blocks = nn.Sequential(*[ResidualMLP(width, hidden) for _ in range(depth)])
    return nn.Sequential(nn.Linear(width, width), blocks) if stem else blocks


class Interruptible(nn.Module):
    """Blocks with BatchNorm (buffers) and dropout (RNG), the middle one checkpointed as a user would, an
    attribute and a list its forward changes (Python state the doctor watches), and a Ctrl-C: its forward
    raises KeyboardInterrupt on call ``at`` (counted where no restore puts it back)."""

    def __init__(self, at=None):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.2)) for _ in range(3)
        )
        self.blocks[2].eval()
        self.blocks[0][0].bias.requires_grad_(False)
        self.blocks[0][0].weight.grad = torch.ones(8, 8)
        self.at, self.calls = at, itertools.count()
        self.steps, self.seen = 0, []

    def forward(self, x):
        if next(self.calls) == self.at:
            raise KeyboardInterrupt
        self.steps += 1
        self.seen.append(self.steps)
        x = self.blocks[0](x)
        x = torch.utils.checkpoint.checkpoint(self.blocks[1], x, use_reentrant=False)
        return self.blocks[2](x)


class UntouchedByCtrlC(Untouched):
    """:class:`Untouched`, and the optimizer's state, every module's hooks and the global ones (and with
    ``python``, the Python values of an :class:`Interruptible`, which the doctor restores), after a remat call
    that a Ctrl-C stopped (which must propagate)."""

    def __init__(self, model, optimizer=None, *, python=False):
        super().__init__(model)
        self.optimizer, self.check_python = optimizer, python
        self.opt_state = None if optimizer is None else copy.deepcopy(optimizer.state_dict())
        self.python = (model.steps, model.seen, list(model.seen))
        self.hooks = self._hooks()

    def _hooks(self):
        module = torch.nn.modules.module
        return (
            [(dict(m._forward_pre_hooks), dict(m._forward_hooks)) for m in self.model.modules()],
            dict(module._global_forward_pre_hooks),
            dict(module._global_forward_hooks),
        )

    def check(self, call):
        with pytest.raises(KeyboardInterrupt):
            call()
        super().check()
        model = self.model
        if self.check_python:
            assert (model.steps, model.seen) == self.python[:2] and model.seen is self.python[1]
            assert model.seen == self.python[2]
        assert self._hooks() == self.hooks
        if self.optimizer is not None:
            (now, spec), (before, spec_before) = tree_flatten(self.optimizer.state_dict()), tree_flatten(self.opt_state)
            assert spec == spec_before
            assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(now, before))


def ctrl_c_while_restoring_rng(monkeypatch, start):
    """Ctrl-C pressed again and again: from ``torch.set_rng_state``'s call ``start`` on, a real SIGINT lands
    each time remat puts the RNG state back (restores are mostly tensor copies no test can interrupt)."""
    calls, set_rng_state = itertools.count(), torch.set_rng_state

    def interrupted(state):
        if next(calls) >= start:
            signal.raise_signal(signal.SIGINT)
        set_rng_state(state)

    monkeypatch.setattr(torch, "set_rng_state", interrupted)


def gpu_for(budget: int) -> int:
    """The GPU a plan of ``budget`` allocated bytes is made for: the budget and the share ``budget=None`` leaves the
    caching allocator (NOTE [Fitting a device]): it reserves whole segments (20 MiB for blocks of 1 to 10 MiB), so a
    step's reserved peak runs above its allocated one by up to a segment, whatever the model's size."""
    from remat.planning._gpu_room import FRAGMENTATION_MARGIN

    return int(budget / (1 - FRAGMENTATION_MARGIN))


@pytest.fixture(autouse=True)
def _a_gpu_test_starts_without_the_last_ones_tensors(request):
    # A failed test's frames, and the tensors they hold, stay alive in reference cycles until the next
    # collection (pytest 9: seen with a weak reference and the collector off). On a GPU the next test would
    # count that memory as its own, and a capped device would refuse it.
    if torch.cuda.is_available() and request.node.get_closest_marker("gpu") is not None:
        gc.collect()
        torch.cuda.empty_cache()
    yield


@pytest.fixture
def on_a_smaller_gpu(monkeypatch):
    """Deterministic CUDA kernels, and ``cap(bytes)``: the allocator refuses more than that until the test ends."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

    def cap(limit):
        gc.collect()  # tensors of the test's own earlier steps, left in cycles (the fixture above)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.set_per_process_memory_fraction(limit / torch.cuda.get_device_properties(0).total_memory)
        # shown with a failure: what the process held when the device was made smaller
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        print(f"on_a_smaller_gpu: cap {limit} bytes; {allocated} allocated, {reserved} reserved when capped")

    yield cap
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()


def tiny_t5(decoder_layers=2):
    """A T5 with random weights in training mode, and a batch with labels; its configs have use_cache on."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = tf.T5Config(
        d_model=32,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=decoder_layers,
        num_heads=2,
        d_kv=16,
        vocab_size=100,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    ids = torch.randint(1, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    return tf.T5ForConditionalGeneration(config).train(), {"input_ids": ids, "labels": ids}


def prefix_tuned_llama():
    """A 4-layer Llama under peft's prefix tuning (every layer handed its own prefix keys and values in one
    cache), and a batch with labels."""
    tf = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
    )
    model = peft.get_peft_model(
        tf.LlamaForCausalLM(config), peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=8)
    )
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}

"""What a traced forward must not miss (NOTE [What a trace must not miss] in ``remat.profiling._traced_cut``), and
traced plans compared with the model's own forward (NOTE [A traced forward is compared with the model's own])."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from conftest import Untouched, assert_grads_equal, twin
from torch import nn

import remat
from remat.profiling import _traced_cut
from remat.profiling._traced import HOLDER
from remat.profiling._traced_cut import TracedError, traced


class _RoundSTE(torch.autograd.Function):
    """A straight-through estimator: rounds forward, passes the gradient through unchanged."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Layers(nn.Module):
    """Eight linear maps and a tanh after each, in a forward with no submodules (remat cuts it along its trace);
    ``between`` runs after the fourth."""

    def __init__(self, between=None):
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(32, 32) / 6) for _ in range(8))
        self.between = between

    def forward(self, x):
        for i, weight in enumerate(self.weights):
            x = torch.tanh(x @ weight)
            if i == 3 and self.between is not None:
                x = self.between(x)
        return x


def _ste(x):
    return _RoundSTE.apply(x)


def _no_grad_centre(x):
    with torch.no_grad():
        mean = x.mean(0, keepdim=True)
    return x - mean


def _grad_off_centre(x):
    with torch.set_grad_enabled(False):
        mean = x.mean(0, keepdim=True)
    return x - mean


def _autocast_matmul(x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = x @ x.T @ x
    return x + 0.01 * y.float()


def _inference_scale(x):
    with torch.inference_mode():
        scale = x.abs().amax()
    return x / scale.clone()


def _lowish_budget(model, x):
    prof = remat.profile(model, x, repeat=1, warmup=0)
    return prof, (remat.plan(prof, strategy="none").min_peak_bytes + prof.baseline_peak_bytes) // 2


def test_an_autograd_function_is_one_call_of_the_trace_and_keeps_its_backward():
    torch.manual_seed(0)
    model, x = _Layers(_ste), torch.randn(64, 32)
    reference = twin(model)
    prof, budget = _lowish_budget(model, x)
    assert all(b.name.startswith(HOLDER + ".") for b in prof.blocks)
    plan = remat.auto(model, x, budget=budget, repeat=1, warmup=0)
    try:
        assert plan.checkpointed
        model(x).sum().backward()
        reference(x).sum().backward()
        assert reference.weights[0].grad.abs().sum() > 0  # the STE passes gradients on
        assert_grads_equal(reference, model)
    finally:
        remat.remove(model)


@pytest.mark.parametrize(
    "between", [_no_grad_centre, _grad_off_centre, _autocast_matmul, _inference_scale], ids=lambda f: f.__name__
)
def test_a_forward_that_changes_grad_mode_or_autocast_is_not_traced_and_left_as_it_was(between):
    torch.manual_seed(0)
    model, x = _Layers(between), torch.randn(64, 32)
    reference, untouched = twin(model), Untouched(model)
    with pytest.raises(TracedError, match="turns gradients off or autocast on"):
        traced(model, True)
    for call in (lambda: remat.profile(model, x), lambda: remat.auto(model, x, budget=0.5)):
        with pytest.raises(remat.RematError, match="cannot cut its traced forward.*turns gradients off"):
            call()
        untouched.check()
    model(x).sum().backward()
    reference(x).sum().backward()
    assert_grads_equal(reference, model)


def test_a_trace_that_misses_a_function_is_caught_by_verification(monkeypatch):
    # The tracer of before (Function traced through): every traced plan, all-keep too, trains gradients of 0 in the
    # first layers; compared with the model's own forward, auto refuses every traced plan instead of applying one.
    monkeypatch.setattr(_traced_cut, "_functions_as_calls", lambda tracer: contextlib.nullcontext())
    monkeypatch.setattr(_traced_cut, "_grad_and_autocast", lambda: ())
    torch.manual_seed(0)
    model, x = _Layers(_ste), torch.randn(64, 32)
    reference = twin(model)
    _, budget = _lowish_budget(model, x)
    with pytest.raises(remat.RematError, match="the trace misses something the forward does"):
        remat.auto(model, x, budget=budget, repeat=1, warmup=0)
    try:
        model(x).sum().backward()
        reference(x).sum().backward()
        assert_grads_equal(reference, model)
    finally:
        remat.remove(model)


class _Counts(_Layers):
    """Counts its steps in a buffer with ``+=``: fx sees a Proxy rebound where the buffer was."""

    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.steps += 1
        return super().forward(x)


class _CountsCalls(_Layers):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


def _fork_noise(x):
    with torch.random.fork_rng():
        return x + 0.01 * torch.randn_like(x)


@pytest.mark.parametrize(
    "make, why",
    [
        (_Counts, "rebinds buffer 'steps'"),
        (_CountsCalls, "changes attribute 'calls'"),
        (lambda: _Layers(_fork_noise), "sets a random generator's state"),
    ],
    ids=["buffer-rebound", "python-counter", "fork-rng"],
)
def test_state_the_trace_would_miss_is_put_back_and_refused(make, why):
    torch.manual_seed(0)
    model = make()
    buffers = dict(model._buffers)
    untouched = Untouched(model)
    with pytest.raises(TracedError, match=why):
        traced(model, True)
    untouched.check()
    assert all(model._buffers[k] is b for k, b in buffers.items())  # the tensors themselves, not Proxies
    assert vars(model).get("calls", 0) == 0
    torch.save(model.state_dict(), _Sink())


class _Sink:
    def write(self, data):
        return len(data)

    def flush(self):
        pass


class _Scaled(_Layers):
    """Reads a plain attribute (a schedule's value) and the grad mode: a trace holds both as they were."""

    def __init__(self):
        super().__init__(lambda x: x * self.alpha * (2.0 if torch.is_grad_enabled() else 1.0))
        self.alpha = 1.0


def _traced_plan(cls):
    """``cls()`` under a traced plan of auto's, an input, and a twin without one."""
    torch.manual_seed(0)
    model, x = cls(), torch.randn(64, 32)
    reference = twin(model)
    _, budget = _lowish_budget(model, x)
    plan = remat.auto(model, x, budget=budget, repeat=1, warmup=0)
    assert any(name.startswith(HOLDER + ".") for name in plan.checkpointed)
    return model, x, reference


def test_a_traced_plan_runs_the_class_forward_once_an_attribute_it_read_changes_or_without_gradients():
    model, x, reference = _traced_plan(_Scaled)
    try:
        with torch.no_grad():
            assert torch.equal(model(x), reference(x))
        model.alpha = reference.alpha = 0.25
        with pytest.warns(UserWarning, match="alpha changed since the model's forward was traced"):
            model(x).sum().backward()
        reference(x).sum().backward()
        assert_grads_equal(reference, model)
    finally:
        remat.remove(model)


class _Gained(_Layers):
    """A leaf module fx calls as it is (it reads its own attributes at each call), and a gain looked up with a
    default: the trace holds that it found none."""

    def __init__(self):
        super().__init__(nn.LeakyReLU(0.1))

    def forward(self, x):
        return super().forward(x) * getattr(self, "gain", 1.0)


def _spied(model):
    """The class forwards the traced forward falls back to, counted."""
    own, calls = model.forward.own, []

    def counted(*args, **kwargs):
        calls.append(1)
        return own(*args, **kwargs)

    model.forward.own = counted
    return calls


def test_a_traced_plan_watches_only_the_attributes_its_trace_read():
    # NOTE [The attributes a trace holds]
    model, x, reference = _traced_plan(_Gained)
    try:
        fallbacks = _spied(model)
        model.between.negative_slope = reference.between.negative_slope = 0.3  # read by the leaf at each call
        model.global_step = 7  # a training loop's counter, read by no forward
        model.between.calls = 1
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model(x).sum().backward()
        reference(x).sum().backward()
        assert_grads_equal(reference, model)
        assert not fallbacks  # the traced segments ran, with the slope the leaf read then
        model.gain = reference.gain = 0.5  # absent when traced: the trace holds 1.0
        with pytest.warns(UserWarning, match="gain changed since the model's forward was traced"):
            model(x).sum().backward()
        reference(x).sum().backward()
        assert_grads_equal(reference, model)
        assert fallbacks
    finally:
        remat.remove(model)


def test_a_model_is_traced_again_only_when_what_its_trace_read_changes(monkeypatch):
    # NOTE [One trace per model and mode]
    model, traces = _Gained(), []
    trace = _traced_cut._trace
    monkeypatch.setattr(_traced_cut, "_trace", lambda *a: traces.append(1) or trace(*a))
    first = traced(model, True)
    model.global_step = 7  # a training loop's counter, read by no forward
    model.between._remat_seen = True  # what remat keeps on a module
    model.between.negative_slope = 0.3  # read by the leaf at each call, not by the trace
    assert traced(model, True) is first and len(traces) == 1
    model.gain = 0.5  # looked for and not found while tracing: the trace holds 1.0
    again = traced(model, True)
    assert again is not first and again.reads[("", "gain")] == 0.5 and len(traces) == 2
    assert traced(model, False) is not again and len(traces) == 3  # another mode
    model.between = nn.Tanh()  # another module called
    assert traced(model, False).gm.between is model.between and len(traces) == 4


def test_recording_the_reads_of_a_trace_leaves_module_attribute_lookup_as_it_was():
    from remat.profiling._traced_reads import MISSING, reads_recorded

    module, reads = nn.Linear(2, 2), {}
    with reads_recorded(reads):
        assert module.in_features == 2 and getattr(module, "gain", None) is None and module.weight.shape == (2, 2)
    assert reads == {(module, "in_features"): 2, (module, "gain"): MISSING}
    assert "__getattribute__" not in nn.Module.__dict__

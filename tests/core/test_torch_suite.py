"""The cases of torch's own checkpoint tests (TestCheckpoint in test_utils.py, TestNestedCheckpoint in
test_autograd.py), written for remat: reentrant calls, checkpoint_sequential with torch's checkpoint
redirected to remat's, nested checkpoints whose functions call torch.autograd.grad. Each compares with
no checkpointing and with torch's non-reentrant checkpoint, bit for bit (torch.equal, seeds set).

Where torch's test asserts what only the reentrant implementation does (refusing torch.autograd.grad,
an output that is a fresh tensor), remat's answer is the non-reentrant one, and the test says so.
"""

import collections
import contextlib
import functools
import random
import warnings
import weakref

import pytest
import torch
import torch.utils.checkpoint as tuc
from conftest import assert_buffers_equal, assert_grads_equal, twin
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat.core import _torch_options

REENTRANT_WARNING = "use_reentrant=True is run with remat's non-reentrant checkpoint"


@pytest.fixture(autouse=True)
def _fresh_warning_sites(monkeypatch):
    monkeypatch.setattr(_torch_options, "_SITES", set(), raising=False)


@pytest.fixture
def redirected(monkeypatch):
    """torch.utils.checkpoint.checkpoint is remat.checkpoint (torch's checkpoint_sequential looks it up)."""
    monkeypatch.setattr(tuc, "checkpoint", remat.checkpoint)


def _torch_nonreentrant(fn, *args, **kwargs):
    return tuc.checkpoint(fn, *args, use_reentrant=False, **kwargs)


def _reentrant(fn, *args, **kwargs):
    _torch_options._SITES.clear()  # every call from this one line warns again
    with pytest.warns(UserWarning, match=REENTRANT_WARNING):
        return remat.checkpoint(fn, *args, use_reentrant=True, **kwargs)


# --- checkpoint_sequential through remat --------------------------------------------------------------------


def _mlp():
    return nn.Sequential(nn.Linear(100, 50), nn.ReLU(), nn.Linear(50, 20), nn.ReLU(), nn.Linear(20, 5), nn.ReLU())


class ModuleListNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.module_list = nn.ModuleList(list(_mlp()))

    def forward(self, x):
        for layer in self.module_list:
            x = layer(x)
        return x


def _sequential_run(model, functions, x, use_reentrant):
    """Output, input gradient and parameter gradients of checkpoint_sequential(functions, 2, x)."""
    model.zero_grad()
    x = x.detach().requires_grad_()
    kwargs = {} if use_reentrant == "unset" else {"use_reentrant": use_reentrant}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = tuc.checkpoint_sequential(functions, 2, x, **kwargs)
        out.sum().backward()
    told = [w for w in record if REENTRANT_WARNING in str(w.message)]
    assert len(told) == (0 if use_reentrant is False else 1)  # torch passes True when unset
    return out.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}


def _assert_runs_equal(a, b):
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[2].keys() == b[2].keys() and all(torch.equal(a[2][n], b[2][n]) for n in a[2])


@pytest.mark.parametrize("use_reentrant", [True, False, "unset"])
@pytest.mark.parametrize("as_list", [False, True], ids=["module", "children"])
@pytest.mark.parametrize("make", [_mlp, ModuleListNet], ids=["sequential", "module-list"])
def test_checkpoint_sequential_through_remat_matches_no_checkpointing(redirected, make, as_list, use_reentrant):
    model = make()
    seq = model if isinstance(model, nn.Sequential) else model.module_list
    functions = list(seq.children()) if as_list else seq
    x = torch.randn(1, 100)
    x_plain = x.detach().requires_grad_()
    out = model(x_plain)
    out.sum().backward()
    plain = (out.detach(), x_plain.grad, {n: p.grad.clone() for n, p in model.named_parameters()})
    ours = _sequential_run(model, functions, x, use_reentrant)
    _assert_runs_equal(ours, plain)


def test_checkpoint_sequential_through_remat_equals_torchs_own(monkeypatch):
    model = _mlp()
    x = torch.randn(3, 100)
    theirs = _sequential_run(model, model, x, False)
    monkeypatch.setattr(tuc, "checkpoint", remat.checkpoint)
    _assert_runs_equal(_sequential_run(model, model, x, True), theirs)


class Counted(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0
        self.recomputing = []

    def forward(self, x):
        self.calls += 1
        self.recomputing.append(remat.is_recomputing())
        return x * torch.tensor(2.0)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoint_sequential_recomputes_every_segment_but_the_last(redirected, use_reentrant):
    modules = [Counted() for _ in range(10)]
    x = torch.randn(3, 4, requires_grad=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*" + REENTRANT_WARNING)
        out = tuc.checkpoint_sequential(modules, 2, x, use_reentrant=use_reentrant)
    assert [m.calls for m in modules] == [1] * 10
    out.sum().backward()
    assert [m.calls for m in modules] == [2] * 5 + [1] * 5
    assert all(m.recomputing == [False, True] for m in modules[:5])
    assert torch.equal(x.grad, torch.full((3, 4), 2.0**10))


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoint_sequential_of_modules_taking_two_or_no_inputs_is_a_type_error(redirected, use_reentrant):
    class Two(nn.Module):
        def forward(self, a, b):
            return a, b

    class Noop(nn.Module):
        def forward(self):
            return None

    a, b = torch.randn(1, 4, requires_grad=True), torch.randn(1, 4, requires_grad=True)
    with pytest.raises(TypeError):
        tuc.checkpoint_sequential(nn.Sequential(Two()), 1, a, b, use_reentrant=use_reentrant)
    with pytest.raises(TypeError):
        tuc.checkpoint_sequential(nn.Sequential(Noop()), 1, use_reentrant=use_reentrant)


def test_grad_with_create_graph_through_reentrant_calls_works_and_matches(redirected):
    # torch's reentrant checkpoint refuses torch.autograd.grad ("incompatible with .grad()"); remat runs it.
    model = _mlp()
    x = torch.randn(1, 100, requires_grad=True)
    plain = torch.autograd.grad(model(x), x, torch.ones(1, 5), create_graph=True)[0]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*" + REENTRANT_WARNING)
        out = tuc.checkpoint_sequential(list(model.children()), 2, x, use_reentrant=True)
    assert torch.equal(out, model(x))
    ours = torch.autograd.grad(out, x, torch.ones(1, 5), create_graph=True)[0]
    assert torch.equal(ours, plain) and ours.requires_grad == plain.requires_grad


# --- checkpoint(..., use_reentrant=True): torch's TestCheckpoint cases -----------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_dropout_inside_and_outside_reentrant_call_gives_the_plain_gradients(seed):
    torch.manual_seed(seed)
    inp = torch.randn(2000).requires_grad_()
    phase1, phase2 = nn.Dropout(), nn.Dropout()
    state = torch.get_rng_state()
    _reentrant(phase2, phase1(inp)).sum().backward()
    ours, inp.grad = inp.grad, None
    after = torch.get_rng_state()
    torch.set_rng_state(state)
    phase2(phase1(inp)).sum().backward()
    assert torch.equal(ours, inp.grad)
    assert torch.equal(after, torch.get_rng_state())


def test_none_among_the_inputs():
    x = torch.randn(1, 100, requires_grad=True)
    out = _reentrant(lambda a, b: a if b is None else a + b, x, None)
    out.sum().backward()
    assert torch.equal(x.grad, torch.ones(1, 100))


def _mixed(t1, t2, scale, t3):
    t4 = t1 + t2 * t3
    t5 = t1 * t2 + t3
    t4 *= scale
    t5 *= scale
    return scale, t4, None, True, t5, "bar", t1


def test_non_tensor_inputs_and_outputs():
    t1, t2, t3 = torch.rand(10, requires_grad=True), torch.rand(10, requires_grad=True), torch.rand(10)
    scale = random.Random(0).randint(1, 10)
    res = _reentrant(_mixed, t1, t2, scale, t3)
    expected = _mixed(t1, t2, scale, t3)
    assert res[0] == scale and res[2] is None and res[3] is True and res[5] == "bar"
    for i in (1, 4, 6):
        assert torch.equal(res[i], expected[i])
    res[1].sum().backward(retain_graph=True)
    res[4].sum().backward(retain_graph=True)
    res[6].sum().backward()
    ours = (t1.grad.clone(), t2.grad.clone())
    t1.grad = t2.grad = None
    expected[1].sum().backward(retain_graph=True)  # accumulated in the same order, for bit-equality
    expected[4].sum().backward(retain_graph=True)
    expected[6].sum().backward()
    assert torch.equal(ours[0], t1.grad) and torch.equal(ours[1], t2.grad)
    # torch's reentrant checkpoint returns a fresh t1, whose second backward fails; remat, like torch's
    # non-reentrant checkpoint, returns the input itself.
    assert res[6] is t1


def test_no_tensors_at_all():
    rng = random.Random(1)
    args = (rng.random(), rng.random(), rng.randint(0, 10), rng.random())
    assert _reentrant(_mixed, *args) == _mixed(*args)


def test_partial_gradient_and_an_output_that_needs_none():
    x, y = torch.randn(1, 4, requires_grad=True), torch.randn(1, 4)
    out = _reentrant(lambda a, b: (a, b), x, y)
    out[0].sum().backward()
    assert torch.equal(x.grad, torch.ones(1, 4))
    # torch's reentrant checkpoint raises "none of output has requires_grad=True"; backward refuses it here.
    out = _reentrant(lambda a, b: a, torch.randn(1, 4), torch.randn(1, 4, requires_grad=True))
    assert not out.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        out.sum().backward()


# --- nested checkpoints: torch's TestNestedCheckpoint cases ------------------------------------------------


def grad(fn):
    def wrapper(x):
        with torch.enable_grad():
            out = fn(x)
            (grad_input,) = torch.autograd.grad(out, inputs=(x,), create_graph=True)
        return grad_input

    return wrapper


def total(fn):
    return lambda x: fn(x).sum()


def checkpointed(impl):
    return lambda fn: functools.partial(impl, fn)


def _chain(x):
    return x.sin().exp().sin()


def _differentiates_inside(x):
    """Calls torch.autograd.grad in its forward: the region is unpacked, and recomputed, before it ends."""
    a = x.sin().exp().sin()
    b = x.sin().exp().sin()
    torch.autograd.grad(a, x)
    torch.autograd.grad(b, x)
    return x.sin()


def _nestings(fn, c):
    """(expected function, the same wrapped in checkpoints in various ways), as torch's get_tests."""
    return [
        (fn, [c(fn), c(c(fn))]),
        (grad(fn), [grad(c(fn)), grad(c(c(fn)))]),
        (grad(grad(fn)), [grad(c(grad(fn))), c(grad(grad(c(fn)))), grad(c(grad(c(fn))))]),
        (grad(grad(grad(fn))), [grad(c(grad(grad(c(fn))))), grad(c(grad(c(grad(c(fn))))))]),
    ]


def _graph_nodes(root):
    seen, queue = {root}, collections.deque([root])
    while queue:
        node = queue.popleft()
        yield node
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                queue.append(child)


def _alive_after_use(fn):
    """Names of the graph nodes of fn(x) still alive once its output is gone: no reference cycle may hold them,
    as torch's check_graph_dies asks (freed by reference counting alone, no garbage collection)."""

    class Mark:
        def __init__(self, name):
            self.name = name

    def use():
        out = fn(torch.randn((), dtype=torch.double, requires_grad=True))
        marks = []
        for node in _graph_nodes(out.grad_fn):
            mark = Mark(node.name())
            node.metadata["remat-test"] = mark
            marks.append(weakref.ref(mark))
        return marks

    return [ref().name for ref in use() if ref() is not None]


@pytest.mark.parametrize("early_stop", [True, False])
@pytest.mark.parametrize("fn", [_chain, _differentiates_inside], ids=["chain", "grad-inside"])
def test_nested_checkpoints_with_autograd_grad(fn, early_stop):
    x = torch.randn((), dtype=torch.double, requires_grad=True)
    with tuc.set_checkpoint_early_stop(early_stop):
        ours = _nestings(fn, checkpointed(remat.checkpoint))
        theirs = _nestings(fn, checkpointed(_torch_nonreentrant))
        for (plain, variants), (_, torch_variants) in zip(ours, theirs, strict=True):
            expected = plain(x)
            for variant, torch_variant in zip(variants, torch_variants, strict=True):
                got = variant(x)
                assert torch.equal(got, expected)
                assert torch.equal(got, torch_variant(x))
                assert _alive_after_use(variant) == []


@pytest.mark.parametrize("early_stop", [True, False])
def test_nested_checkpoint_with_two_children(early_stop):
    c = checkpointed(remat.checkpoint)

    def f(x):
        return x.sin().exp().sin()

    def g(x):
        return x.cos().sin().exp()

    def both(x):
        return c(g)(c(f)(x))

    a = torch.randn(3, 3, dtype=torch.double, requires_grad=True)
    with tuc.set_checkpoint_early_stop(early_stop):
        expected = grad(total(grad(total(lambda x: g(f(x))))))(a)
        assert torch.equal(grad(total(grad(total(c(both)))))(a), expected)
        assert torch.equal(grad(total(c(grad(total(c(both))))))(a), expected)


@pytest.mark.parametrize("early_stop", [True, False])
def test_nested_checkpoint_non_tensor_inputs_outputs_and_kwargs(early_stop):
    def fn(k, a, b, f, blah=None):
        out = f(k * a * b.exp())
        return (out * blah if blah is not None else out), 1, "abcd"

    a, b, c = (torch.tensor(v, requires_grad=True) for v in (2.0, 3.0, 0.5))
    with tuc.set_checkpoint_early_stop(early_stop):
        out, one, text = remat.checkpoint(fn, 3, a, b, torch.sin, blah=c)
    assert (one, text) == (1, "abcd")
    ours = torch.autograd.grad(out, (a, b, c))
    expected = torch.autograd.grad(fn(3, a, b, torch.sin, blah=c)[0], (a, b, c))
    assert all(torch.equal(o, e) for o, e in zip(ours, expected, strict=True))


def test_a_hook_on_the_original_graph_runs_once():
    counter = []
    a = torch.tensor(1.0, requires_grad=True)
    out = remat.checkpoint(lambda t: t.sin().cos().sin(), a)
    out.grad_fn.next_functions[0][0].register_hook(lambda *_: counter.append(1))
    out.backward()
    assert counter == [1]


def test_backward_from_a_hook_inside_backward():
    def fn(a):
        x = a.sin().cos()
        return x, x.sin()

    a = torch.tensor(1.0, requires_grad=True)
    x, out = remat.checkpoint(fn, a)
    out.grad_fn.register_hook(lambda *_: x.backward(retain_graph=True))
    out.backward(retain_graph=True)
    plain = torch.tensor(1.0, requires_grad=True)
    px, pout = fn(plain)
    pout.grad_fn.register_hook(lambda *_: px.backward(retain_graph=True))
    pout.backward(retain_graph=True)
    assert torch.equal(a.grad, plain.grad)


@pytest.mark.parametrize(
    "around, given, calls",
    [
        (None, None, 1),
        (None, False, 2),
        (None, True, 1),  # torch's default is on; the argument
        (False, None, 2),
        (True, None, 1),  # the context manager, read when the call is made, not in backward
        (False, True, 2),
        (True, False, 1),  # the context manager wins over the argument, as in torch
    ],
)
def test_early_stop_skips_what_saves_nothing(around, given, calls):
    counter = []

    def clone(x):
        counter.append(1)  # saves nothing: rerun only without early stop
        return x.clone()

    def fn(x):
        return clone(x.sin().cos())

    a = torch.tensor(1.0, requires_grad=True)
    with tuc.set_checkpoint_early_stop(around) if around is not None else contextlib.nullcontext():
        out = remat.checkpoint(fn, a, **({} if given is None else {"early_stop": given}))
    out.backward()
    assert len(counter) == calls


class _SinCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten.sin.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("early_stop, dispatched", [(True, 1), (False, 2)])
def test_early_stop_when_only_the_input_is_saved(early_stop, dispatched):
    calls = []

    def fn(x):
        calls.append(1)
        return x.sin()

    a = torch.tensor(1.0, requires_grad=True)
    with tuc.set_checkpoint_early_stop(early_stop), _SinCounter() as mode:
        remat.checkpoint(fn, a).backward()
    assert len(calls) == 2 and mode.count == dispatched


# --- the decorator form (torch 2.14's curried checkpoint) ----------------------------------------------------


def test_a_decorated_functions_keywords_are_its_own_even_named_like_options():
    def fn(
        a,
        preserve_rng_state,
        use_reentrant,
        context_fn,
        determinism_check,
        debug,
        early_stop,
        respect_saved_tensors_hooks,
    ):
        return (
            a.sin()
            * preserve_rng_state
            * use_reentrant
            * context_fn
            * determinism_check
            * debug
            * early_stop
            * respect_saved_tensors_hooks
        )

    a = torch.tensor(2.0, requires_grad=True)
    keywords = {
        "preserve_rng_state": 2,
        "use_reentrant": 3,
        "context_fn": 5,
        "determinism_check": 7,
        "debug": 11,
        "early_stop": 13,
        "respect_saved_tensors_hooks": 17,
    }
    out = remat.checkpoint(use_reentrant=False, preserve_rng_state=False)(fn)(a, **keywords)
    expected = fn(a, **keywords)
    assert torch.equal(out, expected)
    assert torch.equal(torch.autograd.grad(out, a)[0], torch.autograd.grad(expected, a)[0])


def test_a_decorated_method_and_a_function_without_arguments():
    class Model:
        @remat.checkpoint(use_reentrant=False)
        def fn(self, x, scale):
            return x.sin() * scale

    x, scale = torch.tensor(2.0, requires_grad=True), torch.tensor(3.0, requires_grad=True)
    ours, expected = Model().fn(x, scale), x.sin() * scale
    assert torch.equal(ours, expected)
    assert all(
        torch.equal(o, e)
        for o, e in zip(torch.autograd.grad(ours, (x, scale)), torch.autograd.grad(expected, (x, scale)), strict=True)
    )
    for call in (lambda: remat.checkpoint(lambda: x.sin().exp()), lambda: remat.checkpoint()(lambda: x.sin().exp())()):
        assert torch.equal(torch.autograd.grad(call(), x)[0], torch.autograd.grad(x.sin().exp(), x)[0])


def test_a_wrapped_modules_keywords_are_its_forwards():
    class Scaled(nn.Linear):
        def forward(self, x, debug=1.0, early_stop=1.0):
            return super().forward(x) * debug * early_stop

    ref = Scaled(3, 3)
    ours = remat.wrap(twin(ref))
    x = torch.randn(2, 3)
    ref(x, debug=2.0, early_stop=3.0).sum().backward()
    ours(x, debug=2.0, early_stop=3.0).sum().backward()
    assert_grads_equal(ref, ours)


# --- what torch's tests do not cover, and remat adds --------------------------------------------------------


class Penalised(nn.Module):
    """A block that differentiates inside its forward (a gradient penalty), with running buffers."""

    def __init__(self):
        super().__init__()
        self.lin, self.bn, self.post = nn.Linear(4, 4), nn.BatchNorm1d(4), nn.BatchNorm1d(4)

    def forward(self, x):
        h = self.bn(self.lin(x)).tanh()
        (g,) = torch.autograd.grad(h.sum(), x, create_graph=True)
        return self.post(h * g)


@pytest.mark.parametrize("early_stop", [True, False])
def test_grad_inside_a_block_with_batchnorm_updates_its_buffers_once(early_stop):
    ref = Penalised()
    ours, theirs = twin(ref), twin(ref)
    x = torch.randn(6, 4)
    for model, call in ((ref, lambda m, t: m(t)), (ours, remat.checkpoint), (theirs, _torch_nonreentrant)):
        t = x.clone().requires_grad_()
        with tuc.set_checkpoint_early_stop(early_stop):  # off: the recomputation inside the forward runs it all
            out = call(model, t)
        out.sum().backward()
        model.x_grad = t.grad
    assert_grads_equal(ref, ours)
    assert torch.equal(ref.x_grad, ours.x_grad)
    assert_buffers_equal(ref, ours)
    assert theirs.bn.num_batches_tracked.item() == 3  # torch's own: the forward, and two recomputations


@pytest.mark.parametrize("calls", [1, 2], ids=["first-call", "later-call"])
def test_grad_inside_then_an_in_place_write_to_the_input(calls):
    def fn(x):
        y = x.exp()
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        x.add_(1)  # after the recomputation the grad above started: it must not land twice
        return x * g

    for _ in range(calls):
        torch.manual_seed(0)
        a = torch.randn(5, requires_grad=True)
        with tuc.set_checkpoint_early_stop(False):  # recompute the whole function inside the forward
            out = remat.checkpoint(fn, a * 1.0)
        out.sum().backward()
    plain = a.detach().clone().requires_grad_()
    expected = fn(plain * 1.0)
    expected.sum().backward()
    assert torch.equal(out, expected) and torch.equal(a.grad, plain.grad)


@pytest.mark.parametrize("policy", ["selective", "selective-ops"])
def test_a_selective_policy_recomputed_twice_says_so_and_how_to_fix(policy):
    w = torch.randn(4, 4, requires_grad=True)

    def fn(x):
        return (x @ w).sin().cos()

    x = torch.randn(4, 4, requires_grad=True)
    out = remat.checkpoint(fn, x, policy=policy).sum()
    (g,) = torch.autograd.grad(out, x, create_graph=True)
    with pytest.raises(remat.RecomputeError, match=r"recomputed more than once .* Use policy='full'") as info:
        g.sum().backward()
    assert isinstance(info.value, tuc.CheckpointError)
    assert "forward side effect" not in str(info.value)
    out = remat.checkpoint(fn, x, policy="full").sum()
    (g,) = torch.autograd.grad(out, x, create_graph=True)
    g.sum().backward()  # full recomputes as often as backward asks


def test_an_input_modified_after_the_call_is_a_runtime_error_like_torchs():
    x = torch.randn(3, requires_grad=True) * 1.0
    out = remat.checkpoint(lambda t: t.sin(), x)
    x.mul_(2)
    with pytest.raises(RuntimeError, match="modified in place after the call") as info:
        out.sum().backward()
    assert isinstance(info.value, remat.RematError)

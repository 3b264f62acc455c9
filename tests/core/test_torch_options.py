"""torch.utils.checkpoint's keyword options under remat.checkpoint: each honoured with remat's
guarantees (gradients bit-equal to the plain model, recomputation happened) or refused clearly."""

import contextlib
import functools
import inspect
import warnings

import pytest
import torch
import torch.utils.checkpoint as tuc
from conftest import assert_grads_equal, twin
from torch import nn

import remat
import remat.core.checkpoint
from remat.core import _torch_options
from remat.errors import CheckpointOptionError

mm = torch.ops.aten.mm.default


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.drop = nn.Linear(8, 16), nn.Linear(16, 8), nn.Dropout(0.2)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.b(self.drop(self.a(x).relu()))


def _compare(**options):
    """Plain block vs remat.checkpoint(block, ..., **options): gradients bit-equal; the block ran twice."""
    ref = Block()
    ours = twin(ref)
    x = torch.randn(4, 8)
    torch.manual_seed(1)
    ref(x).sum().backward()
    torch.manual_seed(1)
    remat.checkpoint(ours, x, **options).sum().backward()
    assert_grads_equal(ref, ours)
    assert ours.calls == 2, "no recomputation happened"
    return ours


def test_inside_torch_debug_mode_runs_and_says_what_it_does_not_do():
    with tuc.set_checkpoint_debug_enabled(True), pytest.warns(UserWarning, match="operator-trace dump"):
        _compare()


def test_debug_argument_warns_and_keeps_gradients():
    with pytest.warns(UserWarning, match="debug=True"):
        _compare(debug=True)


def test_recompute_failure_is_a_runtime_error_like_torchs():
    calls = []

    def fn(x):
        calls.append(1)
        if len(calls) > 1:
            raise ValueError("boom in recompute")
        return x.sin()

    x = torch.randn(3, requires_grad=True)
    y = remat.checkpoint(fn, x * 2).sum()
    with pytest.raises(RuntimeError, match="failed when rerun in backward") as info:
        y.backward()
    assert isinstance(info.value, tuc.CheckpointError) and isinstance(info.value, remat.RematError)
    assert isinstance(info.value, remat.RecomputeError)
    assert isinstance(info.value.__cause__, ValueError)


def test_selective_context_fn_becomes_remats_policy():
    _compare(context_fn=functools.partial(tuc.create_selective_checkpoint_contexts, [mm]))


def _mutating(x, w):
    return (x @ w).relu_().sum(0)  # mutates the kept matmul output in place


@pytest.mark.parametrize("allow", [True, False])
def test_a_cached_output_written_in_place_is_recomputed_whatever_allow_cache_entry_mutation(allow):
    # torch refuses the written entry (allow=False) or hands it back written (allow=True); remat recomputes
    # it (NOTE [Cached outputs written in place] in remat.core._contexts): nothing left to refuse or allow.
    x, w = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True)
    (x @ w).relu().sum(0).sum().backward()
    expected, w.grad = w.grad.clone(), None
    context = functools.partial(tuc.create_selective_checkpoint_contexts, [mm], allow_cache_entry_mutation=allow)
    remat.checkpoint(_mutating, x, w, context_fn=context).sum().backward()
    assert torch.equal(w.grad, expected)


def test_general_context_fn_is_entered_in_forward_and_recompute():
    entered = []

    @contextlib.contextmanager
    def mark(phase):
        entered.append(phase)
        yield

    _compare(context_fn=lambda: (mark("forward"), mark("recompute")))
    assert entered == ["forward", "recompute"]


@pytest.mark.parametrize(
    "options",
    [
        dict(determinism_check="none"),
        dict(early_stop=False),
        dict(early_stop=True),
        dict(use_reentrant=False),
        dict(use_reentrant=None),
    ],
)
def test_options_torch_passes_keep_gradients(options):
    _compare(**options)


def test_decorator_form_carries_torch_options():
    entered = []
    block = Block()

    @remat.checkpoint(context_fn=lambda: (contextlib.nullcontext(), _note(entered)))
    def run(x):
        return block(x)

    run(torch.randn(2, 8)).sum().backward()
    assert entered == ["recompute"] and block.calls == 2


@contextlib.contextmanager
def _note(entered):
    entered.append("recompute")
    yield


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(determinism_check="strict"), "determinism_check='strict'"),
        (dict(early_stop="yes"), "early_stop must be True, False or None"),
        (dict(context_fn="selective"), "context_fn must be a function"),
        (dict(context_fn=lambda: None), r"context_fn\(\) must return"),
        (
            dict(policy="selective", context_fn=functools.partial(tuc.create_selective_checkpoint_contexts, [mm])),
            "both policy='selective' and a selective context_fn",
        ),
    ],
)
def test_refused_options_say_why_and_run_nothing(options, message):
    block = Block()
    with pytest.raises(remat.RematError, match=message) as info:
        remat.checkpoint(block, torch.randn(2, 8), **options)
    assert block.calls == 0
    assert isinstance(info.value, ValueError)  # torch refuses option values with a ValueError (NOTE in remat.errors)


def test_other_keywords_still_go_to_the_function():
    def fn(x, *, scale):
        return x * scale

    x = torch.randn(3, requires_grad=True)
    remat.checkpoint(fn, x, scale=3.0).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 3.0))


# --- use_reentrant=True: run non-reentrant, one warning per call site ---------------------------------------


@pytest.fixture
def fresh_sites(monkeypatch):
    monkeypatch.setattr(_torch_options, "_SITES", set())


def test_use_reentrant_true_runs_non_reentrant_with_gradients_of_the_plain_block(fresh_sites):
    with pytest.warns(UserWarning, match="use_reentrant=True is run with remat's non-reentrant") as record:
        _compare(use_reentrant=True)
    (warning,) = record
    assert warning.filename == __file__  # told at the caller's line, not inside remat
    message = str(warning.message)
    assert "silently loses gradients for inputs that don't require grad" in message
    assert "pass use_reentrant=False" in message


def test_use_reentrant_true_on_raw_input_still_trains_the_parameters(fresh_sites):
    ref = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    ours = twin(ref)
    x = torch.randn(2, 4)  # requires no grad: torch's reentrant checkpoint would give the Linear no gradient
    ref(x).sum().backward()
    with pytest.warns(UserWarning, match="use_reentrant=True"):
        remat.checkpoint(ours, x, use_reentrant=True).sum().backward()
    assert_grads_equal(ref, ours)


def _reentrant_call(block, x):
    return remat.checkpoint(block, x, use_reentrant=True)


def test_one_warning_per_call_site(fresh_sites):
    block, x = Block(), torch.randn(2, 8)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")  # even where every warning is shown, remat tells each site once
        for _ in range(3):
            _reentrant_call(block, x).sum().backward()
        remat.checkpoint(block, x, use_reentrant=True).sum().backward()
        remat.checkpoint(block, x, use_reentrant=False).sum().backward()
    lines = [w.lineno for w in record if "use_reentrant=True" in str(w.message)]
    assert len(lines) == 2 and lines[0] != lines[1]
    assert all(w.filename == __file__ for w in record)


def test_decorated_function_is_told_at_the_callers_line(fresh_sites):
    block = Block()
    run = remat.checkpoint(use_reentrant=True)(block)
    with pytest.warns(UserWarning, match="use_reentrant=True") as record:
        run(torch.randn(2, 8)).sum().backward()
    assert record[0].filename == __file__ and block.calls == 2


# --- options torch adds: honoured or refused, never handed to the function ----------------------------------


def _respecting_mode():
    """The respect_saved_tensors_hooks value on the selective-checkpoint caching mode the function runs under."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    modes = [m for m in _get_current_dispatch_mode_stack() if isinstance(m, tuc._CachingTorchDispatchMode)]
    return [getattr(m, "respect_saved_tensors_hooks", "absent") for m in modes]


@pytest.mark.parametrize("given, expected", [(None, False), (False, False), (True, True)])
def test_respect_saved_tensors_hooks_reaches_torchs_caching_mode(monkeypatch, given, expected):
    # Emulates torch 2.14 on any torch: its caching mode reads this attribute (None: the old way, warned).
    monkeypatch.setattr(tuc._CachingTorchDispatchMode, "respect_saved_tensors_hooks", None, raising=False)
    monkeypatch.setattr(_torch_options, "TORCH_OPTIONS", _torch_options.TORCH_OPTIONS | {"respect_saved_tensors_hooks"})
    seen = []

    def fn(x, w):
        seen.extend(_respecting_mode())
        return (x @ w).relu()

    x, w = torch.randn(3, 4), torch.randn(4, 4, requires_grad=True)
    options = {} if given is None else {"respect_saved_tensors_hooks": given}
    remat.checkpoint(fn, x, w, policy=[mm], **options).sum().backward()
    assert seen == [expected]  # the forward's caching mode; the function never got the keyword


def test_respect_saved_tensors_hooks_false_is_honoured_on_every_torch():
    _compare(policy="selective-ops", respect_saved_tensors_hooks=False)


def test_respect_saved_tensors_hooks_true_under_full_changes_nothing_on_every_torch():
    _compare(respect_saved_tensors_hooks=True)  # nothing kept: every saved tensor goes through the hooks


@pytest.mark.skipif("respect_saved_tensors_hooks" in _torch_options.TORCH_OPTIONS, reason="this torch has it")
def test_respect_saved_tensors_hooks_true_with_a_selective_policy_needs_a_torch_that_has_it():
    block = Block()
    with pytest.raises(CheckpointOptionError, match="needs torch 2.14 or later") as info:
        remat.checkpoint(block, torch.randn(2, 8), policy="selective", respect_saved_tensors_hooks=True)
    assert block.calls == 0 and isinstance(info.value, ValueError)


@pytest.mark.skipif("respect_saved_tensors_hooks" not in _torch_options.TORCH_OPTIONS, reason="torch 2.14 or later")
@pytest.mark.parametrize("respect", [True, False])
def test_respect_saved_tensors_hooks_routes_kept_outputs_as_torch_does(respect):
    packed = {"remat": 0, "torch": 0}
    x0 = torch.randn(4, 4)

    def run(which):
        def pack(t):
            packed[which] += t.numel() > 0  # not remat's empty device marker (NOTE in remat.core.checkpoint)
            return t

        x = x0.clone().requires_grad_()

        def fn(t):
            return torch.mm(t, t).relu().sum()

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if which == "remat":
                out = remat.checkpoint(fn, x, policy=[mm], respect_saved_tensors_hooks=respect)
            else:
                context = functools.partial(tuc.create_selective_checkpoint_contexts, [mm])
                out = tuc.checkpoint(
                    fn, x, use_reentrant=False, context_fn=context, respect_saved_tensors_hooks=respect
                )
        out.backward()
        return x.grad

    assert torch.equal(run("remat"), run("torch"))
    assert packed["remat"] == packed["torch"] == (2 if respect else 1)  # the input; and the kept mm output


def test_an_option_of_the_installed_torch_that_remat_does_not_know_is_refused(monkeypatch):
    names = _torch_options.OPTION_NAMES | {"frobnicate"}
    monkeypatch.setattr(_torch_options, "OPTION_NAMES", names)
    monkeypatch.setattr(remat.core.checkpoint, "OPTION_NAMES", names)

    def fn(x, frobnicate=False):
        raise AssertionError("the option reached the function")

    with pytest.raises(remat.RematError, match=r"frobnicate=True is an option of torch .* does not know"):
        remat.checkpoint(fn, torch.randn(2, 2, requires_grad=True), frobnicate=True)


def test_every_option_of_the_installed_torch_is_one_remat_knows():
    # Fails on a torch that adds a checkpoint option: remat then refuses it until it is read here.
    signature = set(inspect.signature(tuc.checkpoint).parameters)
    assert _torch_options.TORCH_OPTIONS <= signature
    assert _torch_options.TORCH_OPTIONS <= set(_torch_options.RECENT_OPTIONS)


addmm = torch.ops.aten.addmm.default  # what Block's Linear layers run
POLICIES = {
    "selective": "selective",
    "selective-ops": "selective-ops",
    "op list": [addmm],
    "policy function": lambda ctx, op, *a, **k: (
        tuc.CheckpointPolicy.MUST_SAVE if op == addmm else tuc.CheckpointPolicy.PREFER_RECOMPUTE
    ),
}


@pytest.mark.parametrize("policy", list(POLICIES))
def test_save_on_cpu_around_a_selective_policy_lets_no_warning_through(policy):
    ref = Block()
    ours = twin(ref)
    x = torch.randn(4, 8)
    with torch.autograd.graph.save_on_cpu():
        for _ in range(2):
            torch.manual_seed(1)
            ref(x).sum().backward()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with torch.autograd.graph.save_on_cpu():
            for _ in range(2):  # "selective" on a module: op by op on its first call, by module after
                torch.manual_seed(1)
                remat.checkpoint(ours, x, policy=POLICIES[policy]).sum().backward()
    assert [str(w.message) for w in record] == []
    assert_grads_equal(ref, ours)

"""torch.utils.checkpoint's keyword options under remat.checkpoint: each honoured with remat's
guarantees (gradients bit-equal to the plain model, recomputation happened) or refused clearly."""

import contextlib
import functools
import warnings

import pytest
import torch
import torch.utils.checkpoint as tuc
from torch import nn

import remat

from conftest import assert_grads_equal, twin

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


@pytest.mark.parametrize("options", [dict(determinism_check="none"), dict(early_stop=False), dict(early_stop=True),
                                     dict(use_reentrant=False), dict(use_reentrant=None)])
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


@pytest.mark.parametrize("options, message", [
    (dict(use_reentrant=True), "use_reentrant=True is refused"),
    (dict(determinism_check="strict"), "determinism_check='strict'"),
    (dict(early_stop="yes"), "early_stop must be True, False or None"),
    (dict(context_fn="selective"), "context_fn must be a function"),
    (dict(context_fn=lambda: None), r"context_fn\(\) must return"),
    (dict(policy="selective", context_fn=functools.partial(tuc.create_selective_checkpoint_contexts, [mm])),
     "both policy='selective' and a selective context_fn"),
])
def test_refused_options_say_why_and_run_nothing(options, message):
    block = Block()
    with pytest.raises(remat.RematError, match=message):
        remat.checkpoint(block, torch.randn(2, 8), **options)
    assert block.calls == 0


def test_other_keywords_still_go_to_the_function():
    def fn(x, *, scale):
        return x * scale

    x = torch.randn(3, requires_grad=True)
    remat.checkpoint(fn, x, scale=3.0).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 3.0))

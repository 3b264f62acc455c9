"""The CPU cases of torch's own selective-checkpoint tests (TestSelectiveActivationCheckpoint in
test_autograd.py), written for remat: torch's ``context_fn=partial(create_selective_checkpoint_contexts,
...)`` handed to ``remat.checkpoint``. Each compares, bit for bit (torch.equal, seeds set), with torch's own
checkpoint given the same ``context_fn`` and with no checkpointing; what torch's test counts (policy calls,
recomputed flops, calls of a kept op, when a kept tensor is freed) is compared with what torch's checkpoint
does on the installed torch, not with a number written here.

Where remat answers differently, the test says so: an output the policy keeps and the function then writes
in place is recomputed (torch refuses it unless ``allow_cache_entry_mutation=True``).
"""

import functools
import gc
import weakref

import pytest
import torch
import torch.utils.checkpoint as tuc
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.flop_counter import FlopCounterMode

import remat


def _torchs(fn, *args, **kwargs):
    return tuc.checkpoint(fn, *args, use_reentrant=False, **kwargs)


def _remats(fn, *args, **kwargs):
    return remat.checkpoint(fn, *args, use_reentrant=False, **kwargs)


def _plain(fn, *args, **kwargs):
    kwargs.pop("context_fn", None)
    return fn(*args, **kwargs)


RUNS = {"plain": _plain, "torch": _torchs, "remat": _remats}


def _keep(*ops):
    return functools.partial(create_selective_checkpoint_contexts, list(ops))


def _keep_by(policy_fn, **options):
    return functools.partial(create_selective_checkpoint_contexts, policy_fn, **options)


def _saves(*ops):
    """A policy function in torch's enum form: MUST_SAVE for ``ops``, PREFER_RECOMPUTE for the rest."""

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _gradients(run, fn, inputs, **kwargs):
    """(output, gradient of every input) of ``fn`` run by ``run``, from the same values and seed."""
    inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    torch.manual_seed(0)
    out = run(fn, *inputs, **kwargs)
    grads = torch.autograd.grad(out.sum(), [t for t in inputs if t.requires_grad])
    return out.detach(), grads


def _assert_all_equal(fn, inputs, runs=("plain", "torch", "remat"), **kwargs):
    (ref_out, ref_grads), *others = [_gradients(RUNS[name], fn, inputs, **kwargs) for name in runs]
    for out, grads in others:
        assert torch.equal(out, ref_out)
        assert len(grads) == len(ref_grads) and all(map(torch.equal, grads, ref_grads))


# --- what a policy keeps is not recomputed ------------------------------------------------------------------


def _mm_block(x, y):
    return torch.mm(x.cos(), y).sin()


MM = torch.ops.aten.mm.default
KEEP_MM = {
    "op list": _keep(MM),
    "policy function": _keep_by(_saves(MM)),
    "boolean policy": _keep_by(lambda ctx, op, *args, **kwargs: op == MM),
}


def _backward_flops(run, **kwargs):
    x, y = (torch.randn(32, 32, requires_grad=True) for _ in range(2))
    out = run(_mm_block, x, y, **kwargs).sum()
    with FlopCounterMode(display=False) as counter:
        out.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("context_fn", KEEP_MM.values(), ids=KEEP_MM.keys())
def test_a_kept_matmul_is_not_recomputed_and_gradients_match(context_fn):
    """torch's test_flops_and_mem, its flop half (the memory half reads CUDA's allocator)."""
    x, y = torch.randn(32, 32), torch.randn(32, 32)
    _assert_all_equal(_mm_block, [x.requires_grad_(), y.requires_grad_()], context_fn=context_fn)
    kept = _backward_flops(_remats, context_fn=context_fn)
    assert kept == _backward_flops(_torchs, context_fn=context_fn) == _backward_flops(_plain)
    full = _backward_flops(_remats)
    assert full == _backward_flops(_torchs) > kept  # recomputing everything recomputes the matmul


# --- outputs, subclasses, bad inputs ------------------------------------------------------------------------


def test_an_integer_view_output_with_autograd_meta():
    def fn(x, y):
        return x.view(-1), y.sin().cos()

    x, y = torch.tensor([1, 2, 3]), torch.randn(3, requires_grad=True)
    context_fn = _keep(torch.ops.aten.view.default)
    results = []
    for run in RUNS.values():
        leaf = y.detach().clone().requires_grad_()
        ints, out = run(fn, x, leaf, context_fn=context_fn)
        out.sum().backward()
        results.append((ints, out.detach(), leaf.grad))
    for ints, out, grad in results[1:]:
        assert torch.equal(ints, results[0][0]) and torch.equal(out, results[0][1])
        assert torch.equal(grad, results[0][2])


class _SizesFromPython(torch.Tensor):
    """A wrapper subclass that dispatches its sizes and strides ("sizes"), as torch's test has."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(
            cls, inner.size(), inner.stride(), None, None, inner.dtype, inner.layout, inner.device, False,
            inner.requires_grad, "sizes",
        )  # fmt: skip

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs):
        unwrapped = torch.utils._pytree.tree_map_only(cls, lambda t: t.inner, args)
        out = func(*unwrapped, **(kwargs or {}))
        return torch.utils._pytree.tree_map_only(torch.Tensor, cls, out)


def test_a_policy_keeping_size_queries_of_a_subclass_is_ignored_for_them():
    """Views save their input's shape: a cached sym_size would give recompute the wrong one."""
    saved_sizes = {}

    def fn(x):
        view = (x * x.sum()).view(-1).view(4, 3)
        saved_sizes.setdefault(run_name, []).append(list(view.grad_fn._saved_self_sym_sizes))
        return view.exp()

    context_fn = _keep_by(_saves(torch.ops.aten.sym_size.default))
    for run_name in ("torch", "remat"):
        x = _SizesFromPython(torch.randn(4, 3, requires_grad=True))
        RUNS[run_name](fn, x, context_fn=context_fn).sum().backward()
    assert saved_sizes["remat"] == saved_sizes["torch"] == [[12], [12]]  # forward and recompute


@pytest.mark.parametrize(
    "ops_or_fn", [[2], [torch.ops.aten.sin], 2], ids=["not an op", "an overload packet", "neither list nor function"]
)
def test_a_bad_op_list_is_refused_as_torch_refuses_it(ops_or_fn):
    def attempt(run):
        with pytest.raises((ValueError, TypeError)) as info:
            run(torch.sin, torch.randn(3, requires_grad=True), context_fn=_keep_by(ops_or_fn))
        return type(info.value), str(info.value)

    assert attempt(_remats) == attempt(_torchs)


# --- the policy's calls -------------------------------------------------------------------------------------


class _CountingPolicy:
    """Counts its calls in forward and in recompute separately (torch's test_policy_with_state)."""

    def __init__(self):
        self.forward, self.recompute, self.counts = [0], [0], []

    def __call__(self, ctx, func, *args, **kwargs):
        counter = self.recompute if ctx.is_recompute else self.forward
        counter[0] += 1
        self.counts.append(counter[0])
        return CheckpointPolicy.PREFER_RECOMPUTE


def test_a_stateful_policy_is_called_as_torch_calls_it():
    def fn(x):
        return x.sin().sin().sin()

    counts = {}
    for name in ("torch", "remat"):
        policy = _CountingPolicy()
        context_fn = _keep_by(policy, allow_cache_entry_mutation=True)
        _gradients(RUNS[name], fn, [torch.randn(3, requires_grad=True)], context_fn=context_fn)
        counts[name] = policy.counts
    assert counts["remat"] == counts["torch"]
    assert counts["remat"][:3] == [1, 2, 3]  # forward asks for each op
    _assert_all_equal(fn, [torch.randn(3, requires_grad=True)], context_fn=_keep_by(_CountingPolicy()))


def test_an_op_with_two_outputs_kept():
    calls = {}

    def counting(name):
        def policy(ctx, op, *args, **kwargs):
            if op == torch.ops.aten.var_mean.correction:
                calls[name] = calls.get(name, 0) + 1
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return policy

    def fn(x):
        var, mean = torch.var_mean(x)
        return var * mean

    for name in ("torch", "remat"):
        _gradients(RUNS[name], fn, [torch.randn(3, requires_grad=True)], context_fn=_keep_by(counting(name)))
    assert calls["remat"] == calls["torch"] >= 1
    _assert_all_equal(fn, [torch.randn(3, requires_grad=True)], context_fn=_keep_by(counting("any")))


def test_a_kept_custom_op_with_a_non_tensor_output_runs_once():
    runs = [0]
    with torch.library._scoped_library("remat_sac_suite", "FRAGMENT"):

        @torch.library.custom_op("remat_sac_suite::sin_and_two", mutates_args=())
        def sin_and_two(x: torch.Tensor) -> tuple[torch.Tensor, int]:
            runs[0] += 1
            return x.sin(), 2

        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])

        def backward(ctx, grad, _two):
            return grad * ctx.saved_tensors[0].cos()

        torch.library.register_autograd("remat_sac_suite::sin_and_two", backward, setup_context=setup_context)

        def fn(x):
            return (torch.ops.remat_sac_suite.sin_and_two(x)[0] * x.sin().exp()).sin()

        context_fn = _keep(torch.ops.remat_sac_suite.sin_and_two.default)
        x = torch.randn(3, requires_grad=True)
        counted = {}
        for name in ("torch", "remat"):
            runs[0] = 0
            _gradients(RUNS[name], fn, [x], context_fn=context_fn)
            counted[name] = runs[0]
        assert counted["remat"] == counted["torch"] == 1  # kept: not run again in recompute
        _assert_all_equal(fn, [x], context_fn=context_fn)


# --- what the policy keeps: lifetime, in-place writes, a second backward ------------------------------------


def _kept_exp_alive(run):
    """(kept alive by the graph, freed with it; kept alive again, freed by a backward that retains the graph)."""
    kept = []

    def fn(x):
        out = x.cos().exp()
        caching = [m for m in _get_current_dispatch_mode_stack() if isinstance(m, tuc._CachingTorchDispatchMode)]
        if caching:  # the forward, not the recompute
            kept.append(weakref.ref(caching[-1].storage[torch.ops.aten.exp.default][0].val))
        return out.sin()

    context_fn = _keep_by(lambda ctx, op, *args, **kwargs: CheckpointPolicy.MUST_SAVE)
    x = torch.randn(3, requires_grad=True)
    gc.disable()  # freed by reference counting, not by a collection of a cycle
    try:
        out = run(fn, x, context_fn=context_fn)
        alive_then_freed = [kept[-1]() is not None]
        del out
        alive_then_freed.append(kept[-1]() is None)
        out = run(fn, x, context_fn=context_fn)
        alive_then_freed.append(kept[-1]() is not None)
        out.sum().backward(retain_graph=True)
        alive_then_freed.append(kept[-1]() is None)
    finally:
        gc.enable()
    return alive_then_freed


def test_a_kept_tensor_lives_as_long_as_torchs():
    assert _kept_exp_alive(_remats) == _kept_exp_alive(_torchs) == [True, True, True, True]


def test_a_kept_output_written_in_place_is_recomputed_where_torch_refuses_it():
    """torch's test_version_counter: torch refuses unless allow_cache_entry_mutation=True; remat recomputes."""

    def fn(x):
        return x.sin().mul_(2).cos().exp()

    x = torch.randn(3, requires_grad=True)
    keep_sin = _keep_by(_saves(torch.ops.aten.sin.default))
    with pytest.raises(RuntimeError, match="has been mutated"):
        _torchs(fn, x, context_fn=keep_sin).sum().backward()
    # torch with allow_cache_entry_mutation=True runs, but its recompute reads the written value: other
    # gradients (docs/drop-in.md). remat recomputes the write and gives the plain ones.
    _assert_all_equal(fn, [x], runs=("plain", "remat"), context_fn=keep_sin)


def test_a_second_backward_through_a_selective_call_is_refused_like_torchs():
    def fn(x):
        return x.sin().cos().exp()

    for run in (_torchs, _remats):
        x = torch.randn(3, requires_grad=True)
        out = run(fn, x, context_fn=_keep_by(_saves(torch.ops.aten.sin.default)))
        out.sum().backward(retain_graph=True)
        with pytest.raises(RuntimeError) as info:
            out.sum().backward(retain_graph=True)
        if run is _remats:
            assert isinstance(info.value, remat.RecomputeError) and isinstance(info.value, tuc.CheckpointError)
            assert "policy='full'" in str(info.value)

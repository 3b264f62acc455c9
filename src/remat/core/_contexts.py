"""The context managers a checkpointed call enters: around its forward, around each recomputation.

They act on a :class:`remat.core._region.Region` (NOTE [What recomputation must not
repeat] and NOTE [Watching only when needed] there); ``Stacked`` composes them with
torch's selective-checkpoint contexts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from remat.core._recomputing import bookkeeping, observed_recomputation
from remat.core._region import REGION_BUFFER_MODULES, Learned, Region
from remat.core._rng import POLICY_AFTER_OP, SAVE_DECISIONS, ReplayContext, RngLedger
from remat.core._torch_options import CallOptions, route_saved_tensors_hooks
from remat.core._writes import storage_key, writes_in_place, written_tensors


class _CopyOnWrite(TorchDispatchMode):
    """Copies a watched storage right before the first op that writes to it."""

    def __init__(self, region: Region) -> None:
        super().__init__()
        self.region = region

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        for t in written_tensors(func, args, kwargs):
            self.region.note_write(t)
        if "generator" in kwargs:  # NOTE [A generator of the call's own] in remat.core._generators
            self.region.generators.note(kwargs["generator"])
        return func(*args, **kwargs)


def _watch(region: Region, module: nn.Module) -> None:
    """Watch the buffers of ``module`` and its submodules, and those its code reads without entering their
    modules (a traced segment's, NOTE [Buffers a segment reads] in remat.profiling._traced): a nested segment
    enters the traced units, not the model whose statistics they update."""
    _watch_tree(region, module)
    for other in module.__dict__.get(REGION_BUFFER_MODULES, ()):
        _watch_tree(region, other)


# NOTE [Buffers of submodules never entered]
# A module may hand its submodules' buffers to an op without calling them: torch's QAT
# ``FusedMovingAvgObsFakeQuantize`` passes its observer's ``min_val``/``max_val`` to
# ``fused_moving_avg_obs_fake_quant``, which updates them in place. Watching only the buffers of
# modules entered missed them wherever the checkpointed module is not their ancestor (a traced
# segment calls the model's leaf modules; a function calls a module): recomputation updated the
# statistics a second time, from the written value, and a QAT model trained other gradients from its
# second step under a plan remat.auto had verified on the first (the update is idempotent there).
# So entering a module watches its whole subtree, each module once per call.
def _watch_tree(region: Region, module: nn.Module) -> None:
    stack = [module]
    while stack:
        m = stack.pop()
        if id(m) in region.trees_watched:
            continue
        region.trees_watched.add(id(m))
        region.watch_buffers(m)
        stack.extend(child for child in m._modules.values() if child is not None)


class ForwardContext:
    """Entered around the checkpointed forward: watch buffers, keep values before writes.

    ``remember(learned)`` is told what a first call wrote, and ``None`` when a call
    without the dispatch mode met a write it did not expect (forget, watch again).
    """

    def __init__(self, region: Region, remember: Callable[[Learned | None], None] | None = None) -> None:
        self.region = region
        self.remember = remember or (lambda learned: None)
        self._hook: Any = None
        self._mode: _CopyOnWrite | None = None

    def __enter__(self) -> None:
        learned = self.region.learned
        if learned is None or learned.writes_inputs or self.region.owner is None:
            self._hook = nn.modules.module.register_module_forward_pre_hook(
                lambda module, _args: _watch(self.region, module)
            )
        else:  # NOTE [Watching only when needed]: no hook on every submodule call
            for ref in learned.buffer_modules:
                module = ref()
                if module is not None:
                    self.region.watch_buffers(module)
        if self.region.watches_ops:
            self._mode = _CopyOnWrite(self.region)
            self._mode.__enter__()
        if self.region.owner is not None:
            _watch(self.region, self.region.owner)

    def __exit__(self, exc_type, *exc) -> None:  # noqa: ANN001
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if exc_type is None:
            try:
                learned = self.region.finish_forward()
            except Exception:
                self.remember(None)
                raise
            if learned is not None:
                self.remember(learned)


# NOTE [Recomputed before the forward ends]
# A function that calls torch.autograd.grad in its forward (a gradient penalty, a checkpoint inside
# another whose function differentiates: torch's nested-checkpoint tests) makes torch unpack what the
# region saved while the forward still runs, and so recompute the whole function then. The region has
# not settled what the forward wrote (finish_forward), so such a recomputation must not touch anything
# the forward goes on with: it runs on copies of every buffer of every module it enters (the value the
# forward started from where the forward already wrote it, else the current one), and, where the
# callable may write its inputs, on copies of those too (Region.prepare_recompute).
class _EveryBufferCopied:
    """Every buffer a recomputation enters swapped for a copy of its pre-forward value, then put back."""

    def __init__(self, region: Region) -> None:
        self.region = region
        self.swapped: list[tuple[nn.Module, str, torch.Tensor]] = []
        self.seen: set[int] = set()
        self.hook: Any = None

    def __enter__(self) -> None:
        owner = self.region.owner
        for module in [*self.region.buffer_modules.values(), *(owner.modules() if owner is not None else ())]:
            self._swap(module)
        self.hook = nn.modules.module.register_module_forward_pre_hook(lambda module, _args: self._swap(module))

    def _swap(self, module: nn.Module) -> None:
        if id(module) in self.seen:
            return
        self.seen.add(id(module))
        for name, buf in module._buffers.items():
            if buf is not None:
                start = self.region.before.get(storage_key(buf), buf)
                with torch.no_grad(), bookkeeping():
                    module._buffers[name] = start.detach().clone().requires_grad_(buf.requires_grad)
                self.swapped.append((module, name, buf))

    def __exit__(self, *exc) -> None:  # noqa: ANN001
        self.hook.remove()
        for module, name, original in reversed(self.swapped):
            module._buffers[name] = original


class RecomputeContext:
    """Entered around every recomputation (more than one with ``retain_graph=True``)."""

    def __init__(self, region: Region) -> None:
        self.region = region
        self._open: list[tuple[Any, Any]] = []

    def __enter__(self) -> None:
        self.region.recomputations += 1
        observed = observed_recomputation(self.region.owner)
        observed.__enter__()
        swap = contextlib.ExitStack()
        try:
            if not self.region.forward_done:  # NOTE [Recomputed before the forward ends]
                swap.enter_context(_EveryBufferCopied(self.region))
            else:
                if self.region.slots is not None:  # NOTE [A module's tensors as its forward saw them]
                    swap.enter_context(self.region.slots.as_called())
                if self.region.generators.states:  # NOTE [A generator of the call's own]
                    swap.enter_context(self.region.generators.as_called())
                if self.region.buffers:  # on top: the values before the forward's writes
                    swap.enter_context(self.region.swapped_buffers())
        except BaseException as exc:
            swap.close()
            observed.__exit__(type(exc), exc, exc.__traceback__)
            raise
        self._open.append((observed, swap))
        if self.region.written_inputs or not self.region.forward_done:  # before the selective-checkpoint mode
            self.region.prepare_recompute()  # (NOTE in remat.core._region)

    def __exit__(self, *exc) -> None:  # noqa: ANN001
        self.region.end_recompute()
        observed, swap = self._open.pop()
        try:
            swap.__exit__(*exc)
        finally:
            observed.__exit__(*exc)


# NOTE [Cached outputs written in place]
# torch's selective checkpoint keeps the outputs of the ops its policy saves (matmuls, convolutions)
# and hands them back in recompute. One written in place after it was cached (a Linear followed by
# ReLU(inplace=True) in the block, or the block's output written by the next block's in-place first
# op) is refused there ("Tensor cached during selective activation checkpoint has been mutated"), or
# with allow_cache_entry_mutation handed back written: a forward that never happened. Such an entry is
# recomputed instead: its op runs again in recompute from its recomputed inputs, which gives the value
# the forward made. Entries written during the forward are let go at its end (nothing reads them
# again; the write's own output is what the rest holds), those written later when a recomputation
# begins. Reads torch's private cache (a dict of op -> {call index: entry}); without it, torch's check.
#
# A write is seen by the entry's version counter, and, during the forward, by its storage: ``matmul``
# of batched operands returns ``_unsafe_view`` of its ``bmm``, a tensor with a version counter of its
# own, so ``scores = q @ k.transpose(-1, -2); scores += mask`` writes the cached ``bmm`` output and
# leaves its version as it was (torch's check misses it too, and the gradients came out wrong: BigBird's
# block-sparse attention, ``context_layer += ...``). The policy torch asks at every forward op
# (``ForwardWrites``) notes the storages of kept outputs that a later op writes; such an entry is
# recomputed. Only storages kept before the write count: the allocator hands a freed storage's
# address to the next one, and a write to an earlier storage at a kept output's address would make
# the entry recomputed in one run and kept in the next, and the peak with it. After the forward only
# the version counter tells: a later write through such an alias (the next block writing this one's
# matmul output in place) is not seen, but an op's cached output that is the block's output is read
# by nothing in its recomputation.
_CACHED_RECOMPUTE = getattr(torch.utils.checkpoint, "_RECOMPUTE", None)


def _written_since_cached(entry: Any, written: set[int]) -> bool:
    for wrapper in tree_flatten(entry)[0]:
        value, version = getattr(wrapper, "val", None), getattr(wrapper, "version", None)
        if not isinstance(value, torch.Tensor):
            continue
        if (version is not None and value._version != version) or storage_key(value) in written:
            return True
    return False


class ForwardWrites:
    """The selective policy as torch asks it, noting the storages of kept outputs that later forward ops write in
    place (NOTE above)."""

    def __init__(self, policy: Callable[..., Any]) -> None:
        self.policy = policy
        self.keys: set[int] = set()
        """Storages of kept outputs written after they were kept."""
        self.kept: set[int] | None = set() if POLICY_AFTER_OP else None
        """Storages of the outputs kept so far; None where torch asks the policy before the op runs (its output
        unseen): every write counts then, and may make an entry recomputed needlessly."""

    def decide(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        decision = self.policy(ctx, func, *args, **kwargs)
        if ctx.is_recompute:
            return decision
        if writes_in_place(func):
            for t in written_tensors(func, args, kwargs):
                key = storage_key(t)
                if self.kept is None or key in self.kept:  # a kept output lives on: its storage is no other's
                    self.keys.add(key)
        if self.kept is not None and decision in SAVE_DECISIONS:
            outputs = tree_flatten(getattr(ctx, "op_output", None))[0]
            self.kept.update(storage_key(t) for t in outputs if isinstance(t, torch.Tensor))
        return decision


class RecomputeWritten:
    """Turns cached outputs written in place into ones recomputed (NOTE above): on entering a recomputation,
    or (``at_exit``) on leaving the forward. ``writes``: the storages the forward wrote."""

    def __init__(self, sac_mode: Any, at_exit: bool = False, writes: ForwardWrites | None = None) -> None:
        self.storage = getattr(sac_mode, "storage", None)
        self.at_exit = at_exit
        self.writes = writes

    def _recompute_written(self) -> None:
        if _CACHED_RECOMPUTE is None or not isinstance(self.storage, dict):
            return
        written = self.writes.keys if self.writes is not None else set()
        for entries in self.storage.values():
            for index, entry in entries.items():
                if _written_since_cached(entry, written):
                    entries[index] = _CACHED_RECOMPUTE

    def __enter__(self) -> None:
        if not self.at_exit:
            self._recompute_written()

    def __exit__(self, exc_type, *exc) -> None:  # noqa: ANN001
        if self.at_exit and exc_type is None:
            self._recompute_written()


class Stacked:
    """Re-enterable composition of context managers (torch reuses the recompute context).

    Entered and left by hand, not through an ExitStack: it runs twice per block call,
    where every microsecond of host time shows on a fast GPU.
    """

    def __init__(self, *contexts: Any) -> None:
        self.contexts = contexts
        self._entered: list[int] = []

    def __enter__(self) -> None:
        done = 0
        try:
            for c in self.contexts:
                c.__enter__()
                done += 1
        except BaseException as exc:
            self._leave(done, type(exc), exc, exc.__traceback__)
            raise
        self._entered.append(done)

    def __exit__(self, *exc) -> bool:  # noqa: ANN001
        return self._leave(self._entered.pop(), *exc)

    def _leave(self, done: int, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        """Leave the first ``done`` contexts, innermost first, as an ExitStack would."""
        pending = exc
        for c in reversed(self.contexts[:done]):
            try:
                args = (type(pending), pending, pending.__traceback__) if pending is not None else (None, None, None)
                if c.__exit__(*args):
                    pending = None
            except BaseException as new:  # noqa: BLE001 (re-raised below, chained to what was pending)
                pending = new
        if pending is not None and pending is not exc:
            raise pending
        return exc is not None and pending is None


def _selective_contexts(policy_fn: Callable[..., Any], replay_rng: bool, options: CallOptions) -> tuple[Any, Any]:
    # Every selective policy goes through the ledger: see NOTE in remat.core._rng.
    ledger = RngLedger(policy_fn)
    writes = ForwardWrites(ledger.decide)  # NOTE [Cached outputs written in place] in remat.core._contexts
    forward, recompute = create_selective_checkpoint_contexts(
        writes.decide, allow_cache_entry_mutation=options.allow_cache_entry_mutation
    )
    route_saved_tensors_hooks(forward, options)  # NOTE in remat.core._torch_options
    written = RecomputeWritten(recompute)
    forward = Stacked(RecomputeWritten(forward, at_exit=True, writes=writes), forward)
    return forward, Stacked(written, recompute, ReplayContext(ledger)) if replay_rng else Stacked(written, recompute)


def policy_contexts(
    policy_fn: Callable[..., Any] | None, replay_rng: bool, options: CallOptions, *, ledger: bool = True
) -> tuple[Any, Any]:
    """The forward and recompute contexts of a policy, a torch user's own ``context_fn`` inside them. Without
    ``ledger``, a selective policy is torch's own selective checkpoint, with none of remat's contexts around it
    (NOTE [Under torch.func transforms] in remat.core._functorch)."""
    fwd: Any
    rec: Any
    if policy_fn is None:
        fwd, rec = contextlib.nullcontext(), contextlib.nullcontext()
    elif not ledger:
        fwd, rec = create_selective_checkpoint_contexts(
            policy_fn, allow_cache_entry_mutation=options.allow_cache_entry_mutation
        )
    else:
        fwd, rec = _selective_contexts(policy_fn, replay_rng, options)
    if options.contexts is not None:  # a torch user's own context_fn (remat.core._torch_options)
        fwd, rec = Stacked(fwd, options.contexts[0]), Stacked(rec, options.contexts[1])
    return fwd, rec

"""The selective policy without a per-op hook: cheap submodules recomputed as regions of their own.

NOTE [Selective by module]
Op-level selective checkpointing (torch's selective-checkpoint dispatch mode) runs a
Python ``__torch_dispatch__`` on every op of the block, in forward and in recompute:
tens of microseconds per op. Where steps are fast (bf16 on a GPU, small layers, tiny
tensors on CPU) that costs more than recomputing everything (on the small bf16 Llama of
``benchmarks/gpu-truth/``, every block op-level selective is slower than every block full).

Most blocks have module structure that says the same thing for free. The first
selective call of a block still runs op-level (correct whatever the block is) and,
beside it, notes with module hooks which submodules ran a compute-intensive op
(``SAVE_OPS``) or drew random numbers (a dropout mask is cheaper to keep than to
recompute) and which ran only cheap ops (norms, activations): ``Structure``. Every
later call runs the block with no dispatch mode: the outermost cheap submodules each
run as a small region (``_Frame``), everything else runs as it would without
checkpointing and keeps what it saves. The block itself is never recomputed.

A submodule is not made a region when it writes in place to its inputs, returns one
of them, returns something other than one tensor that requires grad, or only reshapes
(views are free). Buffers a region wrote on the first call (BatchNorm's statistics) are
copied before each forward and swapped in while it recomputes, so they change once per
step and the recompute sees what the forward saw. A block with no cheap submodule, or
that is cheap as a whole, stays op-level; so does one that runs its submodules under
saved-tensor hooks of its own (NOTE [Hooks inside the block]); so do op lists, policy
functions and plain functions (no modules to use).

Memory: what a region's output is saved for after it (a Linear's weight gradient,
the MLP's product) is recomputed for them too (NOTE [Outputs recomputed for their
consumers]). Ops written in the block's own forward (attention's math path, rotary
embeddings, the MLP's gate product) and autocast's copies keep what they save, where
op-level selective recomputes them; op-level keeps every matmul output, needed or not,
where this keeps only what is saved. Fake H100 profiles, every block selective: GPT-2
12x768 fp32 8335 MiB by module against 8479 op by op, Llama 16x2048 fp32 20694 against
19350, bf16 autocast 7407 against 7101 and 10501 against 9579.

NOTE [A region as saved-tensor hooks], NOTE [Outputs recomputed for their consumers] and NOTE
[What a region drops] are in ``remat.core._cheap_regions``.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from remat.core._cheap_regions import Writes, _Frame, _Outputs
from remat.core._rng import draws_random, fingerprint
from remat.core._writes import storage_key, written_tensors

_local = threading.local()


# NOTE [Learning kept until the step ends]
# A block's first selective call runs op-level and learns its structure; its next call takes the fast
# path. A block called twice in one step (weight sharing) thus runs op-level, then by module, in the
# step where it learns. The profile's selective-ops traced step is such a step (NOTE [selective-ops
# traces selective's learning] in remat.profiling._schedule) and must run op-level throughout, as
# every selective-ops step does: within ``learned_at_exit`` what a call learns is remembered only on
# leaving, so every call inside is a first call (otherwise a block called twice would run its second
# call by module, and the profile would predict selective-ops' peak below the measured one).
@contextlib.contextmanager
def learned_at_exit() -> Iterator[None]:
    """Within: what selective's first calls learn is remembered on leaving (NOTE above); dropped on an error."""
    pending: list[Callable[[], None]] = []
    outer = getattr(_local, "pending", None)
    _local.pending = pending
    try:
        yield
    finally:
        _local.pending = outer
    for remember in pending:
        remember_learned(remember)


def remember_learned(remember: Callable[[], None]) -> None:
    """Run ``remember`` now, or on leaving :func:`learned_at_exit`."""
    pending = getattr(_local, "pending", None)
    if pending is None:
        remember()
    else:
        pending.append(remember)


@dataclass(frozen=True)
class Structure:
    """What a block's first selective call learned (NOTE [Selective by module])."""

    regions: tuple[tuple[weakref.ref, Writes], ...]
    """The outermost cheap submodules, each with the buffers (module, name) it wrote."""

    def live(self) -> list[tuple[nn.Module, Writes]] | None:
        """The region modules, or None when one of them is gone (learn again)."""
        out = []
        for ref, writes in self.regions:
            module = ref()
            if module is None:
                return None
            out.append((module, writes))
        return out


@dataclass
class _Seen:
    """One submodule's calls during the learning forward."""

    module: nn.Module
    heavy: bool = False
    work: bool = False
    unfit: bool = False
    ancestors: set[int] = field(default_factory=set)
    writes: set[int] = field(default_factory=set)
    buffers: set[tuple[weakref.ref, str]] = field(default_factory=set)


def _tensor_keys(value: Any) -> set[int]:
    leaves, _ = tree_flatten(value)
    return {storage_key(t) for t in leaves if isinstance(t, torch.Tensor)}


# NOTE [Tensor subclasses stay op-level]
# A region hands its consumers views of its output rebuilt with as_strided, and finds
# what they saved of it by storage: neither works for a wrapper subclass (tensor
# parallelism's DTensor activations: as_strided is refused, the storage is a stand-in,
# so a region beside them recomputed nothing and the block kept everything). A block
# whose submodules take or return one learns no regions and stays op-level, which is
# exact for them (torch's selective checkpoint under the mode) and recomputes its cheap ops.
def _wraps_tensors(value: Any) -> bool:
    leaves, _ = tree_flatten(value)
    return any(isinstance(t, torch.Tensor) and is_traceable_wrapper_subclass(t) for t in leaves)


# NOTE [Hooks inside the block]
# A block that runs a submodule under saved-tensor hooks of its own (a torch checkpoint it calls itself,
# save_on_cpu) stays op-level: no region is learned in it. A region is saved-tensor hooks around its
# submodule's forward, there for that forward only. Inside a torch checkpoint, the checkpoint reruns the
# submodule in backward after the region's hooks are gone, so the rerun saves other tensors than the forward
# did and torch raises CheckpointError (a block calling torch.utils.checkpoint on its MLP: step 2 by module
# failed on saved [64, 32], recomputed [32]). Hooks that never rerun (save_on_cpu) would be safe, but remat
# cannot tell the two apart, and op-level is exact under both. Seen on the learning call: the innermost hooks
# when a submodule is entered are not those the block's own checkpoint runs under.
def _innermost_hooks() -> Any:
    """The innermost saved-tensor hooks (pack, unpack) active now; None: none (or a torch that cannot tell)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return None if top is None else top(False)


# NOTE [A region never draws]
# A cheap region reruns in backward with no generator restored (its block is not recomputed, so torch's
# stash of the RNG state does not cover it): a submodule that drew random numbers must not become one, or
# its rerun draws another mask. Draws are seen, not named (NOTE [Random draws are seen, not named] in
# remat.core._rng): a submodule whose generators' states differ between entering and leaving it on the
# learning call drew, be it a dropout, a custom op or a kernel that draws inside. Read only on that call.
class StructureRecorder(TorchDispatchMode):
    """Entered around a block's first selective forward: which submodules are cheap."""

    def __init__(self, owner: nn.Module, heavy: Callable[[Any], bool]) -> None:
        super().__init__()
        self.owner = owner
        self.heavy = heavy
        self.stack: list[_Seen] = []
        self.seen: dict[int, _Seen] = {}
        self.any_heavy = False
        self.subclass = False
        """A submodule took or returned a tensor subclass (NOTE [Tensor subclasses stay op-level])."""
        self.hooked = False
        """A submodule ran under saved-tensor hooks the block installed (NOTE [Hooks inside the block])."""
        self._block_hooks: Any = None
        self._rng: list[tuple[bytes | None, ...]] = []
        """The generators' states when each submodule on the stack was entered (NOTE [A region never draws])."""
        self._hooks: list[Any] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        heavy = self.heavy(func) or draws_random(func)
        self.any_heavy |= heavy
        if self.stack:
            writes = {storage_key(t) for t in written_tensors(func, args, kwargs)}
            work = not getattr(func, "is_view", False)
            for seen in self.stack:
                seen.heavy |= heavy
                seen.work |= work
                seen.writes |= writes
        return func(*args, **kwargs)

    def _enter_module(self, module: nn.Module, args: tuple) -> None:
        seen = self.seen.setdefault(id(module), _Seen(module))
        seen.ancestors.update(id(s.module) for s in self.stack)
        self.hooked |= _innermost_hooks() != self._block_hooks
        self.stack.append(seen)
        self._rng.append(fingerprint())

    def _leave_module(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not self.stack or self.stack[-1].module is not module:
            return
        seen = self.stack.pop()
        if fingerprint() != self._rng.pop():  # it drew, whatever its ops are named
            seen.heavy = self.any_heavy = True
        inputs = _tensor_keys((args, kwargs))
        fits = (
            isinstance(output, torch.Tensor)
            and output.requires_grad
            and output.is_floating_point()
            and storage_key(output) not in inputs
            and not (seen.writes & inputs)
        )
        self.subclass |= _wraps_tensors((args, kwargs, output))
        seen.unfit |= not fits
        for sub in module.modules():
            for name, buf in sub._buffers.items():
                if buf is not None and storage_key(buf) in seen.writes:
                    seen.buffers.add((weakref.ref(sub), name))

    def __enter__(self) -> StructureRecorder:
        self._block_hooks = _innermost_hooks()  # the block's own checkpoint's
        # Hooks on the block's own submodules, not global ones (torch.compile warns about those).
        self._hooks = [
            h
            for m in self.owner.modules()
            if m is not self.owner
            for h in (
                m.register_forward_pre_hook(self._enter_module),
                m.register_forward_hook(self._leave_module, with_kwargs=True),
            )
        ]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for hook in self._hooks:
            hook.remove()
        super().__exit__(*exc)

    def structure(self) -> Structure:
        """The outermost cheap submodules (none when the block has none, is cheap as a whole, sees subclasses or
        installs saved-tensor hooks)."""
        cheap = {i for i, s in self.seen.items() if s.work and not s.heavy and not s.unfit}
        if not self.any_heavy or self.subclass or self.hooked:
            cheap = set()
        outermost = [self.seen[i] for i in cheap if not (self.seen[i].ancestors & cheap)]
        return Structure(
            tuple((weakref.ref(s.module), tuple(sorted(s.buffers, key=lambda b: b[1]))) for s in outermost)
        )


class _RegionForward:
    """Stands in for a cheap submodule's forward while its block runs the fast path."""

    def __init__(self, module: nn.Module, writes: Writes, owner: nn.Module | None, outputs: _Outputs) -> None:
        self.module = module
        self.forward = module.forward
        self.writes = writes
        self.owner = owner
        self.outputs = outputs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        frame = _Frame(self.forward, args, kwargs, self.module, self.writes, self.owner)
        before = fingerprint()
        with torch.autograd.graph.saved_tensors_hooks(frame.pack, _Frame.unpack):
            out = self.forward(*args, **kwargs)
        if fingerprint() != before:  # NOTE [A region that begins to draw]
            frame.drew = True
            _warn_drew(self.module, self.owner)
        frame.settle(out)
        self.outputs.register(frame, out)
        return out


# NOTE [A region that begins to draw]
# What a cheap submodule does is learned on its block's first call (NOTE [A region never draws]), but a
# submodule may begin to draw later: a dropout whose rate a schedule raises from 0 (``nn.Dropout(0.0)``
# draws nothing), a stochastic depth switched on after warm-up. Its region reran in backward with no
# generator restored and drew another mask: gradients of every layer before it differed from the model's.
# So each region call compares the generators' states around its forward (two reads, about 10 us), and a
# call that drew keeps what it saved, as the unwrapped module would (``_Frame.drew``): its gradients are the
# model's, its memory that of keeping it, which the plan did not predict; a warning says so once per module.
_warned: weakref.WeakSet = weakref.WeakSet()


def _warn_drew(module: nn.Module, owner: nn.Module | None) -> None:
    if module in _warned:
        return
    _warned.add(module)
    warnings.warn(
        f"remat: selective checkpointing learned {type(module).__name__} (in {type(owner).__name__}) as a cheap "
        "region that draws no random numbers, and it drew on a later call (a dropout rate raised from 0, say): "
        "what it saves is kept from now on, not recomputed, so its gradients stay the model's and the block holds "
        "more memory than the plan predicted. Re-plan (remat.auto) after changing the model's randomness.",
        stacklevel=3,
    )


_MISSING = object()


def run_by_module(
    fn: Callable, regions: list[tuple[nn.Module, Writes]], args: tuple, kwargs: dict, owner: nn.Module | None
) -> Any:
    """``fn(*args, **kwargs)`` with each region module's forward standing in as a region (:class:`_Frame`)."""
    patched = []
    outputs = _Outputs()
    try:
        for module, writes in regions:
            previous = module.__dict__.get("forward", _MISSING)
            module.__dict__["forward"] = _RegionForward(module, writes, owner, outputs)
            patched.append((module, previous))
        with torch.autograd.graph.saved_tensors_hooks(outputs.pack, _Outputs.unpack):
            out = fn(*args, **kwargs)
        for frame in outputs.settling:
            frame.finish()
        return out
    finally:
        for module, previous in reversed(patched):
            if previous is _MISSING:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = previous

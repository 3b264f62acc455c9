"""The state one checkpointed call shares between its forward and its recomputations.

NOTE [What recomputation must not repeat]
torch's non-reentrant checkpoint reruns the function in backward. Two kinds of
state change in the forward would then happen twice or be seen twice:

* Buffers mutated by modules (BatchNorm's ``running_mean``/``running_var``/
  ``num_batches_tracked``, any EMA or counter buffer). torch 2.13 updates them
  again in recompute (``num_batches_tracked == 2`` after one step).
* Inputs mutated in place by the function (``x.relu_()`` as its first op). torch
  keeps the mutated input and refuses it in backward (version mismatch).

A region watches the storages of its inputs and of the buffers of every module
entered during its forward and of their submodules (NOTE [Buffers of submodules never
entered] in remat.core._contexts), and keeps the value the forward started from of each
one the forward writes. Recompute then runs on fresh copies of those values:
buffers are swapped for the copies while recomputing and swapped back afterwards,
so the user's buffers change exactly once per step and the recompute sees the
state the forward saw.

The fresh copies of written inputs are made when a recomputation begins, before
torch's selective-checkpoint mode is entered: that mode refuses, in recompute, any
op the forward did not run under it (torch 2.13: "aten.clone.default encountered
during backward but not found in storage"), and the forward's copies were made
beneath it. Under "full" nothing watches the ops, so where the copy is made
changes nothing there.

NOTE [Parameters a forward writes]
A forward may write a parameter in place outside autograd (a vector quantiser re-initialising
dead codes through ``.data``, an EMA codebook moved under ``no_grad``); recomputed, it wrote
it again and computed from the written value (other gradients, every policy; torch's checkpoint
alike). A first call watches the parameters of the modules it enters as their buffers, later
calls those it wrote, and recomputation runs on a copy of the value before the write that
requires grad as the parameter does (ops on it save what they saved in the forward). Not
watched: one first written by a later call, a tensor subclass's (FSDP's shards), and an
assignment to ``.data`` (no op to see), which ``remat.auto``'s comparison refuses.

NOTE [Watching only when needed]
The first forward of a callable (a wrapped module, a function) runs under a
dispatch mode that copies a watched storage right before its first in-place
write (copy-on-write). A Python dispatch mode costs tens of microseconds per op
(about a tenth of a ResNet block's forward on CPU), so the region
remembers what that first forward wrote (``Learned``). Later forwards of the
same callable that write no input run without the mode: buffers are copied when
their module is entered (those the first call wrote, and any up to
``SNAPSHOT_BYTES``, which covers a module switched from eval to train), copies
of buffers left unwritten are dropped at the end of the forward, and version
counters check that nothing unwatched was written; if something was, the call
fails with a RematError (its earlier value is gone) and the next call watches
every op again.

Where the checkpointed callable is a module's forward, later forwards also go
without the module-wide forward pre-hook that finds the modules entered: every
submodule call would pay for it (host time per block call shows on
fast GPUs). The modules with buffers that the first call entered, and every one
under the checkpointed module, are watched from the start of the forward
instead; the values copied there are the ones the recomputation must start
from. A module with buffers outside the checkpointed one, entered only by later
calls, is the one case this does not watch.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from remat.core import _nested_writes as nested_writes
from remat.core._arguments import collect_tensors
from remat.core._generators import OwnGenerators
from remat.core._learned import Learned
from remat.core._recomputing import bookkeeping, is_recomputing
from remat.core._slots import Slots
from remat.core._writes import storage_key

#: A module's ``__dict__`` entry naming other modules whose buffers its forward reads without calling them (a traced
#: segment's inlined code: NOTE [Buffers a segment reads] in remat.profiling._traced); watched like its own.
REGION_BUFFER_MODULES = "_remat_buffer_modules"


def _same_values(a: torch.Tensor, b: torch.Tensor, *, expected: bool) -> bool:
    """``torch.equal``. Fake tensors (a fake profile) have no values: a buffer the first call saw written
    counts as written, any other as unchanged, as the values on real tensors would say in the same mode."""
    try:
        return torch.equal(a, b)
    except DataDependentOutputException:
        return not expected


#: Buffers up to this many bytes are copied on entering their module without a dispatch mode.
SNAPSHOT_BYTES = 64 * 1024


# NOTE [An input's version is its tensor's]
# A region records each input's version counter at the end of its forward, to refuse a
# recomputation from an input written in place since. The record is looked up by the
# tensor's id(), and an id is reused once its tensor dies: a region inside a nested segment
# lets go of its inputs after its forward (NOTE [Regions inside regions] in
# remat.core.checkpoint) and is handed others when it recomputes, and when one of them
# took a dead input's id, their versions were compared (a traced model at its nested
# floor raised "modified in place (version 1 -> 0)" in 1-7% of its training steps, on
# a plan remat.auto had verified). So a record holds a weak reference to its tensor and
# counts only for that tensor.
def _versions(inputs: list[torch.Tensor]) -> dict[int, tuple[weakref.ref, int]]:
    """id -> (the tensor, weakly; its version now) of each input."""
    return {id(t): (weakref.ref(t), t._version) for t in inputs}


class Region:
    """Inputs, watched storages and their pre-forward values for one checkpointed call."""

    def __init__(
        self, args: tuple, kwargs: dict, learned: Learned | None = None, owner: nn.Module | None = None
    ) -> None:
        self.args = args
        self.kwargs = kwargs
        # NOTE [Arguments as the call saw them] in remat.core._arguments: the containers now, for recomputation
        # (the top-level kwargs dict is the call's own: its values are walked)
        self._inputs: list[torch.Tensor] | None = []
        held = [collect_tensors(item, self._inputs) for item in (*args, *kwargs.values())]
        self._as_called = torch.utils._pytree.tree_flatten((args, kwargs)) if any(held) else None
        self.owner = owner
        """The module whose forward is checkpointed: its own hooks ran before the region began."""
        self.generators = OwnGenerators(learned.generators if learned is not None else ())
        """Generators of its own and their states as it began (NOTE in remat.core._generators)."""
        self.slots = Slots(owner) if owner is not None else None
        """Its tensors as the call began (NOTE [A module's tensors as its forward saw them] in remat.core._slots)."""
        self.learned = learned
        """None: the callable's first call (watch every op)."""
        self.watched: dict[int, torch.Tensor] = {}
        self.before: dict[int, torch.Tensor] = {}
        self.buffers: dict[int, list[tuple[weakref.ref, str]]] = {}
        self.entry_versions: dict[int, int] = {}
        self.expected: set[int] = set()
        """Storage keys of the buffers the first call saw written."""
        self.buffer_modules: dict[int, nn.Module] = {}
        self.trees_watched: set[int] = set()
        """Modules whose subtrees are watched this call (NOTE [Buffers of submodules never entered])."""
        self.written_inputs: dict[int, bool] = {}
        """Storage key -> requires_grad of each input the forward wrote in place."""
        self._fresh: dict[int, torch.Tensor] = {}
        self.forward_done = False  # a recomputation may begin before (NOTE in remat.core._contexts)
        self.recomputations = 0
        self._leaves: list[Any] | None = None
        self._forward_keys: dict[int, int] = {}
        self.forward_ended = 0
        """When its forward ended (``_nested_writes.now()``): records of the inputs older than that are not of it."""
        inputs = self.input_tensors()
        self.input_versions = _versions(inputs)
        if self.watches_ops:  # later calls check inputs by version counter only (_check_unwatched_writes)
            for t in inputs:
                self.watched.setdefault(storage_key(t), t)

    def version_then(self, t: torch.Tensor) -> int | None:
        """The version input ``t`` had when recorded, where it has changed since; None if it has not, or if ``t``
        is not a tensor recorded (NOTE [An input's version is its tensor's])."""
        then = self.input_versions.get(id(t))
        if then is None or then[0]() is not t or then[1] == t._version:
            return None
        return then[1]

    @property
    def watches_ops(self) -> bool:
        return self.learned is None or self.learned.writes_inputs

    def input_tensors(self) -> list[torch.Tensor]:
        if self._inputs is None:  # found once per call: a block's kwargs are a tree (Hugging Face)
            self._inputs = []
            collect_tensors((self.args, self.kwargs), self._inputs)
        return self._inputs

    # -- forward -------------------------------------------------------------
    def watch_buffers(self, module: nn.Module) -> None:
        for name, buf in module._buffers.items():
            if buf is not None:
                self.buffer_modules[id(module)] = module
                self._watch(module, name, buf, SNAPSHOT_BYTES)
        # NOTE [Parameters a forward writes]: every one on a first call, those it wrote on later ones
        learned = self.learned if self.learned is not None and not self.learned.writes_inputs else None
        for name, param in module._parameters.items():
            if param is None or is_traceable_wrapper_subclass(param):  # FSDP's shards have no storage of their own
                continue
            if learned is None or (id(module), name) in learned.written_buffers:
                self._watch(module, name, param, -1)

    def _watch(self, module: nn.Module, name: str, t: torch.Tensor, snapshot_bytes: int) -> None:
        key = storage_key(t)
        if key not in self.watched:
            self.watched[key] = t
            if self.learned is not None and not self.learned.writes_inputs:  # as watches_ops, narrowed
                self.entry_versions[key] = t._version
                expected = (id(module), name) in self.learned.written_buffers
                if expected:
                    self.expected.add(key)
                if expected or t.untyped_storage().nbytes() <= snapshot_bytes:
                    self.note_write(t)
        owners = self.buffers.setdefault(key, [])
        if not any(ref() is module and n == name for ref, n in owners):
            owners.append((weakref.ref(module), name))

    def note_write(self, t: torch.Tensor) -> None:
        key = storage_key(t)
        if key in self.watched and key not in self.before:
            with torch.no_grad(), bookkeeping():
                self.before[key] = self.watched[key].detach().clone()

    def finish_forward(self) -> Learned | None:
        """Settle what recompute needs; on a first call, return what this forward wrote."""
        inputs = self.input_tensors()
        if not self.watches_ops:
            self._check_unwatched_writes(inputs)
            # Legacy batch-norm kernels write running stats without bumping the version: compare values too.
            self.before = {
                k: v
                for k, v in self.before.items()
                if self.watched[k]._version != self.entry_versions[k]
                or not _same_values(v, self.watched[k], expected=k in self.expected)
            }
        if is_recomputing():  # NOTE [A write after a call inside a recomputation] in remat.core._nested_writes
            began = [self.input_versions.get(id(t), (None, t._version))[1] for t in inputs]
            nested_writes.remember(inputs, began)
        self.input_versions = _versions(inputs)
        self.forward_ended = nested_writes.now()
        self.written_inputs = {storage_key(t): t.requires_grad for t in inputs if storage_key(t) in self.before}
        # Buffers that were only read need no copy: recompute may use them as they are.
        self.buffers = {k: v for k, v in self.buffers.items() if k in self.before}
        self.forward_done = True
        if self._as_called is not None:  # the caller's own containers: held, they would keep what it adds later
            self.args, self.kwargs = self._as_handed()
        if self.learned is not None:
            return None
        written = {(id(ref()), name) for owners in self.buffers.values() for ref, name in owners if ref() is not None}
        return Learned(
            any(storage_key(t) in self.before for t in inputs),
            frozenset(written),
            self._buffer_module_refs(),
            self.generators.known(),
        )

    def _buffer_module_refs(self) -> tuple[weakref.ref, ...]:
        for owners in self.buffers.values():  # those holding a parameter it wrote too
            for ref, _ in owners:
                if (module := ref()) is not None:
                    self.buffer_modules.setdefault(id(module), module)
        below = self.owner.modules() if self.owner is not None else ()
        for module in below:
            if any(b is not None for b in module._buffers.values()):
                self.buffer_modules.setdefault(id(module), module)
        return tuple(weakref.ref(m) for m in self.buffer_modules.values())

    def _check_unwatched_writes(self, inputs: list[torch.Tensor]) -> None:
        from remat.errors import RecomputeError

        changed = [t for t in inputs if self.version_then(t) is not None]
        unkept = [k for k, v in self.entry_versions.items() if self.watched[k]._version != v and k not in self.before]
        if changed or unkept:
            what = "one of its inputs" if changed else f"a buffer of shape {tuple(self.watched[unkept[0]].shape)}"
            raise RecomputeError(
                f"remat.checkpoint: this call wrote in place to {what}, which the function's first call did not; "
                "remat watches for such writes only where the first call made them, so it did not keep the "
                "earlier value and cannot recompute this call exactly. It watches every op from the next call "
                "on: run the step again."
            )

    def _as_handed(self) -> tuple[tuple, dict]:
        """The arguments to recompute from, in containers of their own as the call was handed them (NOTE
        [Arguments as the call saw them] in remat.core._arguments)."""
        if self._as_called is None:
            return self.args, self.kwargs
        return torch.utils._pytree.tree_unflatten(*self._as_called)

    # -- nested regions (NOTE [Regions inside regions] in remat.core.checkpoint) --
    def handed_inputs(self) -> list[torch.Tensor]:
        """The input tensors, each once (a call handed ``x, x, x`` gets back one tensor, not three: a module may
        branch on ``query is key``, as ``nn.MultiheadAttention`` does)."""
        return list({id(t): t for t in self.input_tensors()}.values())

    def release_inputs(self) -> None:
        """Drop the references to the input tensors (torch holds them through the enclosing hooks, as
        :meth:`handed_inputs` listed them)."""
        handed = self.handed_inputs()
        at = {id(t): n for n, t in enumerate(handed)}
        leaves, self._spec = torch.utils._pytree.tree_flatten(self._as_handed())
        self._as_called = None  # restore_inputs builds new containers from these leaves each time
        self._slots = [(i, at[id(t)]) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
        self._slot_keys = [storage_key(t) for t in handed]
        for key in self._slot_keys:
            if key not in self.before:
                self.watched.pop(key, None)
        for i, _ in self._slots:
            leaves[i] = None
        self._leaves = leaves
        self._inputs = None
        self.args, self.kwargs = torch.utils._pytree.tree_unflatten(leaves, self._spec)

    def restore_inputs(self, tensors: tuple) -> None:
        """Put back the inputs torch unpacked for a recomputation (held still if the forward has not ended)."""
        if self._leaves is None:
            return
        leaves = list(self._leaves)
        for i, n in self._slots:
            leaves[i] = tensors[n]
        # The outer recomputation's tensors, other storages than the forward's: the copies of what the forward
        # wrote are found by the slot's key in the forward (NOTE [What recomputation must not repeat]).
        self._forward_keys = {id(t): key for t, key in zip(tensors, self._slot_keys)}
        self._inputs = None
        self.args, self.kwargs = torch.utils._pytree.tree_unflatten(leaves, self._spec)

    # -- recompute -----------------------------------------------------------
    def prepare_recompute(self) -> None:
        """Fresh copies of the inputs the forward wrote, for the recomputation about to begin (NOTE [What
        recomputation must not repeat]); clone() so that an in-place op on one is not one on a leaf."""
        self._fresh = {}
        if not self.forward_done:
            self._prepare_early_recompute()
            return
        for key, requires_grad in self.written_inputs.items():
            self._fresh[key] = self._copy_before(key, requires_grad)

    def _copy_before(self, key: int, requires_grad: bool) -> torch.Tensor:
        with torch.no_grad():
            copy = self.before[key].detach()
        return copy.requires_grad_(requires_grad).clone()

    def _prepare_early_recompute(self) -> None:
        """Where the function may write its inputs, a copy of each for a recomputation that begins before the
        forward ended (NOTE [Recomputed before the forward ends] in remat.core._contexts): the value before the
        forward, or a clone that keeps the graph (``torch.autograd.grad`` in the function may differentiate)."""
        if not self.watches_ops:  # this callable is known to write none of its inputs
            return
        for t in self.input_tensors():
            key = storage_key(t)
            if key in self._fresh:
                continue
            if key in self.before:
                self._fresh[key] = self._copy_before(key, t.requires_grad)
            else:
                with bookkeeping():
                    self._fresh[key] = t.clone()

    def end_recompute(self) -> None:
        self._fresh = {}

    def recompute_inputs(self) -> tuple[tuple, dict]:
        fresh_copies, self._fresh = self._fresh, {}  # the recomputation's own: not held after it
        handed = self._leaves is not None  # by torch: NOTE [Regions inside regions] in remat.core.checkpoint
        if (
            not handed
            and not fresh_copies
            and not self.before
            and all(self.version_then(t) is None for t in self.input_tensors())
        ):
            return self._as_handed()  # nothing to swap or refuse: no walk over the argument tree

        def fresh(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            recorded = nested_writes.recorded(t, self.forward_ended) if handed else None
            if recorded is not None:
                return self._handed_input(t, recorded, fresh_copies)
            key = storage_key(t)
            if key in fresh_copies:
                return fresh_copies[key]
            then = self.version_then(t)
            if then is not None:
                raise nested_writes.written_error(t, then, t._version, handed=False)
            return t

        return torch.utils._pytree.tree_map(fresh, self._as_handed())

    def _handed_input(self, t: torch.Tensor, recorded: tuple[int, int], fresh_copies: dict) -> torch.Tensor:
        """What to recompute from for a tensor torch handed back from the outer recomputation's run of this call
        (NOTE [A write after a call inside a recomputation] in remat.core._nested_writes)."""
        entry, end = recorded
        key = self._forward_keys.get(id(t))
        if entry != end and key in fresh_copies:  # the call wrote it: the forward's copy of the value before
            return fresh_copies[key]
        if t._version != end:
            raise nested_writes.written_error(t, end, t._version, handed=True)
        return t

    @contextlib.contextmanager
    def swapped_buffers(self) -> Iterator[None]:
        swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
        for key, owners in self.buffers.items():
            for ref, name in owners:
                module = ref()
                if module is None:
                    continue
                slots = module._parameters if name in module._parameters else module._buffers
                swapped.append((slots, name, slots[name]))
                # a parameter's copy requires grad as it does: ops on it save what they saved in the forward
                slots[name] = self.before[key].clone().requires_grad_(slots[name].requires_grad)
        try:
            yield
        finally:
            for slots, name, original in reversed(swapped):
                slots[name] = original

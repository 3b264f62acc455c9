"""Profiling on fake tensors: shapes, dtypes and storage sizes, no data, no allocation.

The model's parameters and buffers are swapped for fake CPU tensors of the same
shapes (they may be real or on the meta device: a 7B-parameter model built under
``torch.device("meta")`` profiles on a laptop), the step runs under
``FakeTensorMode``, and the original tensor objects are put back afterwards. The
storage tracker counts fake storages exactly as real ones; times come from a
:class:`remat.profiling.targets.Target` roofline.

Fake tensors are CPU tensors, so on their own they follow the CPU's kernels. For a
CUDA target (``h100``, ``a100``) the run takes the target's instead, and counts
what those kernels allocate beside their outputs:

* SDPA and dropout are routed to the kernels CUDA would run, and autocast applies
  CUDA's cast lists (NOTE [Fake tensors take the target's kernels] in
  ``_cuda_kernels``, NOTE [CUDA autocast on fake CPU tensors] in ``_cuda_autocast``);
* Hugging Face models take the path they take on a GPU, not their tracing path:
  small tensors keep real values (NOTE [Value shadows] in ``_shadow``) and
  transformers is told fake tensors are not tracing (``core._hf.fake_tensors_untraced``);
* each op's workspace and the library workspaces kept across steps come from the
  target's table (NOTE [Workspace no tensor owns] in ``_workspace``, ``_target_data``);
* BatchNorm's outputs are laid out as its CPU and CUDA kernels lay them out, not as its
  meta kernel does (NOTE [Output layouts of the device's kernels] in ``_kernel_layouts``).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
from torch.utils._pytree import tree_map

from remat.core._costs import spent
from remat.core._hf import cache_disabled, fake_tensors_untraced
from remat.core._loop import NO_LOOP, Loop, optimizer_state
from remat.core._memtrack import BlockBytes, storage_bytes
from remat.core._policy_registry import KEEP
from remat.core._state import host_rng, restoring, set_host_rng, uninterrupted
from remat.core._step import InputGrads
from remat.core._typing import Inputs, LossFn
from remat.errors import RematError
from remat.profiling._assemble import Ledger, assemble
from remat.profiling._cuda_autocast import cuda_autocast_lists
from remat.profiling._cuda_kernels import cuda_kernels
from remat.profiling._fsdp_fake import dtensor_twin, fake_shards
from remat.profiling._profile_run import _Policies, traced_step
from remat.profiling._schedule import learn_structure, trace_schedule, traced_if, young_collections
from remat.profiling._segment import Segment
from remat.profiling._shadow import ValueShadows
from remat.profiling._types import Profile
from remat.profiling._workspace import Workspace
from remat.profiling.targets import Target

#: What a fake step cannot run: a value read into Python, an output sized by values.
_VALUE_READS = (DataDependentOutputException, DynamicOutputShapeException)


def fake_like(mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    with mode:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")


def fake_on_shared_storage(mode: FakeTensorMode, t: torch.Tensor, bases: dict[int, torch.Tensor]) -> torch.Tensor:
    """A fake twin of input ``t`` on a fake storage of its storage's size, one per real storage in ``bases``: inputs
    that share a storage (``labels=input_ids``, views of one batch) share one, as they are counted on the device."""
    if type(t) is not torch.Tensor or t.device.type == "meta":
        return fake_like(mode, t)
    storage = t.untyped_storage()
    base = bases.get(storage.data_ptr()) if storage.data_ptr() else None
    if base is None or base.dtype != t.dtype or storage.nbytes() % t.element_size():
        with mode:
            base = torch.empty(storage.nbytes() // t.element_size(), dtype=t.dtype, device="cpu")
        if storage.data_ptr():
            bases[storage.data_ptr()] = base
    with mode:
        return base.as_strided(t.shape, t.stride(), t.storage_offset())


def fake_inputs(mode: FakeTensorMode, shadows: ValueShadows, inputs: Inputs, *, step: bool = False) -> Inputs:
    """Fake twins of the tensors in ``inputs`` (anything else as it is): inputs sharing a storage share one fake
    storage (``fake_on_shared_storage``), each twin requires grad as its input does, and ``shadows`` is seeded
    with its input's values. ``step``: counted as a training step counts them, a leaf's ``.grad`` twinned and a
    non-leaf made a view (NOTE [Each step's inputs are fresh] in remat.core._step: a leaf's gradient is kept to
    the end of the step, a non-leaf's used and freed)."""
    bases: dict[int, torch.Tensor] = {}

    def twin(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        fake = fake_on_shared_storage(mode, t, bases).requires_grad_(t.requires_grad)
        if step and t.is_leaf and t.grad is not None:
            fake.grad = fake_like(mode, t.grad)
        elif step and not t.is_leaf:
            with mode:
                fake = fake.view_as(fake)
        shadows.seed(fake, t)
        return fake

    return tree_map(twin, inputs)


class FakeWeights:
    """Swaps every parameter and buffer for a fake twin; puts the originals back on exit.

    A tensor held by several modules (tied embedding and output weights) gets one
    twin, so that it is counted once, as on the device. The loop's optimizer steps
    the twins, with a state of its own made on them (NOTE [The step a loop repeats]).
    """

    def __init__(self, model: nn.Module, mode: FakeTensorMode, optimizer: torch.optim.Optimizer | None) -> None:
        self.model = model
        self.mode = mode
        self.optimizer = optimizer
        self.saved: list[tuple[dict, str, Any]] = []
        self.groups: list[tuple[dict, list]] = []
        self.state: Any = None
        self.shards = contextlib.ExitStack()

    def __enter__(self) -> None:
        try:
            self._swap()
        except BaseException:
            self.__exit__()  # ``with`` leaves only what it entered: put back the twins swapped in so far
            raise

    def _swap(self) -> None:
        twins: dict[int, torch.Tensor] = {}
        self.shards.enter_context(fake_shards(self.model, self.mode, twins))  # NOTE [A sharded model on fake tensors]
        for module in self.model.modules():
            stores: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
            for store in stores:
                for name, t in store.items():
                    if t is None:
                        continue
                    self.saved.append((store, name, t))
                    if id(t) not in twins:
                        fake = dtensor_twin(self.mode, t.data if isinstance(t, nn.Parameter) else t)
                        fake = fake_like(self.mode, t) if fake is None else fake
                        twins[id(t)] = (
                            nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fake
                        )
                    store[name] = twins[id(t)]
        if self.optimizer is not None:
            self.groups = [(group, group["params"]) for group in self.optimizer.param_groups]
            for group, params in self.groups:
                group["params"] = [twins.get(id(p), p) for p in params]
            self.state, self.optimizer.state = self.optimizer.state, defaultdict(dict)

    def __exit__(self, *exc: Any) -> None:
        with uninterrupted():
            for store, name, t in reversed(self.saved):
                store[name] = t
            self.saved.clear()
            for group, params in self.groups:
                group["params"] = params
            self.groups = []
            if self.state is not None and self.optimizer is not None:  # a state was swapped out of the optimizer
                self.optimizer.state, self.state = self.state, None
            self.shards.close()


@contextlib.contextmanager
def _target_kernels(target: Target, gpu_path: bool) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        if target.cuda is not None:
            stack.enter_context(cuda_kernels(target.cuda.sdpa))
            stack.enter_context(cuda_autocast_lists())
        if gpu_path:
            stack.enter_context(fake_tensors_untraced())
        yield


_Traced = tuple[dict[str, list[Segment]], dict[str, tuple[int, int]], Inputs, dict[str, Ledger], tuple[int, int]]
"""One fake trace: per policy its segments, the blocks' I/O bytes, the fake inputs, per policy its crossings,
and (bytes the loop keeps alive, of which the optimizer's state)."""


def _trace(
    model: nn.Module,
    inputs: Inputs,
    loss_fn: LossFn | None,
    names: Sequence[str],
    policies: Sequence[str],
    target: Target,
    gpu_path: bool,
    loop: Loop,
    later: tuple[str, Callable[[_Traced], bool]] | None = None,
) -> _Traced:
    """``later``: the policy traced last and only if its test, asked of what was traced before it, says so
    (NOTE [A policy traced only when wanted])."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    shadows = ValueShadows(layouts=True, cuda=target.cuda is not None)  # NOTE [Output layouts of the device's kernels]

    fake_ins = fake_inputs(mode, shadows, inputs, step=True)
    workspace = Workspace(target.cuda.gpu, target.cuda.workspace) if target.cuda is not None else None
    blocks = target.block_bytes()  # NOTE [Blocks the caching allocator hands out]
    switch = _Policies(model, names)
    traced: dict[str, list[Segment]] = {}
    io_bytes: dict[str, tuple[int, int]] = {}
    ledgers: dict[str, Ledger] = {}
    with (
        restoring("remat.profile", switch.restore),
        FakeWeights(model, mode, loop.optimizer),
        cache_disabled(model),
        _target_kernels(target, gpu_path),
        young_collections(full=False),  # fake tensors hold no device memory
    ):
        last, wanted = later or (None, None)
        for policy, run_as, learn in _last(trace_schedule(policies), last):
            if wanted is not None and policy == last:
                with spent("fake profile"):
                    if not wanted((traced, io_bytes, fake_ins, ledgers, _kept(model, loop, blocks))):
                        continue
            switch.set(run_as)
            with mode, shadows:
                if learn:
                    with spent("fake learning steps"):
                        learn_structure(model, fake_ins, loss_fn)
                loop.steady(model, fake_ins, loss_fn)
                with spent("fake traced steps"):
                    traced[policy], io, _, ledgers[policy] = traced_step(
                        model,
                        fake_ins,
                        loss_fn,
                        names,
                        op_cost=target.op_seconds,
                        workspace=workspace,
                        loop=loop,
                        block_bytes=blocks,
                    )
            if policy == KEEP:  # NOTE [A unit run without its hooks] in remat.profiling._profile_run
                switch.only_called(traced[KEEP])
            io_bytes = io_bytes or io
        kept = _kept(model, loop, blocks)
        return {p: traced[p] for p in policies if p in traced}, io_bytes, fake_ins, ledgers, kept


def _kept(model: nn.Module, loop: Loop, block_bytes: BlockBytes | None) -> tuple[int, int]:
    """(bytes the loop keeps alive, of which the optimizer's state), read while the fake weights are in."""
    resident = storage_bytes(loop.resident(model), block_bytes)
    return resident, storage_bytes(optimizer_state(loop.optimizer), block_bytes)


def _last(schedule: list[tuple[str, str, bool]], policy: str | None) -> list[tuple[str, str, bool]]:
    """``schedule`` with ``policy``'s step moved last (NOTE [A policy traced only when wanted])."""
    return [s for s in schedule if s[0] != policy] + [s for s in schedule if s[0] == policy]


def run_fake_profile(
    model: nn.Module,
    inputs: Inputs,
    loss_fn: LossFn | None,
    *,
    names: Sequence[str],
    policies: Sequence[str],
    target: Target,
    loop: Loop = NO_LOOP,
) -> Profile:
    """Profile on fake tensors with times from ``target`` (see ``remat.profile``)."""
    training = {n: m.training for n, m in model.named_modules()}
    rng, host = torch.get_rng_state(), host_rng()

    def restore() -> None:
        for name, module in model.named_modules():
            module.training = training[name]
        torch.set_rng_state(rng)
        set_host_rng(host)

    grads = InputGrads(inputs)  # a loss_fn that reads a real input reaches it even here
    notes: list[str] = []
    extra = target.cuda.persistent_bytes if target.cuda is not None else 0
    if extra and target.cuda is not None:
        notes.append(
            f"resting bytes include {extra / 2**20:.0f} MiB that {target.name}'s libraries keep "
            f"allocated ({target.cuda.source})."
        )

    def profile_of(run: _Traced) -> Profile:
        traced, io_bytes, fakes, ledgers, kept = run
        return assemble(
            model,
            fakes,
            names,
            [p for p in policies if p in traced],
            traced,
            io_bytes,
            {},
            [],
            fake=True,
            target=target.name,
            device=f"{target.name} (fake)",
            extra_resting=extra,
            notes=notes,
            crossings=ledgers,
            loop=loop,
            loop_bytes=kept,
            block_bytes=target.block_bytes(),
        )

    asked = traced_if()
    later = None if asked is None else (asked[0], lambda run: asked[1](profile_of(run)))
    with restoring("remat.profile", restore, grads.restore):
        try:
            try:
                run = _trace(model, inputs, loss_fn, names, policies, target, gpu_path=True, loop=loop, later=later)
            except _VALUE_READS:
                # A value the shadows do not know (computed from weights, say): the library's own
                # tracing path avoids such branches, at the cost of a mask or copies the GPU never makes.
                run = _trace(model, inputs, loss_fn, names, policies, target, gpu_path=False, loop=loop, later=later)
                notes.append(
                    "fake run: the model's forward reads tensor values, so transformers took its tracing "
                    "path (explicit masks, repeated K/V heads), which a GPU step does not take."
                )
            return profile_of(run)
        except _VALUE_READS as exc:
            where = getattr(exc, "where", None)
            what = (
                "makes a tensor whose size depends on tensor values (a mixture-of-experts router picking each "
                "expert's tokens, say)"
                if isinstance(exc, DynamicOutputShapeException)
                else "reads a tensor's value"
            )
            raise RematError(
                f"remat.profile(fake=True): the model's forward {what}{f' at {where}' if where else ''} ({exc}), "
                "which fake tensors do not have; profile it on real tensors (with a smaller batch) instead."
            ) from None

"""Running the steps a profile is built from: one traced step per policy for
memory and FLOPs, then interleaved timed steps (A B C A B C ...) for time."""

from __future__ import annotations

import gc
import logging
import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from torch import nn

from remat.core._by_module import learned_at_exit
from remat.core._costs import spent
from remat.core._fine import FINE, inner_layers, wrap_fine
from remat.core._hf import cache_disabled
from remat.core._loop import NO_LOOP, Loop, OptimizerSnapshot
from remat.core._memtrack import BlockBytes, CudaAllocator, StorageTracker, storage_bytes
from remat.core._policy_registry import KEEP, NAMES
from remat.core._state import capture, restoring
from remat.core._step import InputGrads, LossFn, training_step
from remat.core._timing import clock_for
from remat.core.checkpoint import forget_structure, wrap
from remat.core.measure import device_of, resting_tensors
from remat.errors import RematError
from remat.profiling._assemble import Ledger, assemble
from remat.profiling._schedule import Phases, learn_structure, trace_schedule, young_collections
from remat.profiling._segment import Segment
from remat.profiling._trace import OpCost, OpWorkspace, SegmentRecorder
from remat.profiling._types import Key, Profile

log = logging.getLogger("remat")


# NOTE [A unit run without its hooks]
# A unit's segments begin and end with its forward hooks, but a parent may run it as
# ``module.forward(x)`` (timm's HRNet does, for TorchScript: ``down.forward(y)``). No
# hook fires, the profile never sees the unit called, and its work is the parent's
# code. Yet a run that puts every unit under a policy replaces its forward, so that
# code recomputed under ``full`` and not under ``keep``: the parent's code differed
# from run to run, and plans of the other units were predicted from the mix (HRNet's
# head: 1.1% under the measured peak; a small copy of it, 4.7%). So the units the keep
# run, which comes first, did not see called run unwrapped in every later run: the
# parent's code is the same in all of them, as where it calls the layers itself.
class _Policies:
    """Puts every block under one policy; restores the user's own forwards on exit."""

    def __init__(self, model: nn.Module, names: Sequence[str]) -> None:
        modules = dict(model.named_modules())
        self.blocks = {n: modules[n] for n in names}
        touched = [*self.blocks.values(), *(c for m in self.blocks.values() for c in inner_layers(m))]
        self.saved = [(m, m.__dict__.get("forward")) for m in touched]  # full-fine wraps the inner layers too
        for m in self.blocks.values():  # NOTE [selective-ops traces selective's learning] in remat.profiling._schedule
            forget_structure(m)

    def only_called(self, segments: Sequence[Segment]) -> None:
        """From now on, leave unwrapped the blocks that ``segments`` (a step's) never saw called (NOTE [A unit run
        without its hooks])."""
        called = {s.key[1] for s in segments if s.key[0] == "fwd"}
        self.blocks = {n: m for n, m in self.blocks.items() if n in called}

    def set(self, policy: str) -> None:
        self.restore()
        for m in self.blocks.values():
            if policy == FINE:
                wrap_fine(m)
            elif policy != KEEP:
                wrap(m, policy=policy)

    def restore(self) -> None:
        for m, forward in self.saved:
            if forward is None:
                m.__dict__.pop("forward", None)
            else:
                m.__dict__["forward"] = forward


def _run_step(
    model: nn.Module, inputs: Any, loss_fn: LossFn | None, recorder: SegmentRecorder, loop: Loop = NO_LOOP
) -> None:
    loop.start(model)
    recorder.begin("fwd", None)
    # the optimizer's step is the backward's last glue segment (NOTE [The step a loop repeats])
    training_step(
        model,
        inputs,
        loss_fn,
        loop.optimizer,
        before_backward=lambda: recorder.begin("bwd", None),
        before_optimizer_step=lambda: recorder.begin("bwd", None),
    )
    recorder.finish()


def traced_step(
    model: nn.Module,
    inputs: Any,
    loss_fn: LossFn | None,
    names: Sequence[str],
    op_cost: OpCost | None = None,
    workspace: OpWorkspace | None = None,
    loop: Loop = NO_LOOP,
    block_bytes: BlockBytes | None = None,
) -> tuple[list[Segment], dict[str, tuple[int, int]], int, Ledger]:
    """Segments, block I/O bytes, the resting bytes, and the crossing storages and block recomputations
    (NOTE [Storages across blocks]) of one tracked step.

    On CUDA live and peak bytes come from the allocator and times from CUDA events
    (NOTE [Peaks as the allocator counts them], NOTE [Clocks]); resting bytes are then
    what the allocator held at the start (library workspaces included). ``block_bytes``: what a fake
    profile's CUDA target counts for a storage (NOTE [Blocks the caching allocator hands out]).
    """
    loop.start(model)
    with spent("garbage collections"):
        gc.collect()
    device = device_of(model, inputs)
    allocator = CudaAllocator(device) if device.type == "cuda" else None
    tracker = StorageTracker(known=resting_tensors(model, inputs, loop), block_bytes=block_bytes)
    recorder = SegmentRecorder(
        model,
        names,
        tracker=tracker,
        op_cost=op_cost,
        workspace=workspace,
        allocator=allocator,
        clock=clock_for(device),
    )
    with recorder, tracker, learned_at_exit():  # NOTE [Learning kept until the step ends]
        _run_step(model, inputs, loss_fn, recorder, loop)
    if allocator is not None:
        resting = allocator.base
    else:
        resting = storage_bytes(resting_tensors(model, inputs, loop), block_bytes)
    return (
        recorder.segments,
        recorder.io_bytes,
        resting,
        Ledger(
            recorder.ledger.crossings,
            recorder.recomputes,
            recorder.trajectories,
            recorder.ledger.output_reads,
            recorder.ledger.call_forms,
        ),
    )


def _timed_segments(
    model: nn.Module, inputs: Any, loss_fn: LossFn | None, names: Sequence[str], loop: Loop
) -> list[Segment]:
    recorder = SegmentRecorder(model, names, clock=clock_for(device_of(model, inputs)))
    with recorder:
        _run_step(model, inputs, loss_fn, recorder, loop)
    return recorder.segments


def _check_same_structure(runs: dict[str, list[Segment]]) -> None:
    keys = {p: [s.key for s in segs] for p, segs in runs.items()}
    reference = keys[KEEP]
    for policy, k in keys.items():
        if sorted(k, key=repr) != sorted(reference, key=repr):
            raise RematError(
                f"remat.profile: the step runs different blocks under policy {policy!r} than without "
                f"checkpointing ({len(k)} vs {len(reference)} segments); is the model's forward data-dependent?"
            )


def run_profile(
    model: nn.Module,
    inputs: Any,
    loss_fn: LossFn | None,
    *,
    names: Sequence[str],
    policies: Sequence[str],
    warmup: int,
    repeat: int,
    loop: Loop = NO_LOOP,
) -> Profile:
    """Profile on real tensors (see ``remat.profiling.profile.profile`` for the arguments)."""
    # NOTE [Snapshots a step without an optimizer needs]
    changes_parameters = loop.optimizer is not None
    original, grads = capture(model, "remat.profile", parameters=changes_parameters), InputGrads(inputs)
    optimizer_state = OptimizerSnapshot(loop.optimizer, "remat.profile")
    switch = _Policies(model, names)
    cuda = device_of(model, inputs).type == "cuda"
    phases = Phases()
    with (
        restoring("remat.profile", switch.restore, original.restore, optimizer_state.restore, grads.restore),
        cache_disabled(model),
        young_collections(full=cuda),
    ):
        if cuda:  # lazily made library workspaces (cuBLAS) belong to resting memory, not to a segment
            training_step(model, inputs, loss_fn)
            original.restore()
        loop.steady(model, inputs, loss_fn)  # NOTE [The step a loop repeats]: every step starts from here
        # a second snapshot only if steady changed the model
        state = original if loop == NO_LOOP else capture(model, "remat.profile", parameters=changes_parameters)
        traced: dict[str, list[Segment]] = {}
        io_bytes: dict[str, tuple[int, int]] = {}
        resting: dict[str, int] = {}
        crossings: dict[str, Ledger] = {}
        for policy, run_as, learn in trace_schedule(policies):
            switch.set(run_as)
            if learn:
                with phases.timing("learning"):
                    learn_structure(model, inputs, loss_fn)
                state.restore()
            with phases.timing("traced"):
                traced[policy], io, resting[policy], crossings[policy] = traced_step(
                    model, inputs, loss_fn, names, loop=loop
                )
            if policy == KEEP:
                switch.only_called(traced[KEEP])
            io_bytes = io_bytes or io
            state.restore()
        traced = {p: traced[p] for p in policies}
        _check_same_structure(traced)
        seconds: dict[str, dict[Key, list[float]]] = {p: defaultdict(list) for p in policies}
        recompute: dict[str, dict[Key, list[float]]] = {p: defaultdict(list) for p in policies}
        keep_steps: list[float] = []  # whole-step times without checkpointing: the profile's step time
        # NOTE [The traced step is the first warm-up]: it runs every op of its policy once (lazy
        # initialisation, allocator growth, kernel caches), so only warmup - 1 more rounds are untimed.
        untimed = max(warmup - 1, 0)
        for i in range(untimed + repeat):
            for policy in policies:  # interleaved, so drift hits every policy alike
                switch.set(policy)
                with phases.timing("warm-up" if i < untimed else "timed"):
                    segs = _timed_segments(model, inputs, loss_fn, names, loop)
                state.restore()
                if i >= untimed:
                    if policy == KEEP:
                        keep_steps.append(sum(s.seconds for s in segs))
                    for s in segs:
                        seconds[policy][s.key].append(s.seconds)
                        recompute[policy][s.key].append(s.recompute_s)
        phases.log(statistics.median(keep_steps))
        extra = resting[KEEP] - storage_bytes(resting_tensors(model, inputs, loop)) if cuda else 0
        return assemble(
            model,
            inputs,
            names,
            policies,
            traced,
            io_bytes,
            seconds,
            keep_steps,
            recompute=recompute,
            extra_resting=extra,
            crossings=crossings,
            loop=loop,
        )


def validate_policies(policies: Sequence[str]) -> tuple[str, ...]:
    policies = tuple(dict.fromkeys([KEEP, *policies]))
    known = NAMES
    bad = [p for p in policies if p not in known]
    if bad:
        raise RematError(f"remat.profile: unknown policies {bad}; choose from {list(known)}.")
    return policies

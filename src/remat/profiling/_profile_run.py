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
from remat.core._loop import NO_LOOP, Loop, OptimizerSnapshot, optimizer_state
from remat.core._memtrack import CudaAllocator, StorageTracker, storage_bytes, tensor_bytes
from remat.core._policy_registry import FULL, KEEP, NAMES, SELECTIVE, SELECTIVE_OPS
from remat.core._state import capture, restoring
from remat.core._step import InputGrads, LossFn, trainable_parameters, training_step
from remat.core._timing import clock_for, extra_time, forward_slowdown
from remat.core.checkpoint import forget_structure, wrap
from remat.core.measure import device_of, resting_tensors
from remat.errors import RematError
from remat.profiling._crossing import Crossing, Recompute, swap_excesses
from remat.profiling._schedule import Phases, learn_structure, trace_schedule, young_collections
from remat.profiling._segment import Segment
from remat.profiling._trace import OpCost, OpWorkspace, SegmentRecorder
from remat.profiling._types import BlockProfile, Key, Profile, SegmentCost

Ledger = tuple[dict[tuple, dict], dict[tuple, dict], dict[tuple, list], dict[str, set]]
"""What a traced step saw across blocks: crossing storages, block recomputations (by identity)."""

log = logging.getLogger("remat")


class _Policies:
    """Puts every block under one policy; restores the user's own forwards on exit."""

    def __init__(self, model: nn.Module, names: Sequence[str]) -> None:
        modules = dict(model.named_modules())
        self.blocks = [modules[n] for n in names]
        touched = self.blocks + [c for m in self.blocks for c in inner_layers(m)]  # full-fine wraps those too
        self.saved = [(m, m.__dict__.get("forward")) for m in touched]
        for m in self.blocks:  # NOTE [selective-ops traces selective's learning] in remat.profiling._schedule
            forget_structure(m)

    def set(self, policy: str) -> None:
        self.restore()
        for m in self.blocks:
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
) -> tuple[list[Segment], dict[str, tuple[int, int]], int, Ledger]:
    """Segments, block I/O bytes, the resting bytes, and the crossing storages and block recomputations
    (NOTE [Storages across blocks]) of one tracked step.

    On CUDA live and peak bytes come from the allocator and times from CUDA events
    (NOTE [Peaks as the allocator counts them], NOTE [Clocks]); resting bytes are then
    what the allocator held at the start (library workspaces included).
    """
    loop.start(model)
    with spent("garbage collections"):
        gc.collect()
    device = device_of(model, inputs)
    allocator = CudaAllocator(device) if device.type == "cuda" else None
    tracker = StorageTracker(known=resting_tensors(model, inputs, loop))
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
    resting = allocator.base if allocator is not None else storage_bytes(resting_tensors(model, inputs, loop))
    return (
        recorder.segments,
        recorder.io_bytes,
        resting,
        (recorder.ledger.crossings, recorder.recomputes, recorder.trajectories, recorder.ledger.output_reads),
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


def _modelled_extra_time(fwd_s: float, fwd_segments: list[Segment]) -> dict[str, float]:
    """Fake profiles: recomputing the forward, or the ops selective does not keep, at the target's speed."""
    op_s = sum(s.op_s for s in fwd_segments)
    kept = sum(s.save_op_s for s in fwd_segments) / op_s if op_s > 0 else 0.0
    # Both selective policies recompute the same ops here: the host time per op that sets them apart
    # (NOTE in remat.core._by_module) is not modelled for a target.
    return {KEEP: 0.0, SELECTIVE: fwd_s * (1.0 - kept), SELECTIVE_OPS: fwd_s * (1.0 - kept), FULL: fwd_s}


def _fine_recompute_share(flops: dict[str, dict[Key, int]], bwd_keys: list[Key]) -> float:
    """Fake profiles: ``full-fine``'s recompute FLOPs over ``full``'s (its time: the block's forward times that)."""
    extra = {p: sum(flops[p][k] - flops[KEEP][k] for k in bwd_keys) for p in (FULL, FINE) if p in flops}
    return extra[FINE] / extra[FULL] if extra.get(FULL, 0) > 0 else 2.0  # at most two forwards


def _block_profiles(
    names: Sequence[str],
    segments: dict[str, dict[Key, SegmentCost]],
    traced: dict[str, list[Segment]],
    io_bytes: dict[str, tuple[int, int]],
    policies: Sequence[str],
    recompute: dict[str, dict[Key, list[float]]] | None,
) -> tuple[BlockProfile, ...]:
    """Per block; ``recompute`` holds measured recompute seconds (None on fake tensors)."""
    out = []
    keep_segments = {s.key: s for s in traced[KEEP]}
    flops = {p: {s.key: s.flops for s in traced[p]} for p in policies}
    if recompute is not None:  # see NOTE [The time model] in remat.core._timing
        block_fwd = [k for k in segments[KEEP] if k[0] == "fwd" and k[1] is not None]
        slowdown = forward_slowdown(
            {p: sum(segments[p][k].seconds for k in block_fwd if k in segments[p]) for p in policies}
        )
    for name in names:
        fwd_keys = [k for k in segments[KEEP] if k[0] == "fwd" and k[1] == name]
        if not fwd_keys:
            continue  # never called in this step
        bwd_keys = [k for k in segments[KEEP] if k[0] == "bwd" and k[1] == name]

        def total(policy: str, keys: list[Key], attr: str) -> float:
            return sum(getattr(segments[policy][k], attr) for k in keys)

        inp, outp = io_bytes.get(name, (0, 0))
        fwd_s = total(KEEP, fwd_keys, "seconds")
        if recompute is None:
            extra = _modelled_extra_time(fwd_s, [keep_segments[k] for k in fwd_keys])
            if FINE in policies:
                extra[FINE] = fwd_s * _fine_recompute_share(flops, bwd_keys)
        else:
            measured = {
                p: sum(statistics.median(recompute[p][k]) for k in bwd_keys if recompute[p].get(k)) for p in policies
            }
            extra = {p: extra_time(p, recompute_s=measured[p], fwd_s=fwd_s, slowdown=slowdown[p]) for p in policies}
        out.append(
            BlockProfile(
                name=name,
                input_bytes=inp,
                output_bytes=outp,
                saved_bytes={p: int(total(p, fwd_keys, "delta")) - outp * len(fwd_keys) for p in policies},
                fwd_time_s=fwd_s,
                bwd_time_s=total(KEEP, bwd_keys, "seconds"),
                extra_time_s={p: extra[p] for p in policies},
                fwd_flops=sum(flops[KEEP][k] for k in fwd_keys),
                bwd_flops={p: sum(flops[p][k] for k in bwd_keys) for p in policies},
                calls=len(fwd_keys),
                writes_input=any(keep_segments[k].writes_input for k in fwd_keys),
            )
        )
    return tuple(out)


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
        return _assemble(
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


def _assemble(
    model: nn.Module,
    inputs: Any,
    names: Sequence[str],
    policies: Sequence[str],
    traced: dict[str, list[Segment]],
    io_bytes: dict[str, tuple[int, int]],
    seconds: dict[str, dict[Key, list[float]]],
    keep_steps: list[float],
    *,
    recompute: dict[str, dict[Key, list[float]]] | None = None,
    fake: bool = False,
    target: str | None = None,
    device: str | None = None,
    crossings: dict[str, Ledger] | None = None,
    extra_resting: int = 0,
    notes: Sequence[str] = (),
    loop: Loop = NO_LOOP,
    loop_bytes: tuple[int, int] | None = None,
) -> Profile:
    """``loop_bytes``: (bytes the loop keeps alive, of which the optimizer's state), when the model no longer
    holds them (a fake run's); else read from the model and ``loop`` now."""
    if loop_bytes is None:
        loop_bytes = storage_bytes(loop.resident(model)), storage_bytes(optimizer_state(loop.optimizer))
    if loop.describe():
        notes = [
            *notes,
            f"the step includes {loop.describe()}: resting bytes include "
            f"{loop_bytes[0] / 2**20:.1f} MiB the loop keeps alive (NOTE [The step a loop repeats]).",
        ]

    def seconds_of(policy: str, seg: Segment) -> float:
        if fake:
            return seg.op_s
        return statistics.median(seconds[policy][seg.key]) if seconds[policy].get(seg.key) else 0.0

    segments = {
        p: {
            s.key: SegmentCost(s.delta, s.excess, seconds_of(p, s), s.cast_cache, s.cast_release, s.excess_released)
            for s in traced[p]
        }
        for p in policies
    }
    keep = traced[KEEP]
    params = list(model.parameters())
    blocks = _block_profiles(names, segments, traced, io_bytes, policies, None if fake else recompute)
    writers = [b.name for b in blocks if b.writes_input]
    if writers:
        notes = [
            *notes,
            f"blocks {', '.join(writers[:4])}{' ...' if len(writers) > 4 else ''} write their input in "
            "place: nested plans leave them and the blocks before them out of segments (NOTE [Inputs "
            "written in place inside a segment] in remat.planning._nested).",
        ]
    step_time = sum(s.op_s for s in keep) if fake else statistics.median(keep_steps)
    return Profile(
        model=type(model).__name__,
        device=device or str(next((p.device for p in params), "cpu")),
        blocks=blocks,
        resting_bytes=storage_bytes(resting_tensors(model, inputs)) + loop_bytes[0] + extra_resting,
        param_bytes=storage_bytes(params),
        grad_bytes=sum(tensor_bytes(p) for p in trainable_parameters(model).values()),
        step_time_s=step_time,
        policies=tuple(policies),
        fwd_order=[s.key for s in keep if s.phase == "fwd"],
        bwd_order=[s.key for s in keep if s.phase == "bwd"],
        segments=segments,
        crossings=_crossings({p: ledger[0] for p, ledger in (crossings or {}).items()}),
        recomputes=_recomputes(
            {p: ledger[1] for p, ledger in (crossings or {}).items()},
            {p: ledger[2] for p, ledger in (crossings or {}).items() if len(ledger) > 2},
        ),
        unchained=_unchained((crossings or {}).get(KEEP), [s.block for s in keep if s.phase == "fwd" and s.block]),
        fake=fake,
        target=target,
        notes=list(notes),
        optimizer=None if loop.optimizer is None else type(loop.optimizer).__name__,
        optimizer_bytes=loop_bytes[1],
        accumulation_steps=loop.accumulation_steps,
    )


def _unchained(ledger: Ledger | None, fwd_blocks: list[str]) -> tuple[str, ...]:
    """Blocks whose output some forward op reads outside the next block (NOTE [What the parent does with a
    block's output] in remat.planning._nested), from the run without checkpointing."""
    if ledger is None or len(ledger) < 4:
        return ()
    reads = ledger[3]
    following = dict(zip(fwd_blocks, fwd_blocks[1:]))
    return tuple(b for b in dict.fromkeys(fwd_blocks) if reads.get(b, set()) - {following.get(b)})


def _crossings(per_policy: dict[str, dict[tuple, dict]]) -> list[Crossing]:
    """One :class:`Crossing` per storage seen in every policy's run (matched by first sighting)."""
    if KEEP not in per_policy:
        return []
    out = []
    for ident, record in per_policy[KEEP].items():
        if all(ident in runs for runs in per_policy.values()) and not _stays_home(ident, per_policy):
            out.append(
                Crossing(
                    nbytes=record["nbytes"],
                    producer=record["producer"],
                    receivers=tuple(record["receivers"]),
                    freed={p: runs[ident]["freed"] for p, runs in per_policy.items()},
                    after={p: runs[ident]["after"] for p, runs in per_policy.items()},
                )
            )
    return out


def _stays_home(ident: tuple, per_policy: dict[str, dict[tuple, dict]]) -> bool:
    """A storage a block made that every run frees in that block's own segments (or never): nothing moves."""
    if ident[2] != "made":
        return False
    home = {("fwd", ident[0], ident[1]), ("bwd", ident[0], ident[1]), None}
    return all(runs[ident]["freed"] in home for runs in per_policy.values())


def _recomputes(
    per_policy: dict[str, dict[tuple, dict]],
    trajectories: dict[str, dict[tuple, list]],
) -> list[Recompute]:
    """One :class:`Recompute` per (block, k-th recomputation) seen in any policy's run."""
    idents = dict.fromkeys(i for runs in per_policy.values() for i in runs)
    if set(trajectories) != set(per_policy):
        trajectories = {}
    crowded = _crowded(per_policy)
    out = []
    for block, k in idents:
        ran = {p: runs[(block, k)] for p, runs in per_policy.items() if (block, k) in runs}
        out.append(
            Recompute(
                block=block,
                index=k,
                at={p: r["segment"] for p, r in ran.items()},
                delta={p: r["delta"] for p, r in ran.items()},
                excess={p: r["excess"] for p, r in ran.items()},
                freed_after={p: sum(nb for _, _, nb in r["frees"]) for p, r in ran.items()},
                swap=swap_excesses(block, ran, trajectories, crowded) if trajectories else {},
            )
        )
    return out


def _crowded(per_policy: dict[str, dict[tuple, dict]]) -> set:
    """Segments in which some run made two or more recomputations other than of the segment's own block
    (two blocks, or one block called twice): their swap tables would not compose."""
    hosted: dict[tuple, set] = defaultdict(set)
    for runs in per_policy.values():
        for (block, k), r in runs.items():
            if r["segment"][1] != block:
                hosted[tuple(r["segment"])].add((block, k))
    return {key for key, recomputations in hosted.items() if len(recomputations) > 1}


def validate_policies(policies: Sequence[str]) -> tuple[str, ...]:
    policies = tuple(dict.fromkeys([KEEP, *policies]))
    known = NAMES
    bad = [p for p in policies if p not in known]
    if bad:
        raise RematError(f"remat.profile: unknown policies {bad}; choose from {list(known)}.")
    return policies

"""A profile put together from the traced and timed steps' segments: per-segment costs, block profiles,
and the storages and recomputations that cross blocks."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from remat.core._fine import FINE
from remat.core._loop import NO_LOOP, Loop, optimizer_state
from remat.core._memtrack import BlockBytes, grad_bytes, storage_bytes
from remat.core._policy_registry import FULL, KEEP, SELECTIVE, SELECTIVE_OPS
from remat.core._step import trainable_parameters
from remat.core._timing import extra_time, forward_slowdown
from remat.core.measure import resting_tensors
from remat.profiling._blocks import is_single_op_layer
from remat.profiling._crossing import Crossing, Recompute, swap_excesses
from remat.profiling._segment import Segment
from remat.profiling._types import BlockProfile, Key, Profile, SegmentCost


@dataclass(frozen=True)
class Ledger:
    """What one traced step saw across blocks (its ``CrossingLedger`` and recorder, as they ended)."""

    crossings: dict[tuple, dict]
    """Storages blocks received from outside them, by identity (NOTE [Storages across blocks])."""
    recomputes: dict[tuple, dict]
    """Where each block's recomputation ran, and what it added to live bytes."""
    trajectories: dict[tuple, list]
    """Per recomputation, live bytes after each allocation it made."""
    output_reads: dict[str, set]
    """Per block, the blocks (or None: the parent) whose forward read its output."""
    call_forms: dict[str, tuple]
    """Per block, how it was called: argument count, keywords, non-tensor values by identity."""


def assemble(
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
    block_bytes: BlockBytes | None = None,
) -> Profile:
    """``loop_bytes``: (bytes the loop keeps alive, of which the optimizer's state), when the model no longer
    holds them (a fake run's); else read from the model and ``loop`` now. ``block_bytes``: what a fake
    profile's CUDA target counts for the resting storages (NOTE [Blocks the caching allocator hands out])."""
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
    modules = dict(model.named_modules())
    single_op = {n for n in names if is_single_op_layer(modules.get(n))}
    blocks = _block_profiles(names, segments, traced, io_bytes, policies, None if fake else recompute, single_op)
    writers = [b.name for b in blocks if b.writes_input]
    if writers:
        notes = [
            *notes,
            f"blocks {', '.join(writers[:4])}{' ...' if len(writers) > 4 else ''} write their input in "
            "place: nested segments neither begin nor end at them, nor end before them, and hold them and "
            "the blocks before them under keep (NOTE [Inputs written in place inside a segment] in "
            "remat.planning._nested).",
        ]
    step_time = sum(s.op_s for s in keep) if fake else statistics.median(keep_steps)
    forward_blocks = [s.block for s in keep if s.phase == "fwd" and s.block]
    return Profile(
        model=type(model).__name__,
        device=device or str(next((p.device for p in params), "cpu")),
        blocks=blocks,
        resting_bytes=storage_bytes(resting_tensors(model, inputs), block_bytes) + loop_bytes[0] + extra_resting,
        param_bytes=storage_bytes(params, block_bytes),
        grad_bytes=grad_bytes(trainable_parameters(model).values(), block_bytes),
        step_time_s=step_time,
        policies=tuple(policies),
        fwd_order=[s.key for s in keep if s.phase == "fwd"],
        bwd_order=[s.key for s in keep if s.phase == "bwd"],
        segments=segments,
        crossings=_crossings({p: ledger.crossings for p, ledger in (crossings or {}).items()}),
        recomputes=_recomputes(
            {p: ledger.recomputes for p, ledger in (crossings or {}).items()},
            {p: ledger.trajectories for p, ledger in (crossings or {}).items()},
        ),
        unchained=_unchained((crossings or {}).get(KEEP), forward_blocks),
        new_arguments=_new_arguments((crossings or {}).get(KEEP), forward_blocks),
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
    if ledger is None:
        return ()
    reads = ledger.output_reads
    following = dict(zip(fwd_blocks, fwd_blocks[1:]))
    return tuple(b for b in dict.fromkeys(fwd_blocks) if reads.get(b, set()) - {following.get(b)})


def _new_arguments(ledger: Ledger | None, fwd_blocks: list[str]) -> tuple[str, ...]:
    """Blocks whose arguments other than tensors differ from those of the block called before them (NOTE [Arguments a
    segment hands on] in remat.planning._nested), from the run without checkpointing."""
    if ledger is None:
        return ()
    forms = ledger.call_forms
    order = list(dict.fromkeys(b for b in fwd_blocks if b in forms))
    return tuple(b for a, b in zip(order, order[1:]) if forms[a] != forms[b])


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
                before={p: r["before"] for p, r in ran.items()},
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


def _modelled_extra_time(
    fwd_s: float, fwd_segments: list[Segment], bwd_segments: dict[str, list[Segment]]
) -> dict[str, float]:
    """Fake profiles: recomputing the forward, or the ops selective does not keep, at the target's speed.

    A selective policy also recomputes the outputs it would keep that a later forward op writes in place (NOTE
    [Cached outputs written in place] in remat.core._contexts): its backward runs more of the kept ops
    (``SAVE_OPS``) than keep's does, and those run again at their forward time.
    """
    op_s = sum(s.op_s for s in fwd_segments)
    kept = sum(s.save_op_s for s in fwd_segments) / op_s if op_s > 0 else 0.0
    scale = fwd_s / op_s if op_s > 0 else 0.0  # op time to the forward's modelled seconds

    def written_again(policy: str) -> float:
        if policy not in bwd_segments:
            return 0.0
        more = sum(s.save_op_s for s in bwd_segments[policy]) - sum(s.save_op_s for s in bwd_segments[KEEP])
        return max(more, 0.0) * scale

    # Both selective policies recompute the same ops otherwise: the host time per op that sets them apart
    # (NOTE in remat.core._by_module) is not modelled for a target.
    return {
        KEEP: 0.0,
        SELECTIVE: fwd_s * (1.0 - kept) + written_again(SELECTIVE),
        SELECTIVE_OPS: fwd_s * (1.0 - kept) + written_again(SELECTIVE_OPS),
        FULL: fwd_s,
    }


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
    single_op: set[str],
) -> tuple[BlockProfile, ...]:
    """Per block; ``recompute`` holds measured recompute seconds (None on fake tensors); ``single_op``: the blocks
    that are lone single-op torch layers."""
    out = []
    by_key = {p: {s.key: s for s in traced[p]} for p in policies}
    keep_segments = by_key[KEEP]
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
            bwd = {p: [by_key[p][k] for k in bwd_keys if k in by_key[p]] for p in policies}
            extra = _modelled_extra_time(fwd_s, [keep_segments[k] for k in fwd_keys], bwd)
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
                buffer_copies={
                    p: sum(by_key[p][k].buffer_copies for k in fwd_keys if k in by_key[p]) for p in policies
                },
                buffer_snapshots=sum(keep_segments[k].buffer_snapshots for k in fwd_keys),
                views_input=any(keep_segments[k].views_input for k in fwd_keys),
                without_grad=all(keep_segments[k].without_grad for k in fwd_keys),
                single_op=name in single_op,
            )
        )
    return tuple(out)

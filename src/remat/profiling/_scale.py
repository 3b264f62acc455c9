"""A profile for another batch size, from two real profiles of the same model.

NOTE [Profiles across batch sizes]
Profiling the model again at every batch size the max-batch search tries would cost
three traced and several timed steps each. Every activation, gradient of an
activation and input scales with the batch, parameters and their gradients do not,
so each byte count of a profile (a segment's delta, the live bytes at a crossing
storage's free, a block's input and output) is affine in the batch where the shapes
allow; times are too, roughly. Two real profiles at batches ``b1 < b2`` give every
figure at any other batch. A segment's *excess* is a maximum over its ops, which is
convex in the batch, not affine, so the scaled profile can be off where the op that
sets it changes: callers use it to choose a plan and then measure that plan on real
tensors (``remat.bench.max_batch`` does), never to decide that a plan fits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from remat.errors import RematError
from remat.profiling._types import BlockProfile, Profile, SegmentCost


def _same_shape(p1: Profile, p2: Profile) -> bool:
    return (
        p1.fwd_order == p2.fwd_order
        and p1.bwd_order == p2.bwd_order
        and p1.policies == p2.policies
        and [b.name for b in p1.blocks] == [b.name for b in p2.blocks]
        and len(p1.crossings) == len(p2.crossings)
        and len(p1.recomputes) == len(p2.recomputes)
        and all(set(s1) == set(p2.segments[p]) for p, s1 in p1.segments.items())
    )


def profile_at_batch(p1: Profile, b1: int, p2: Profile, b2: int, batch: int) -> Profile:
    """``p1`` (at batch ``b1``) and ``p2`` (at ``b2``) carried to ``batch`` (NOTE above)."""
    if b1 == b2 or not _same_shape(p1, p2):
        raise RematError(
            f"remat.profile: cannot scale profiles of batches {b1} and {b2} to {batch}: they need two different "
            "batch sizes of the same model with the same blocks and segments; profile at that batch instead."
        )
    t = (batch - b1) / (b2 - b1)

    def at(x1: float, x2: float) -> float:
        return x1 + (x2 - x1) * t

    def nbytes(x1: int, x2: int) -> int:
        return max(0, round(at(x1, x2))) if x1 >= 0 and x2 >= 0 else round(at(x1, x2))

    def per_policy(d1: dict, d2: dict, f: Callable[[Any, Any], Any] = nbytes) -> dict:
        return {k: f(v, d2[k]) for k, v in d1.items() if k in d2}

    segments = {
        p: {
            k: SegmentCost(
                nbytes(c.delta, p2.segments[p][k].delta),
                nbytes(c.excess, p2.segments[p][k].excess),
                max(0.0, at(c.seconds, p2.segments[p][k].seconds)),
            )
            for k, c in segs.items()
        }
        for p, segs in p1.segments.items()
    }
    blocks = tuple(
        BlockProfile(
            name=a.name,
            input_bytes=nbytes(a.input_bytes, b.input_bytes),
            output_bytes=nbytes(a.output_bytes, b.output_bytes),
            saved_bytes=per_policy(a.saved_bytes, b.saved_bytes),
            fwd_time_s=max(0.0, at(a.fwd_time_s, b.fwd_time_s)),
            bwd_time_s=max(0.0, at(a.bwd_time_s, b.bwd_time_s)),
            extra_time_s=per_policy(a.extra_time_s, b.extra_time_s, lambda x, y: max(0.0, at(x, y))),
            fwd_flops=nbytes(a.fwd_flops, b.fwd_flops),
            bwd_flops=per_policy(a.bwd_flops, b.bwd_flops),
            calls=a.calls,
            writes_input=a.writes_input or b.writes_input,
            buffer_copies=per_policy(a.buffer_copies, b.buffer_copies),
            buffer_snapshots=max(a.buffer_snapshots, b.buffer_snapshots),
            views_input=a.views_input,
            without_grad=a.without_grad and b.without_grad,
            single_op=a.single_op,
        )
        for a, b in zip(p1.blocks, p2.blocks)
    )
    crossings = [
        replace(c, nbytes=nbytes(c.nbytes, d.nbytes), after=per_policy(c.after, d.after))
        for c, d in zip(p1.crossings, p2.crossings)
    ]
    recomputes = [
        replace(
            r,
            delta=per_policy(r.delta, s.delta),
            excess=per_policy(r.excess, s.excess),
            freed_after=per_policy(r.freed_after, s.freed_after),
            swap=_scaled_swap(r.swap, s.swap, nbytes),
            before=per_policy(r.before, s.before),
        )
        for r, s in zip(p1.recomputes, p2.recomputes)
    ]
    return replace(
        p1,
        blocks=blocks,
        segments=segments,
        crossings=crossings,
        recomputes=recomputes,
        resting_bytes=nbytes(p1.resting_bytes, p2.resting_bytes),
        step_time_s=max(0.0, at(p1.step_time_s, p2.step_time_s)),
        notes=[*p1.notes, f"scaled to batch {batch} from profiles at batches {b1} and {b2}"],
    )


def _scaled_swap(a: dict, b: dict, nbytes: Any) -> dict:
    """A recomputation's swap table carried like every byte count; dropped (the safe charge) unless both match."""
    if not a or {q: set(row) for q, row in a.items()} != {q: set(row) for q, row in b.items()}:
        return {}
    return {q: {m: nbytes(v, b[q][m]) for m, v in row.items()} for q, row in a.items()}

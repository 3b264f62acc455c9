"""Generators of a call's own (``torch.randn(..., generator=g)``), replayed in its recomputation.

NOTE [A generator of the call's own]
torch's checkpoint replays the default generators (``preserve_rng_state``): it sets their
states back to the forward's when a recomputation begins. A ``torch.Generator`` the model
keeps and hands to its ops (a block drawing its masks from ``self.gen``, a sampler seeded
for reproducibility) is none of them: the recomputation drew the next numbers from it, so
the gradients were of masks the forward never drew, and the generator was left advanced
by the recomputation's draws (every policy; torch's checkpoint alike). A call's first
forward watches its ops (NOTE [Watching only when needed] in ``remat.core._region``) and
notes the state of each such generator at its first draw, which is the state the call
began with; the callable remembers the generator, and its later calls note its state as
they begin. It holds the object the dispatcher handed its ops, not a weak reference: that
is a wrapper of its own, which torch hands out again only while something holds it. A
recomputation sets each one to the noted state, and after it back to the state it found,
so the stream goes on as if nothing had been recomputed. A generator first drawn from by a
later call than the first is not watched (as a buffer first written by a later call: NOTE
[Watching only when needed]); one made inside the forward is made again by the
recomputation and needs nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["OwnGenerators"]


def _default(gen: torch.Generator) -> bool:
    """One of torch's default generators, which torch's checkpoint replays itself."""
    if gen is torch.default_generator:
        return True
    return torch.cuda.is_initialized() and any(gen is g for g in torch.cuda.default_generators)


class OwnGenerators:
    """The generators of a call's own and their states as the call began (NOTE [A generator of the call's own])."""

    __slots__ = ("states",)

    def __init__(self, known: tuple[torch.Generator, ...] = ()) -> None:
        self.states: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
        for gen in known:
            self.note(gen)

    def note(self, gen: Any) -> None:
        """Keep ``gen``'s state, if this call has not yet (its state before the call's first draw from it)."""
        if isinstance(gen, torch.Generator) and id(gen) not in self.states and not _default(gen):
            self.states[id(gen)] = (gen, gen.get_state())

    def known(self) -> tuple[torch.Generator, ...]:
        """The generators: what the callable remembers of its first call."""
        return tuple(gen for gen, _ in self.states.values())

    @contextlib.contextmanager
    def as_called(self) -> Iterator[None]:
        """Each generator at its state as the call began while recomputing; after it, at the state it was found."""
        found = [(gen, gen.get_state()) for gen, _ in self.states.values()]
        for gen, state in self.states.values():
            gen.set_state(state)
        try:
            yield
        finally:
            for gen, state in found:
                gen.set_state(state)

"""What the first forward of a checkpointed callable wrote, for its later calls (``remat.core._region``)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

__all__ = ["Learned"]


@dataclass(frozen=True)
class Learned:
    """What the first forward of a checkpointed callable wrote (NOTE [Watching only when needed])."""

    writes_inputs: bool
    """It wrote in place to one of its inputs: keep watching every op."""
    written_buffers: frozenset[tuple[int, str]]
    """(id(module), name) of the buffers, and parameters (NOTE [Parameters a forward writes] in remat.core._region),
    it wrote."""
    buffer_modules: tuple[weakref.ref, ...] = ()
    """The modules with buffers it entered, and those under the checkpointed module: watched from the start."""
    generators: tuple[torch.Generator, ...] = ()
    """Generators of its own it drew from (NOTE [A generator of the call's own] in remat.core._generators)."""

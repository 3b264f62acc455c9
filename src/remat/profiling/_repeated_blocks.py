"""Identical module blocks on fake tensors: a short stack profiled, the profile widened to all of them.

NOTE [Identical blocks are profiled once]
A fake profile costs per op (FakeTensorMode's dispatch, about 75 us an op), and it traces one
whole step per policy, so on a 16-layer Llama it is most of ``remat.auto``'s time, yet every
middle layer costs what the others do. When the blocks are all the children of one
``ModuleList`` or ``Sequential``, at least ``MIDDLE + 3`` of them, and alike (same classes,
parameter and buffer shapes, dtypes and flags, the same plain attributes but for a layer index,
the same hooks), a fake profile runs a short stack instead: the container holds the first
``MIDDLE + 1`` blocks and the last while the profile runs, and the profile is widened to the
whole stack as a traced chain is (NOTE [Identical segments are profiled once] in
``remat.profiling._traced_repeat``); a storage the parent hands to every block (a mask, rotary
tables) is handed to every block of the widened profile. The parameters the short stack left out
are added to the resting, parameter and gradient bytes. The short stack is used only where

* it is a fake profile with neither an optimizer nor gradient accumulation (their state is made
  on the parameters the step sees), and no parameter is shared between blocks;
* its middle blocks cost the same in every policy (a layer type chosen by index shows there);
* the widening places every record (else, or if the short forward fails, the whole model is
  profiled, as before).

Real profiles measure every block: they are only run where the step fits, and are then cheap.
A plan is verified on the whole model (NOTE [Verify when it can] in ``remat.planning._verify``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace

from torch import nn

from remat.core._loop import Loop
from remat.core._memtrack import grad_bytes, storage_bytes
from remat.core._state import uninterrupted
from remat.profiling._traced_repeat import MIDDLE, widen
from remat.profiling._types import Profile
from remat.profiling.targets import block_bytes_of

__all__ = ["short_stack", "widened"]

#: Attributes that number a block and change neither its memory nor its time.
_INDEX_NAMES = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number", "block_idx", "idx", "index"})
_PLAIN = (bool, int, float, str, type(None))


def _signature(block: nn.Module) -> tuple:
    """What a block is, its layer index aside: two blocks with one signature run the same ops on the same shapes."""
    out = []
    for name, m in block.named_modules():
        attrs = tuple(
            sorted(
                (k, v)
                for k, v in vars(m).items()
                if not k.startswith("_") and k not in _INDEX_NAMES and isinstance(v, _PLAIN)
            )
        )
        hooks = tuple(len(h) for h in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks))
        tensors = tuple(
            (k, None if t is None else (tuple(t.shape), t.dtype, t.requires_grad, t.device.type))
            for store in (m._parameters, m._buffers)
            for k, t in store.items()
        )
        out.append((name, type(m), m.training, "forward" in vars(m), attrs, hooks, tensors))
    return tuple(out)


def _container(model: nn.Module, names: list[str], prefix: str) -> nn.Module | None:
    """The ModuleList or Sequential under ``prefix`` whose children, in order, are exactly the blocks ``names``."""
    keys = [str(k) for k in range(len(names))]
    if names != [f"{prefix}.{k}" if prefix else k for k in keys]:
        return None
    container = model.get_submodule(prefix) if prefix else model
    if not isinstance(container, (nn.ModuleList, nn.Sequential)) or list(container._modules) != keys:
        return None
    return container


def _alike(blocks: list[nn.Module]) -> bool:
    first = _signature(blocks[0])
    if any(_signature(b) != first for b in blocks[1:]):
        return False
    ids = [id(p) for b in blocks for _, p in b.named_parameters(remove_duplicate=False)]
    return len(ids) == len(set(ids))


@contextlib.contextmanager
def short_stack(model: nn.Module, names: list[str], loop: Loop) -> Iterator[tuple[list[str], list[nn.Module]] | None]:
    """(the blocks of a short stack, the blocks it leaves out) while the container holds only the former; None:
    profile the whole model."""
    prefix = names[0].rpartition(".")[0]
    plain_step = loop.optimizer is None and loop.accumulation_steps == 1
    container = _container(model, names, prefix) if len(names) >= MIDDLE + 3 and plain_step else None
    blocks = [] if container is None else [b for b in container._modules.values() if b is not None]
    if container is None or len(blocks) != len(names) or not _alike(blocks):
        yield None
        return
    kept = [*blocks[: MIDDLE + 1], blocks[-1]]
    original = container._modules
    with uninterrupted():
        container._modules = {str(k): b for k, b in enumerate(kept)}
    try:
        yield [f"{prefix}.{k}" if prefix else str(k) for k in range(len(kept))], blocks[MIDDLE + 1 : -1]
    finally:
        with uninterrupted():
            container._modules = original


def _middles_alike(prof: Profile) -> bool:
    middles = [replace(b, name="") for b in prof.blocks[1 : MIDDLE + 1]]
    return all(b == middles[0] for b in middles[1:])


def widened(prof: Profile, short: list[str], full: list[str], left_out: list[nn.Module]) -> Profile | None:
    """The short stack's profile as the whole model's, with the left-out blocks' parameters counted (None: it
    cannot be widened, and the whole model is profiled)."""
    if not _middles_alike(prof):
        return None
    wide = widen(prof, short, full)
    if wide is None:
        return None
    params = [p for b in left_out for p in b.parameters()]
    buffers = [t for b in left_out for t in b.buffers()]
    note = (
        f"The {len(full)} blocks are alike: profiled on a stack of {len(short)} (the first {len(short) - 1} and the "
        "last), the others take a middle one's costs (NOTE [Identical blocks are profiled once])."
    )
    blocks = block_bytes_of(prof.target) if prof.fake else None
    return replace(
        wide,
        resting_bytes=wide.resting_bytes + storage_bytes([*params, *buffers], blocks),
        param_bytes=wide.param_bytes + storage_bytes(params, blocks),
        grad_bytes=wide.grad_bytes + grad_bytes([p for p in params if p.requires_grad], blocks),
        notes=[*prof.notes, note],
    )

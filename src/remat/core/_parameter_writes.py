"""Parameters a step remat runs writes outside autograd, kept to be put back (``remat.core._state``).

NOTE [A step that writes parameters]
A snapshot for a step without an optimizer leaves the parameters' values out (NOTE
[Snapshots a step without an optimizer needs] in ``remat.core._state``): a training step
does not change them. A forward may all the same: a vector quantiser re-initialises its dead
codes through ``.data``, an EMA codebook moves under ``no_grad``, MoCo's momentum encoder is
assigned ``param.data = m * param.data + ...`` in its forward. remat's own steps (profiles,
verification) then left the model changed, and auto's steps, each starting from what the last
one wrote, differed from one another and refused a plan that was right. So such a snapshot
watches the parameters: it holds each one's ``.data`` (no copy; an assignment to ``.data``
is put back from it), and the storage tracker that counts every profiled or measured step
on the CPU, and every profiled one on CUDA, hands it each in-place write before the op runs
(``note_writes``), which copies that parameter to the CPU once, to be copied back. On CUDA a
verification step is counted by the allocator, with no tracker: a write in place there is
not seen (an assignment to ``.data`` is).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from remat.core._writes import storage_key, written_tensors

__all__ = ["ParameterWrites", "note_writes"]

_ACTIVE: list[weakref.ref] = []
"""The watches of live snapshots (usually none or one): a snapshot may be restored after each of several steps,
so it watches until it is let go of."""


class ParameterWrites:
    """A model's parameters as a snapshot found them: their ``.data``, and copies made before a step wrote them."""

    def __init__(self, model: nn.Module) -> None:
        self.data: dict[str, torch.Tensor] = {}
        self._keys: dict[int, tuple[str, torch.Tensor]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            if is_traceable_wrapper_subclass(p):  # FSDP's shards: their storage is not theirs to watch
                continue
            self.data[name] = p.data
            self._keys.setdefault(storage_key(p), (name, p))
        self.before: dict[str, torch.Tensor] = {}
        """Per parameter written in place, its value before the first write (on the CPU)."""
        _ACTIVE[:] = [ref for ref in _ACTIVE if ref() is not None]
        _ACTIVE.append(weakref.ref(self))

    def _note(self, t: torch.Tensor) -> None:
        found = self._keys.get(storage_key(t))
        if found is not None and found[0] not in self.before:
            with torch.no_grad():
                self.before[found[0]] = found[1].detach().to("cpu", copy=True)

    def put_back(self, name: str, p: nn.Parameter) -> None:
        """``p`` as the snapshot found it: its ``.data`` if it was assigned anew, its values if written in place."""
        data = self.data.get(name)
        if data is not None and p.data is not data and storage_key(p) != storage_key(data):
            p.data = data
        before = self.before.get(name)
        if before is not None:
            with torch.no_grad():
                p.copy_(before)


def note_writes(func: Any, args: tuple, kwargs: dict) -> None:
    """Before ``func`` runs: copy each watched parameter it writes (NOTE [A step that writes parameters])."""
    if not _ACTIVE or not getattr(getattr(func, "_schema", None), "is_mutable", False):
        return
    written = list(written_tensors(func, args, kwargs))
    for ref in _ACTIVE:
        watch = ref()
        if watch is not None:
            for t in written:
                watch._note(t)

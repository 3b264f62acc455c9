"""Real values for the small tensors of a fake run, so data-dependent branches go the real way.

NOTE [Value shadows]
Fake tensors have shapes and no values, so ``bool(t)``, ``t.item()`` and
``torch.equal`` fail on them, and libraries that know it take another path under
fake tensors: transformers builds an explicit 4-D causal mask and materialises
repeated K/V heads when it cannot check that the position ids hold one unpadded
sequence each (``find_packed_sequence_indices``), where on a GPU it passes no mask,
``is_causal=True`` and ``enable_gqa=True`` (and SDPA picks another kernel).

The values such checks read are small and come from the inputs or from factory
ops (``arange`` position ids, ``ones`` masks; not ``empty``, whose values are
garbage). This mode, stacked above the
``FakeTensorMode``, keeps a real CPU twin (a shadow) of every tensor of at most
``limit`` elements that is computed only from inputs with shadows: the real input
tensors given to the profile, and factory ops. It recomputes each such op on the
twins with every mode off, and answers the data-dependent ops (``item``,
``equal``) from them. Weights are fake and have no values, so nothing computed
from them gets a shadow; random ops get none either. An op that writes a tensor
whose new value it cannot compute drops that tensor's shadow.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch._prims_common import suggest_memory_format
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_map

from remat.core._memtrack import op_tensors
from remat.core._rng import draws_random
from remat.core._writes import written_tensors
from remat.errors import RematError
from remat.profiling._kernel_layouts import RELAID, _input_of, kernel_output, laid_out
from remat.profiling._random_branches import Draws, where_in_the_model

aten = torch.ops.aten
_ANSWERED = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default}
_UNINITIALIZED = {
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.empty_like.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
}


_INERT: dict[Any, bool] = {}


class RandomBranch(RematError):
    """A fake forward read a random draw into Python, which no shadow answers (NOTE [Branches on random draws])."""

    def __init__(self, where: str) -> None:
        super().__init__(
            f"remat.profile(fake=True): the forward branches on a random draw at {where} (as LayerDrop does, "
            "`if torch.rand([]) < p`); a fake step cannot take that branch (a draw has no value), and a plan of one "
            "draw's path would not hold for a step that takes another. remat turns LayerDrop off while planning where "
            "its probability is an attribute named `layerdrop`; make this draw fixed while planning (its probability "
            "0, the path that runs every layer), or profile on real tensors."
        )
        self.where = where


def _inert(func: Any) -> bool:
    """An op this mode leaves as it is: it returns no tensor, writes none and reads no value (``prim.device``,
    which the autograd engine asks of every gradient: most of the ops a fake step dispatches)."""
    known = _INERT.get(func)
    if known is None:
        schema = getattr(func, "_schema", None)
        known = _INERT[func] = (
            schema is not None
            and func not in _ANSWERED
            and not schema.is_mutable
            and all("Tensor" not in str(r.type) and "Any" not in str(r.type) for r in schema.returns)
        )
    return known


class ValueShadows(TorchDispatchMode):
    """Real twins of small fake tensors (see NOTE [Value shadows])."""

    def __init__(self, limit: int = 1 << 20, *, layouts: bool = False, cuda: bool = False) -> None:
        """``layouts``: also lay out outputs as the device's kernels do (CUDA's with ``cuda``), as ``KernelLayouts``
        stacked above this mode would (NOTE [Output layouts of the device's kernels]), in this one dispatch layer."""
        super().__init__()
        self.limit = limit
        self.layouts = layouts
        self.cuda = cuda
        self._twins: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        self.draws = Draws()

    def seed(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        """Give ``fake`` the values of ``real`` (a real tensor of the same shape)."""
        if not real.is_meta and real.numel() <= self.limit:
            self._keep(fake, real.detach().clone())

    def twin(self, t: torch.Tensor) -> torch.Tensor | None:
        entry = self._twins.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def _keep(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        key = id(fake)

        def forget(_ref: weakref.ref) -> None:
            self._twins.pop(key, None)

        self._twins[key] = (weakref.ref(fake, forget), real)

    def _real(self, value: Any) -> tuple[bool, Any]:
        """(every tensor in ``value`` has a twin, ``value`` with the twins in place; None where some has none)."""
        # most ops see a weight, which has no twin: known without rebuilding the arguments
        if not all(self.twin(t) is not None for t in op_tensors(value)):  # NOTE [Op arguments without pytree]
            return False, None
        ok = True

        def swap(t: Any) -> Any:
            nonlocal ok
            if not isinstance(t, torch.Tensor):
                return t
            real = self.twin(t)
            ok = ok and real is not None
            return real

        swapped = tree_map(swap, value)
        return ok, swapped

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if _inert(func):  # no output to shadow, no twin to drop: what the rest would conclude, at a dict's cost
            return func(*args, **kwargs)
        ok, real = self._real((args, kwargs))
        real_args, real_kwargs = real if ok else (args, kwargs)
        if func in _ANSWERED and ok:
            with _disable_current_modes():
                return func(*real_args, **real_kwargs)
        if self.draws.reads_a_draw(func, args, kwargs):
            raise RandomBranch(where_in_the_model())
        try:
            out = kernel_output(func, args, kwargs, cuda=self.cuda) if self.layouts else func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException) as exc:  # where, for the message
            if not hasattr(exc, "where"):
                exc.where = where_in_the_model()  # type: ignore[union-attr]
            raise
        self.draws.note(func, args, kwargs, out)
        outs = op_tensors(out)
        device = kwargs.get("device")
        shadow = (
            ok
            and not draws_random(func)
            and func not in _UNINITIALIZED
            and outs
            and all(t.numel() <= self.limit for t in outs)
            and (device is None or torch.device(device).type == "cpu")
        )
        if shadow:
            with _disable_current_modes():
                real_out = func(*real_args, **real_kwargs)
            for fake, twin in zip(outs, op_tensors(real_out)):
                self._keep(fake, twin)
        elif getattr(getattr(func, "_schema", None), "is_mutable", False):
            for t in written_tensors(func, args, kwargs):
                self._twins.pop(id(t), None)
        if self.layouts and func in RELAID:
            return self._laid_out(func, args, kwargs, out)
        return out

    def _laid_out(self, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        """``laid_out``'s output, each output it replaced given its twin laid out alike: the ``clone`` (or the
        float32 copy) it stands for would run through this mode under a ``KernelLayouts`` above, which shadows it as
        any op, so its twin is that clone."""
        laid = laid_out(func, args, kwargs, out, cuda=self.cuda)
        if laid is out:
            return out
        pairs = zip(out, laid) if isinstance(out, tuple) else [(out, laid)]
        source = _input_of(func, args, kwargs)
        for i, (before, after) in enumerate(pairs):
            real = self.twin(before) if after is not before else None
            if real is None or after.numel() > self.limit:
                continue
            layout = suggest_memory_format(source) if i == 0 and source is not None else torch.contiguous_format
            with _disable_current_modes():
                self._keep(after, real.to(dtype=after.dtype, memory_format=layout, copy=True))
        return laid

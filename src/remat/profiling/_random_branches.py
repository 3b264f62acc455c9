"""Branches on random draws: a forward that reads a value drawn at random into Python.

NOTE [Branches on random draws]
A profile measures one step, and a plan holds for the steps that run what that step ran. A
forward that reads a random draw into Python (``if torch.rand([]) < p``, ``.item()`` of a
draw) can take another path in a later step: LayerDrop skips other layers, and a step that
runs more of them keeps more than the plan's budget. remat turns off the LayerDrop it knows
(NOTE [LayerDrop while planning] in ``remat.core._hf``); any other such branch is found by
running the forward without gradients, and a second time where the first read a draw:

* A tensor is *drawn* when an op made it from drawn tensors and fresh factory output only
  (no other tensor), and either consumes a generator itself or read a drawn tensor:
  ``rand([])``, ``bernoulli_`` on an ``empty``, ``rand([]) < p``. ``rand_like(x)`` and the
  in-place fills (``uniform_``) do not read ``x``'s values. Dropout of an activation is not
  drawn: its output holds the activation's data, and a branch on it is a branch on data.
* The two runs force every uniform or Bernoulli draw to the lowest value it can take, then to
  the highest: for a continuous range the values just inside it (``rand``: the smallest float
  above 0, then the largest below 1), so a test that fails only at an end it reaches once in
  2^24 draws (``rand() > 0``) is not taken for a branch. A branch on a monotone test of a draw
  (``rand < p``, the only kind LayerDrop makes) goes the same way for every draw exactly when it
  goes the same way at both ends, so a read of a drawn value (``item``, ``bool``, ``equal``)
  that differs between the runs is a branch on a random draw; with LayerDrop's probability 0
  both runs read False and nothing is found. What Python does with a value it reads is not
  seen, so the runs' ops tell: where both ran the same ops at the same shapes, no read sent
  either end elsewhere, and nothing is found. torchvision's detection models read
  ``int(uniform_(0, len(sizes)).item())`` to pick a training size: with one size both ends
  pick it, and their ``item()`` values, which always differ, refused every such model. A test
  that sends draws in the middle of their range elsewhere than both ends (not monotone:
  ``0.4 < u < 0.6``) is not seen.
* A read of a sample neither run can force (``randn``, ``randint``, ``bernoulli`` of a tensor of
  probabilities, ...) counts as a branch.

Python's and NumPy's generators do not pass through torch's dispatcher: their draws cannot be
forced, and a test of one is a test of a Python number. So where the first run moved either
generator, up to ``HOST_RUNS`` more runs each start them from another state (torch's draws
forced low again, and everything put back after), and the ops each runs, with their output
shapes, are compared with the first run's: the first op that differs is where the forward
took another path on a host draw. A branch rare enough that every one of those draws takes
the first run's path is not seen (LayerDrop at 0.1 over 6 layers: 8% of the time); a mask
drawn from NumPy (Wav2Vec2's SpecAugment) changes values, not ops, and is no branch.

A real profile records where they are (``Profile.random_branches``, ``file.py:line
(function)``): ``remat.auto`` refuses to promise a budget for such a model and says how to fix
the draw, ``remat.profile`` warns. A fake profile, which cannot take such a branch at all (a
draw has no value), says so; a branch on a host draw it does not see. Nor are branches seen
in an FSDP2 model's real profile (a forward without gradients leaves its root unsharded),
which LayerDrop's settings still cover.
"""

from __future__ import annotations

import random
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from remat.core._host_rng import same_host_rng
from remat.core._memtrack import op_tensors
from remat.core._rng import draws_random
from remat.core._state import host_rng
from remat.core._writes import written_tensors

__all__ = ["HOST_RUNS", "Draws", "RandomBranches", "branches", "weight_storages", "where_in_the_model"]

#: Runs from other states of Python's and NumPy's generators, where a forward draws from them.
HOST_RUNS = 3

aten = torch.ops.aten
_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default}
#: Random ops whose output does not depend on the values of their ``self`` argument (its shape or storage only).
_FILLS = {
    aten.rand_like,
    aten.randn_like,
    aten.randint_like,
    aten.uniform_,
    aten.normal_,
    aten.exponential_,
    aten.geometric_,
    aten.cauchy_,
    aten.log_normal_,
    aten.random_,
    aten.bernoulli_,
}
_DRAWN, _UNFORCED, _FRESH = "drawn", "unforced", "fresh"
_OURS = (str(Path(torch.__file__).parent), str(Path(__file__).parents[1]))


def _keeps_data(func: Any) -> bool:
    """A random op whose output is its input's data, masked or scaled at random (dropout, RReLU): not a draw."""
    name = str(getattr(func, "overloadpacket", func))
    return "dropout" in name or "rrelu" in name


def _ends(func: Any, args: tuple, kwargs: dict) -> tuple[float, float, bool] | None:
    """The lowest and the highest value a draw of ``func`` can take, and whether they are ends of a continuous range
    (forced to the values just inside them); None: not a draw these runs force."""
    packet = getattr(func, "overloadpacket", None)
    if packet in (aten.rand, aten.rand_like):
        return 0.0, 1.0, True
    if packet is aten.uniform_:
        lo = kwargs.get("from", args[1] if len(args) > 1 else 0.0)
        return float(lo), float(kwargs.get("to", args[2] if len(args) > 2 else 1.0)), True
    p = kwargs.get("p", args[1] if len(args) > 1 else None)
    if packet in (aten.bernoulli_, aten.bernoulli) and isinstance(p, (int, float)):
        return float(p >= 1), float(p > 0), False  # p 0 or 1 draws one value only
    return None


def _force(t: torch.Tensor, ends: tuple[float, float, bool], end: str) -> None:
    """Fill ``t`` with its draw's lowest value (``end`` "low") or its highest."""
    lo, hi, open_range = ends
    value, other = (lo, hi) if end == "low" else (hi, lo)
    if open_range and t.is_floating_point():  # the value next to the end, inside: ``rand() > 0`` is all but sure
        value = torch.nextafter(torch.tensor(value, dtype=t.dtype), torch.tensor(other, dtype=t.dtype)).item()
    t.fill_(value)


class Draws:
    """Which live tensors hold random draws (NOTE [Branches on random draws])."""

    def __init__(self) -> None:
        self._kind: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def read_of(self, func: Any, args: tuple, kwargs: dict) -> str | None:
        """What ``func`` reads into Python: a forced draw, a draw not forced, or None (no draw)."""
        if func not in _READS:
            return None
        kinds = {self._kind.get(t) for t in op_tensors((args, kwargs))}
        return _UNFORCED if _UNFORCED in kinds else _DRAWN if _DRAWN in kinds else None

    def drawn(self, t: torch.Tensor) -> bool:
        """True when ``t`` holds a draw these runs forced."""
        return self._kind.get(t) == _DRAWN

    def reads_a_draw(self, func: Any, args: tuple, kwargs: dict) -> bool:
        """True when ``func`` reads the value of a drawn tensor into Python."""
        return self.read_of(func, args, kwargs) is not None

    def note(self, func: Any, args: tuple, kwargs: dict, out: Any, *, forceable: bool = False) -> None:
        """Record what ``func``'s outputs (and the tensors it wrote) hold, after it ran; ``forceable``: its draw was
        forced to an end."""
        random = draws_random(func) and not _keeps_data(func)
        read = args[1:] if random and getattr(func, "overloadpacket", None) in _FILLS else args
        inputs = op_tensors((read, kwargs))
        kinds = [self._kind.get(t) for t in inputs]
        kind: str | None = None  # data
        if random:  # a sample, whatever its distribution's parameters (bernoulli of a tensor of probabilities)
            kind = _DRAWN if forceable and all(k in (_DRAWN, _FRESH) for k in kinds) else _UNFORCED
        elif kinds and all(kinds) and (_DRAWN in kinds or _UNFORCED in kinds):
            kind = _UNFORCED if _UNFORCED in kinds else _DRAWN
        elif not inputs:
            kind = _FRESH  # a factory's output: its values come from no tensor
        touched = op_tensors(out)
        if getattr(getattr(func, "_schema", None), "is_mutable", False):
            touched = [*touched, *written_tensors(func, args, kwargs)]
        for t in touched:
            if kind is None:
                self._kind.pop(t, None)
            else:
                self._kind[t] = kind


def where_in_the_model() -> str:
    """The innermost Python frame outside torch and remat: ``file.py:line (function)``."""
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(_OURS):
            return f"{Path(frame.filename).name}:{frame.lineno} ({frame.name})"
    return "unknown"


class RandomBranches(TorchDispatchMode):
    """One run of NOTE [Branches on random draws]: draws forced to their ``end`` ("low" or "high"), every read of a
    drawn value recorded with where it happened, and the ops it ran. With ``host_seed``, the run starts Python's
    and NumPy's generators from a state of that seed (the caller puts them back) and records where its ops first
    differ from ``reference``'s."""

    def __init__(
        self,
        end: str,
        *,
        weights: frozenset[int] = frozenset(),
        host_seed: int | None = None,
        reference: RandomBranches | None = None,
    ) -> None:
        super().__init__()
        self.end = end
        self.draws = Draws()
        self.reads: list[tuple[str, Any]] = []
        self.unforced: list[str] = []
        self.ops: list[tuple[Any, tuple, tuple]] = []
        self.weights = weights
        """Storages (``data_ptr``) of the model's parameters and buffers: which layer an op is of."""
        self.host_seed = host_seed
        self.reference = reference.ops if reference is not None else None
        self.diverged: str | None = None
        self.host_moved = False
        self._host_start: tuple[Any, Any] | None = None

    def __enter__(self) -> RandomBranches:
        if self.host_seed is not None:
            random.seed(self.host_seed)
            numpy = sys.modules.get("numpy")
            if numpy is not None:
                numpy.random.seed(self.host_seed)
        self._host_start = host_rng()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if self._host_start is not None:
            self.host_moved = not same_host_rng(self._host_start, host_rng())
        if self.reference is not None and self.diverged is None and len(self.ops) != len(self.reference):
            self.diverged = "the end of the forward"  # one run stopped where the other went on

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        read = self.draws.read_of(func, args, kwargs)
        out = func(*args, **kwargs)
        if read == _UNFORCED:
            self.unforced.append(where_in_the_model())
        elif read == _DRAWN:
            self.reads.append((where_in_the_model(), out))
        ends = _ends(func, args, kwargs) if draws_random(func) else None
        self.draws.note(func, args, kwargs, out, forceable=ends is not None)
        if ends is not None:
            for t in op_tensors(out):
                if self.draws.drawn(t):
                    _force(t, ends, self.end)
        self._note_op(func, args, out)
        return out

    def _note_op(self, func: Any, args: tuple, out: Any) -> None:
        # Alike layers run alike ops: the weights an op reads tell a skipped layer from the next one.
        weights = tuple(p for p in (_storage(t) for t in op_tensors(args)) if p in self.weights)
        op = (func, tuple(tuple(t.shape) for t in op_tensors(out)), weights)
        index = len(self.ops)
        self.ops.append(op)
        if self.reference is not None and self.diverged is None:
            if index >= len(self.reference) or self.reference[index] != op:
                self.diverged = where_in_the_model()


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a subclass)
        return None


def weight_storages(model: torch.nn.Module) -> frozenset[int]:
    """The storages of ``model``'s parameters and buffers, as :class:`RandomBranches` takes them."""
    found = (_storage(t) for t in (*model.parameters(), *model.buffers()))
    return frozenset(p for p in found if p)


def branches(low: RandomBranches, high: RandomBranches, *host_runs: RandomBranches) -> tuple[str, ...]:
    """Where the runs ``low`` and ``high`` of one forward show a branch on a random draw (reads of draws neither
    could force, and the first read whose value differs between them), and where ``host_runs`` first ran other ops
    than ``low`` (a branch on Python's or NumPy's draws)."""
    found = dict.fromkeys([*low.unforced, *high.unforced])
    if low.ops == high.ops:  # both ends ran the same ops at the same shapes: no read sent either elsewhere
        return _with_host_branches(found, host_runs)
    for (where, a), (_, b) in zip(low.reads, high.reads, strict=False):
        if a != b:
            found[where] = None
            break
    else:
        if len(low.reads) != len(high.reads):
            longer = low.reads if len(low.reads) > len(high.reads) else high.reads
            found[longer[min(len(low.reads), len(high.reads))][0]] = None
    return _with_host_branches(found, host_runs)


def _with_host_branches(found: dict[str, None], host_runs: tuple[RandomBranches, ...]) -> tuple[str, ...]:
    """``found`` with where the first of ``host_runs`` that ran other ops than the first run diverged."""
    for run in host_runs:
        if run.diverged is not None:
            found[f"{run.diverged} (a draw of Python's or NumPy's generator)"] = None
            break
    return tuple(found)

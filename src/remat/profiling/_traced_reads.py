"""The plain attributes a traced forward reads: recorded while tracing, watched while the trace runs.

NOTE [The attributes a trace holds]
A trace holds the plain attributes (numbers, strings, flags) the forward's Python read as they were:
``x * self.alpha`` records 0.5, ``if self.use_gate:`` records the branch taken, and a lookup that found
nothing (``getattr(self, "scale", None)``) records that. A later change to one of them must run the
class's forward, or the model computes with the old value. Only those it read: a module fx calls as a
leaf (``nn.Dropout``, ``nn.LeakyReLU``) runs its own forward at each call and reads its attributes then,
so a dropout schedule that sets ``p`` still checkpoints; a counter the training loop keeps on the model
does not turn the plan off. So the tracer records each read of a module's instance attribute of a plain
type (and each lookup of one the module lacks) while the trace runs; the installed forward compares
those few values at each call, a few dictionary lookups where walking every module's attributes took
1.4 ms a call on a model of 500 modules. Attributes of the class, and reads from outside the forward's
code (a closure's, a global's), are not recorded: the trace holds them, as it holds its Python.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

#: The types of the attributes a trace bakes in when its Python reads them.
PLAIN = (bool, int, float, str, type(None))
#: What a read that found nothing recorded.
MISSING = object()
_ROUTED = ("_parameters", "_buffers", "_modules")  # what nn.Module.__getattr__ finds when the instance lacks it


def _watched(name: str) -> bool:
    """Not the training flags (the installed forward compares the modes itself) nor remat's own attributes."""
    return name != "training" and not name.startswith("_remat")


def plain_attributes(model: nn.Module) -> dict[tuple[str, str], Any]:
    """Every module's instance attributes of plain types: what a forward's Python may read."""
    return {
        (name, k): v
        for name, m in model.named_modules()
        for k, v in vars(m).items()
        if type(v) in PLAIN and _watched(k)
    }


def put_back_attributes(owners: dict[str, nn.Module], plain: dict[tuple[str, str], Any]) -> list[tuple[str, str]]:
    """Put back the plain attributes a trace changed (a Python counter, ``self.calls += 1``); their keys."""
    moved = []
    for (name, k), v in plain.items():
        now = vars(owners[name]).get(k, MISSING)
        if not same(now, v):
            object.__setattr__(owners[name], k, v)
            moved.append((name, k))
    return moved


def same(now: Any, then: Any) -> bool:
    """An attribute's value now is the one recorded (``MISSING`` for none)."""
    if now is then:
        return True
    return type(now) in PLAIN and type(then) in PLAIN and now == then


@contextmanager
def reads_recorded(reads: dict[tuple[nn.Module, str], Any]) -> Iterator[None]:
    """While in it, every read of a module's plain instance attribute, and every lookup of one the module lacks,
    is put in ``reads`` with the value found (NOTE [The attributes a trace holds])."""

    def getattribute(self: nn.Module, name: str) -> Any:
        try:
            value = object.__getattribute__(self, name)
        except AttributeError:
            own = object.__getattribute__(self, "__dict__")
            if _watched(name) and not any(name in own.get(where, ()) for where in _ROUTED):
                reads.setdefault((self, name), MISSING)
            raise
        if type(value) in PLAIN and _watched(name) and name in object.__getattribute__(self, "__dict__"):
            reads.setdefault((self, name), value)
        return value

    own = nn.Module.__dict__.get("__getattribute__")
    nn.Module.__getattribute__ = getattribute  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        if own is None:
            del nn.Module.__getattribute__  # object's again
        else:
            nn.Module.__getattribute__ = own  # type: ignore[method-assign]


class WatchedReads:
    """The recorded reads of one trace, on the model's modules: which changed since."""

    def __init__(self, model: nn.Module, reads: dict[tuple[str, str], Any]) -> None:
        self.reads = [(name, model.get_submodule(name), k, v) for (name, k), v in reads.items()]

    def changed(self) -> list[str]:
        """The dotted names of the attributes whose value is not the recorded one."""
        return [
            f"{name}.{k}" if name else k
            for name, module, k, v in self.reads
            if not same(vars(module).get(k, MISSING), v)
        ]

    def unchanged(self) -> bool:
        return all(same(vars(module).get(k, MISSING), v) for _, module, k, v in self.reads)

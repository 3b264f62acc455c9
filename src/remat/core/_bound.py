"""Pickling remat's instance-level forwards with the model (``torch.save(model)``, ``pickle``, ``copy``).

NOTE [A class forward pickles as its function]
remat's instance-level forwards (``remat.wrap``'s, a nested segment's head and the blocks it
runs) hold the class's forward bound to the module. Pickle saves a bound method as the
lookup ``getattr(module, "forward")`` done again when loading, and by then the module's own
``forward`` may be remat's wrapper again: a loaded segment ran its later blocks through the
chain check instead of their class forward, and raised that they were not a chain. So these
objects save such a method as its function and its module (``types.MethodType`` rebuilds it:
the class's forward, whatever the instance holds), in lists and tuples too.
"""

from __future__ import annotations

import types
from typing import Any


class _Bound:
    """A bound method, saved as its function and its instance."""

    __slots__ = ("func", "owner")

    def __init__(self, func: Any, owner: Any) -> None:
        self.func, self.owner = func, owner

    def __reduce__(self) -> tuple:
        return _Bound, (self.func, self.owner)


def _out(value: Any) -> Any:
    if isinstance(value, types.MethodType):
        return _Bound(value.__func__, value.__self__)
    if type(value) in (list, tuple):
        return type(value)(_out(v) for v in value)
    return value


def _in(value: Any) -> Any:
    if isinstance(value, _Bound):
        return types.MethodType(value.func, value.owner)
    if type(value) in (list, tuple):
        return type(value)(_in(v) for v in value)
    return value


class PicklesBoundMethods:
    """Saves the bound methods among its attributes as function and instance (NOTE [A class forward pickles as
    its function]); ``_unpickled`` names attributes saved as None (state of the last call, made again)."""

    _unpickled: tuple[str, ...] = ()

    def __getstate__(self) -> dict[str, Any]:
        return {k: None if k in self._unpickled else _out(v) for k, v in self.__dict__.items()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({k: _in(v) for k, v in state.items()})

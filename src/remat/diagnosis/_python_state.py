"""Plain-Python state a training step can change, so the doctor can compare it and put it back.

NOTE [Which Python state the doctor watches]
Recomputation reruns forwards and forward hooks; a side effect outside tensors (a call
counter, a list a hook appends activations to, a cache dict) then happens twice per step.
The doctor watches every module attribute that holds a number, string, bool, None or a
list/dict/set/deque, beyond those every ``nn.Module`` has; and, for forwards and forward
hooks written outside torch and remat, the same kinds of values in their closures, in the
globals they name, and on the object of a bound-method hook. It compares what one step
leaves behind with and without checkpointing (containers by length: their items may be
tensors) and puts everything back afterwards, containers in place so that other references
see the restored contents.

NOTE [Putting back only what remat knows how to]
The values are the user's objects, and a container's class may guard its contents:
diffusers keeps a model's config in a ``FrozenDict`` (an ``OrderedDict`` whose ``update``
raises), so clearing it and then updating it erased the config of every diffusers model.
So a container is watched only when it is a list, dict, set, deque, ``OrderedDict``,
``defaultdict`` or ``Counter``, or a subclass that overrides none of the methods remat
reads or refills it with (a subclass that does has invariants of its own: it is left
alone, never read, never written); and its contents are read and written back through
that known class's own methods. A value is put back only when the step changed it: an
attribute rebound, a container whose items are no longer the same objects. Only plain
``dict`` namespaces are written (a class's ``mappingproxy`` is not watched).
"""

from __future__ import annotations

import collections
import functools
import types
from collections.abc import Iterator
from typing import Any

from torch import nn

from remat.errors import RematError

_SCALARS = (bool, int, float, str, type(None))
_MODULE_INTERNALS = frozenset(vars(nn.Module()))
_FOREIGN = ("torch.", "remat.")
_LIST = (
    "__iter__",
    "__len__",
    "__getitem__",
    "__setitem__",
    "__delitem__",
    "__iadd__",
    "append",
    "extend",
    "insert",
    "pop",
    "remove",
    "clear",
    "sort",
    "reverse",
)
_DICT = (
    "__iter__",
    "__len__",
    "__getitem__",
    "__setitem__",
    "__delitem__",
    "__ior__",
    "keys",
    "values",
    "items",
    "get",
    "pop",
    "popitem",
    "setdefault",
    "update",
    "clear",
)
# The known containers, each with the methods a subclass must leave as they are to count as one
# (NOTE [Putting back only what remat knows how to]).
_KNOWN: dict[type, tuple[str, ...]] = {
    collections.OrderedDict: (*_DICT, "move_to_end"),
    collections.defaultdict: (*_DICT, "__missing__"),
    collections.Counter: (*_DICT, "subtract"),
    dict: _DICT,
    list: _LIST,
    set: (
        "__iter__",
        "__len__",
        "__ior__",
        "__isub__",
        "add",
        "discard",
        "remove",
        "pop",
        "update",
        "clear",
        "difference_update",
        "intersection_update",
        "symmetric_difference_update",
    ),
    collections.deque: (*_LIST, "appendleft", "extendleft", "popleft", "rotate"),
}

# NOTE [Hooks that record outputs only in the outer forward]
# transformers (5.x) collects router logits, attentions and hidden states with a forward
# hook on each layer (``utils.output_capturing``) that appends to a collector held in a
# context variable. The collector is set only while the model's own forward runs and is
# None in backward, so the hook returns at once in recomputation: it runs again, but
# records nothing, and the outputs the model returns are those of the forward. Such hooks
# are not side effects that repeat; any other hook still counts.
_RECORDING_HOOKS = ("transformers.utils.output_capturing",)


def _known(value: Any) -> type[Any] | None:
    """The known container class whose methods read and refill ``value``; None: not one remat may touch."""
    cls = type(value)
    if cls in _KNOWN:
        return cls
    base = next((k for k in cls.__mro__ if k in _KNOWN), None)
    if base is None or any(getattr(cls, m, None) is not getattr(base, m) for m in _KNOWN[base]):
        return None
    return base


def _watchable(value: Any) -> bool:
    return isinstance(value, _SCALARS) or _known(value) is not None


def summary(value: Any) -> Any:
    """What the doctor compares: the value itself, or ``(type, length)`` for a container."""
    kind = _known(value)
    return value if kind is None else (type(value).__name__, kind.__len__(value))


def _contents(kind: type[Any], container: Any) -> list:
    """The items (a dict's (key, value) pairs), read through ``kind``'s own methods."""
    return list(kind.items(container)) if issubclass(kind, dict) else list(kind.__iter__(container))


def _same(kind: type, container: Any, contents: list) -> bool:
    now = _contents(kind, container)
    if len(now) != len(contents):
        return False
    if issubclass(kind, dict):
        return all(k is j and v is w for (k, v), (j, w) in zip(now, contents))
    return all(a is b for a, b in zip(now, contents))


def _refill(kind: type, container: Any, contents: list) -> None:
    if issubclass(kind, dict):
        kind.clear(container)
        for k, v in contents:
            kind.__setitem__(container, k, v)
    elif kind is list:
        list.__setitem__(container, slice(None), contents)
    elif kind is set:
        set.clear(container)
        set.update(container, contents)
    else:  # deque: extend keeps its maxlen
        collections.deque.clear(container)
        collections.deque.extend(container, contents)


class _Space:
    """Somewhere Python values live: a ``__dict__``, some globals, or closure cells."""

    def __init__(self, owner: str, prefix: str, values: dict, names: tuple[str, ...] | None = None) -> None:
        self.owner = owner
        """Module the values belong to (for findings)."""
        self.prefix = prefix
        self.values = values
        self.names = names
        """Watched names; None: every non-internal name, including ones added later."""

    def keys(self) -> list[str]:
        names = self.values if self.names is None else self.names
        return [k for k in names if k in self.values and k not in _MODULE_INTERNALS and _watchable(self.values[k])]

    def has(self, key: str) -> bool:
        return key in self.values

    def get(self, key: str) -> Any:
        return self.values[key]

    def set(self, key: str, value: Any) -> None:
        self.values[key] = value

    def delete(self, key: str) -> None:
        if self.names is None:
            del self.values[key]


class _Cells(_Space):
    """Closure cells of a function, by free-variable name."""

    def __init__(self, owner: str, prefix: str, fn: types.FunctionType) -> None:
        super().__init__(owner, prefix, dict(zip(fn.__code__.co_freevars, fn.__closure__ or ())), ())
        self.names = tuple(self.values)

    def keys(self) -> list[str]:
        return [k for k in self.values if self.has(k) and _watchable(self.get(k))]

    def has(self, key: str) -> bool:
        try:
            _ = self.values[key].cell_contents
        except ValueError:  # empty cell
            return False
        return True

    def get(self, key: str) -> Any:
        return self.values[key].cell_contents

    def set(self, key: str, value: Any) -> None:
        self.values[key].cell_contents = value


def _functions(module: nn.Module) -> Iterator[Any]:
    yield type(module).forward
    yield module.__dict__.get("forward")
    yield from module._forward_pre_hooks.values()
    yield from module._forward_hooks.values()


def _user_hooks(hooks: dict) -> list[str]:
    return [
        getattr(h, "__qualname__", repr(h))
        for h in hooks.values()
        if not (getattr(h, "__module__", None) or "").startswith(_FOREIGN)
        and getattr(h, "__module__", None) not in _RECORDING_HOOKS
    ]


def _spaces_of(fn: Any, owner: str) -> Iterator[_Space]:
    while isinstance(fn, functools.partial):
        fn = fn.func
    bound = getattr(fn, "__self__", None)
    if bound is not None and not isinstance(bound, nn.Module) and type(getattr(bound, "__dict__", None)) is dict:
        yield _Space(owner, f"{type(bound).__name__}.", vars(bound))
    fn = getattr(fn, "__func__", fn)
    if not isinstance(fn, types.FunctionType) or (fn.__module__ or "").startswith(_FOREIGN):
        return
    label = fn.__qualname__
    yield _Cells(owner, f"{label}: ", fn)
    yield _Space(owner, f"global {fn.__module__}.", fn.__globals__, tuple(fn.__code__.co_names))


Snapshot = list[dict[str, tuple[Any, list | None]]]
"""Per space: name -> (the object, its items when it is a container)."""


class PythonState:
    """The watched Python values of a model (NOTE above)."""

    def __init__(self, model: nn.Module) -> None:
        self.spaces: list[_Space] = []
        self.hooks: dict[str, tuple[list[str], list[str]]] = {}
        """Module name -> (forward pre-hooks, forward hooks) written outside torch and remat."""
        seen: set[int] = set()
        for name, module in model.named_modules():
            name = name or "<root>"
            self.spaces.append(_Space(name, f"{name}.", vars(module)))
            pre, post = _user_hooks(module._forward_pre_hooks), _user_hooks(module._forward_hooks)
            if pre or post:
                self.hooks[name] = (pre, post)
            for fn in _functions(module):
                if fn is not None and id(fn) not in seen:
                    seen.add(id(fn))
                    self.spaces.extend(_spaces_of(fn, name))

    def snapshot(self) -> Snapshot:
        out = []
        for s in self.spaces:
            saved = {}
            for k in s.keys():
                value = s.get(k)
                kind = _known(value)
                saved[k] = (value, None if kind is None else _contents(kind, value))
            out.append(saved)
        return out

    def restore(self, snapshot: Snapshot) -> None:
        """Put back what the step changed (NOTE above); a RematError names what could not be."""
        failures: list[str] = []
        for space, saved in zip(self.spaces, snapshot):
            for key in space.keys():
                if key not in saved:
                    _attempt(failures, space, key, functools.partial(space.delete, key))
            for key, (obj, contents) in saved.items():
                _attempt(failures, space, key, functools.partial(_put_back, space, key, obj, contents))
        if failures:
            raise RematError(
                f"remat.doctor: failed to restore Python state of the model after running its step: "
                f"{'; '.join(failures)}. Everything else was restored; set those back yourself before training on."
            )

    def summary(self) -> dict[tuple[str, str], Any]:
        """(module, label) -> :func:`summary` of every watched value now."""
        return {(s.owner, f"{s.prefix}{k}"): summary(s.get(k)) for s in self.spaces for k in s.keys()}


def _put_back(space: _Space, key: str, obj: Any, contents: list | None) -> None:
    if contents is not None:
        kind = _known(obj)
        if kind is None:
            raise RematError(f"its class {type(obj).__name__} changed in the step")
        if not _same(kind, obj, contents):
            _refill(kind, obj, contents)
    if not space.has(key) or space.get(key) is not obj:
        space.set(key, obj)


def _attempt(failures: list[str], space: _Space, key: str, restore: Any) -> None:
    try:
        restore()
    except Exception as exc:  # noqa: BLE001 (gathered, raised once every value had its turn)
        failures.append(f"{space.prefix}{key} ({type(exc).__name__}: {exc})")

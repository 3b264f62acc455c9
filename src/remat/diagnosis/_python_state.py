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
"""

from __future__ import annotations

import collections
import functools
import types
from collections.abc import Iterator
from typing import Any

from torch import nn

_SCALARS = (bool, int, float, str, type(None))
_CONTAINERS = (list, dict, set, collections.deque)
_MODULE_INTERNALS = frozenset(vars(nn.Module()))
_FOREIGN = ("torch.", "remat.")

# NOTE [Hooks that record outputs only in the outer forward]
# transformers (5.x) collects router logits, attentions and hidden states with a forward
# hook on each layer (``utils.output_capturing``) that appends to a collector held in a
# context variable. The collector is set only while the model's own forward runs and is
# None in backward, so the hook returns at once in recomputation: it runs again, but
# records nothing, and the outputs the model returns are those of the forward. Such hooks
# are not side effects that repeat; any other hook still counts.
_RECORDING_HOOKS = ("transformers.utils.output_capturing",)


def _watchable(value: Any) -> bool:
    return isinstance(value, _SCALARS + _CONTAINERS)


def summary(value: Any) -> Any:
    """What the doctor compares: the value itself, or ``(type, length)`` for a container."""
    return (type(value).__name__, len(value)) if isinstance(value, _CONTAINERS) else value


def _copy(value: Any) -> Any:
    return type(value)(value) if isinstance(value, _CONTAINERS) else value


def _refill(container: Any, contents: Any) -> None:
    if isinstance(container, list):
        container[:] = contents
    elif isinstance(container, dict):
        container.clear()
        container.update(contents)
    else:  # set, deque
        container.clear()
        container.update(contents) if isinstance(container, set) else container.extend(contents)


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
        out = []
        for k, cell in self.values.items():
            try:
                if _watchable(cell.cell_contents):
                    out.append(k)
            except ValueError:  # empty cell
                continue
        return out

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
    return [getattr(h, "__qualname__", repr(h)) for h in hooks.values()
            if not (getattr(h, "__module__", None) or "").startswith(_FOREIGN)
            and getattr(h, "__module__", None) not in _RECORDING_HOOKS]


def _spaces_of(fn: Any, owner: str) -> Iterator[_Space]:
    while isinstance(fn, functools.partial):
        fn = fn.func
    bound = getattr(fn, "__self__", None)
    if bound is not None and not isinstance(bound, nn.Module) and hasattr(bound, "__dict__"):
        yield _Space(owner, f"{type(bound).__name__}.", vars(bound))
    fn = getattr(fn, "__func__", fn)
    if not isinstance(fn, types.FunctionType) or (fn.__module__ or "").startswith(_FOREIGN):
        return
    label = fn.__qualname__
    yield _Cells(owner, f"{label}: ", fn)
    yield _Space(owner, f"global {fn.__module__}.", fn.__globals__, tuple(fn.__code__.co_names))


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

    def snapshot(self) -> list[dict[str, tuple[Any, Any]]]:
        """Per space: name -> (the object, a shallow copy of it)."""
        return [{k: (s.get(k), _copy(s.get(k))) for k in s.keys()} for s in self.spaces]

    def restore(self, snapshot: list[dict[str, tuple[Any, Any]]]) -> None:
        for space, saved in zip(self.spaces, snapshot):
            for key in space.keys():
                if key not in saved:
                    space.delete(key)
            for key, (obj, contents) in saved.items():
                if isinstance(obj, _CONTAINERS):
                    _refill(obj, contents)
                space.set(key, obj)

    def summary(self) -> dict[tuple[str, str], Any]:
        """(module, label) -> :func:`summary` of every watched value now."""
        return {(s.owner, f"{s.prefix}{k}"): summary(s.get(k)) for s in self.spaces for k in s.keys()}

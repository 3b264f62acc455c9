"""Where torch's checkpoint runs, found from its public entry point (the doctor swaps these).

NOTE [Finding the doors by what checkpoint calls]
Every way into torch's checkpoint ends in two private globals of ``torch.utils.checkpoint``
(NOTE [Where the doctor intercepts checkpointing]), and torch renames them: in 2.14
``_checkpoint_without_reentrant_generator`` became a shim over ``..._impl`` that
``checkpoint`` no longer calls. A doctor that swapped a fixed name would see no
checkpointing at all and report the model fine. So the doors are found from the public
``torch.utils.checkpoint.checkpoint`` itself: the names its code, and the code of the
module's functions it calls (transitively), looks up in its module, keeping the
``autograd.Function`` subclass (reentrant) and the generator function (non-reentrant).
Then a canary call of each kind goes through the public function with the doors swapped
for counters; a door that sees nothing is an error naming the torch version, never a
report of "no checkpointing found".
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils.checkpoint as tuc

from remat.errors import RematError


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    """A code object and those nested in it (closures, lambdas)."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _looked_up(function: Any) -> tuple[list[str], list[str]]:
    """(autograd.Function names, generator function names) that ``function`` reaches in its module."""
    functions, generators, seen = [], [], set()
    todo = [inspect.unwrap(function)]
    while todo:
        code = todo.pop().__code__
        for name in (n for c in _codes(code) for n in c.co_names):
            value = tuc.__dict__.get(name)
            if name in seen or value is None:
                continue
            seen.add(name)
            if isinstance(value, type) and issubclass(value, torch.autograd.Function):
                functions.append(name)
            elif inspect.isgeneratorfunction(value):
                generators.append(name)
            elif inspect.isfunction(value) and value.__code__.co_filename == tuc.__file__:
                todo.append(value)
    return functions, generators


@functools.cache
def doors() -> tuple[str, str]:
    """(the reentrant ``autograd.Function``'s name, the non-reentrant generator's name) in torch.utils.checkpoint."""
    functions, generators = _looked_up(tuc.checkpoint)
    if len(functions) != 1 or len(generators) != 1:
        raise _blind(
            f"its code reaches {len(functions)} autograd.Function(s) {functions} and "
            f"{len(generators)} generator(s) {generators}, where one of each was expected"
        )
    _canary(functions[0], generators[0])
    return functions[0], generators[0]


def _canary(function_name: str, generator_name: str) -> None:
    """Check that a reentrant and a non-reentrant checkpoint each pass through their door."""
    seen = {"reentrant": 0, "non-reentrant": 0}
    real_function, real_generator = getattr(tuc, function_name), getattr(tuc, generator_name)

    class Counted:
        @staticmethod
        def apply(*args: Any) -> Any:
            seen["reentrant"] += 1
            return real_function.apply(*args)

    def counted(*args: Any, **kwargs: Any) -> Any:
        seen["non-reentrant"] += 1
        return (yield from real_generator(*args, **kwargs))

    x = torch.ones(1, requires_grad=True)
    with warnings.catch_warnings(), contextlib.ExitStack() as stack:
        warnings.simplefilter("ignore")
        for reentrant in (True, False):  # once unswapped: torch imports what it needs lazily, by value
            tuc.checkpoint(torch.neg, x, use_reentrant=reentrant, preserve_rng_state=False)
        for name, new in ((function_name, Counted), (generator_name, counted)):
            stack.callback(setattr, tuc, name, getattr(tuc, name))
            setattr(tuc, name, new)
        for reentrant in (True, False):
            tuc.checkpoint(torch.neg, x, use_reentrant=reentrant, preserve_rng_state=False)
    missed = [kind for kind, count in seen.items() if count != 1]
    if missed:
        raise _blind(
            f"a {' and a '.join(missed)} checkpoint call did not pass through {function_name} / {generator_name}"
        )


def _blind(why: str) -> RematError:
    return RematError(
        f"remat.doctor: cannot see checkpointing in torch {torch.__version__}: {why}. Reporting on this torch would "
        "say 'no checkpointing found' whatever the model does; use a torch version remat declares (pyproject), or "
        "report this torch version to remat."
    )

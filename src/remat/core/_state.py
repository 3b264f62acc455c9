"""Snapshot and restore of everything a training step can change on a model.

Profiling, measuring and the doctor run real training steps on the user's model;
afterwards the model must be exactly as it was: parameters, buffers, gradients,
``requires_grad`` and ``training`` flags, and the global RNG streams.

NOTE [Restores run whatever stops the step]
A step can end in the model's exception, in remat's, or in a Ctrl-C (KeyboardInterrupt,
any BaseException), and the user's model is restored in every case: each restore runs in
a ``finally`` (:func:`restoring`), one restore that fails does not stop the others
(:func:`restore_all`), and a Ctrl-C that lands while they run waits until they are done
(:func:`uninterrupted`): copying back the weights of a large model takes long enough to
be hit by a second Ctrl-C, and half a restore leaves a model that is neither the user's
nor the step's. What remat cannot put back is remat's own error, naming what and why,
never the model's: the user's code did nothing wrong.
"""

from __future__ import annotations

import contextlib
import functools
import random
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from remat.core._costs import spent
from remat.core._parameter_writes import ParameterWrites
from remat.errors import RematError

# NOTE [Snapshots a step without an optimizer needs]
# On the CPU the snapshot sits in the memory the step runs in: a copy of every parameter
# is as much again as the model, and a budget that the step alone would meet is missed
# by it (remat.auto's NOTE [Within the budget]). A training step without an optimizer
# changes gradients, buffers and the RNG, not the parameters' values, so the callers
# that run such steps (auto's verification) leave the values out, and the snapshot watches
# for a forward that writes them all the same (NOTE [A step that writes parameters] in
# remat.core._parameter_writes).


def _copy(t: torch.Tensor | None) -> torch.Tensor | None:
    # Snapshots live on the CPU so that a CUDA peak measured meanwhile never counts them.
    return None if t is None else t.detach().to("cpu", copy=True)


def _attempt(failures: list[str], what: str, restore: Callable[[], None]) -> None:
    try:
        restore()
    except RematError as exc:  # remat's own reason
        failures.append(f"{what} ({exc})")
    except Exception as exc:  # noqa: BLE001 (gathered, raised once every part had its turn)
        failures.append(f"{what} ({type(exc).__name__}: {exc})")


@dataclass
class ModelState:
    """Everything :func:`capture` saw; :meth:`restore` puts it back in place (same tensor objects)."""

    model: nn.Module
    params: dict[str, tuple[torch.Tensor | None, torch.Tensor | None, bool]]
    """Per parameter: (its data, None where not copied; its gradient; ``requires_grad``)."""
    buffers: dict[str, torch.Tensor | None]
    training: dict[str, bool]
    cpu_rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None
    host_rng: tuple[Any, Any] = (None, None)
    """Python's ``random`` state and NumPy's global one (None: NumPy not imported): models draw from them too
    (Wav2Vec2's SpecAugment masks), so a step remat runs must start from them and leave them as they were."""
    watch: ParameterWrites | None = None
    """Where parameters' values were left out: what the step wrote of them (NOTE [A step that writes
    parameters] in remat.core._parameter_writes)."""
    own_rng: tuple[tuple[torch.Generator, torch.Tensor], ...] = ()
    """Generators the model's modules keep as attributes (``self.gen``), with their states: a step draws from them
    too (NOTE [A generator of the call's own] in remat.core._generators)."""
    api: str = field(default="remat", compare=False)
    """The API that took the snapshot (for errors)."""

    def restore(self) -> None:
        """Put everything back; every part is tried, and a RematError names those that could not be."""
        with spent("restores"):
            self._restore()

    def _restore(self) -> None:
        failures: list[str] = []
        with torch.no_grad():
            for name, p in self.model.named_parameters(remove_duplicate=False):
                _attempt(failures, f"parameter {name!r}", functools.partial(self._parameter, p, name))
            for name, b in self.model.named_buffers(remove_duplicate=False):
                _attempt(failures, f"buffer {name!r}", functools.partial(self._buffer, b, name))
        for name, module in self.model.named_modules(remove_duplicate=False):
            flag = self.training.get(name)
            if flag is not None and module.training != flag:
                _attempt(
                    failures,
                    f"the training flag of {name or 'the model'!r}",
                    functools.partial(setattr, module, "training", flag),
                )
        _attempt(failures, "the CPU RNG state", lambda: torch.set_rng_state(self.cpu_rng))
        cuda_rng = self.cuda_rng
        if cuda_rng is not None:
            _attempt(failures, "the CUDA RNG states", lambda: torch.cuda.set_rng_state_all(cuda_rng))
        _attempt(failures, "Python's and NumPy's RNG states", functools.partial(set_host_rng, self.host_rng))
        for gen, state in self.own_rng:
            _attempt(failures, "the state of a generator of the model's own", functools.partial(_set_state, gen, state))
        failures += self._gone()
        if failures:
            raise RematError(
                f"{self.api}: failed to restore the model after running its step: {'; '.join(failures)}. Everything "
                "else was restored. A step that registers, removes or reshapes parameters or buffers (lazy "
                "initialisation) cannot be undone: run one training step yourself first, then call again."
            )

    def _parameter(self, p: nn.Parameter, name: str) -> None:
        if name not in self.params:
            raise RematError("the step registered it; it did not exist before")
        data, grad, requires_grad = self.params[name]
        if data is None and self.watch is not None:  # not captured: put back only what the step wrote
            self.watch.put_back(name, p)
        if data is not None:
            if p.shape != data.shape or p.dtype != data.dtype:
                raise RematError(
                    f"the step made it {tuple(p.shape)} {p.dtype}, it was {tuple(data.shape)} {data.dtype}"
                )
            p.copy_(data)
        # a copy: on the CPU .to() would hand out the snapshot itself, and a step that
        # accumulates into p.grad in place (NOTE [The step a loop repeats]) would change it
        p.grad = None if grad is None else grad.to(p.device, copy=True)
        if p.requires_grad != requires_grad:
            p.requires_grad_(requires_grad)

    def _buffer(self, b: torch.Tensor | None, name: str) -> None:
        if name not in self.buffers:
            raise RematError("the step registered it; it did not exist before")
        saved = self.buffers[name]
        if b is not None and saved is not None:
            if b.shape != saved.shape:  # a QAT observer sized on its first step: back to its size, in place
                b.resize_(saved.shape)
            b.copy_(saved)
            if b.grad_fn is not None and b._base is None:
                # written in place from values that require grad, the buffer joined the step's graph: a later
                # backward through it would fail ("backward through the graph a second time"), a deepcopy too
                b.detach_()

    def _gone(self) -> list[str]:
        params = {n for n, _ in self.model.named_parameters(remove_duplicate=False)}
        buffers = {n for n, _ in self.model.named_buffers(remove_duplicate=False)}
        return [
            f"{kind} {name!r} (the step removed it)"
            for kind, names, now in (("parameter", self.params, params), ("buffer", self.buffers, buffers))
            for name in names
            if name not in now
        ]


def capture(model: nn.Module, api: str = "remat", *, parameters: bool = True) -> ModelState:
    """Snapshot ``model`` and the RNG streams (to CPU memory); ``api`` names the caller in restore errors;
    ``parameters=False`` leaves out the parameters' values, for steps that do not change them (NOTE [Snapshots
    a step without an optimizer needs])."""
    with spent("snapshots"):
        params = {
            name: (_copy(p) if parameters else None, _copy(p.grad), p.requires_grad)
            for name, p in model.named_parameters(remove_duplicate=False)
        }
        buffers = {name: _copy(b) for name, b in model.named_buffers(remove_duplicate=False)}
        training = {name: m.training for name, m in model.named_modules(remove_duplicate=False)}
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        own = {id(g): (g, g.get_state()) for m in model.modules() for g in vars(m).values() if _generator(g)}
        watch = None if parameters else ParameterWrites(model)
    return ModelState(
        model, params, buffers, training, torch.get_rng_state(), cuda_rng, host_rng(), watch, tuple(own.values()), api
    )


def _set_state(gen: torch.Generator, state: torch.Tensor) -> None:
    gen.set_state(state)


def _generator(value: Any) -> bool:
    return isinstance(value, torch.Generator) and value is not torch.default_generator


def host_rng() -> tuple[Any, Any]:
    """Python's ``random`` state and NumPy's global RNG state (None where NumPy is not imported)."""
    numpy = sys.modules.get("numpy")
    return random.getstate(), None if numpy is None else numpy.random.get_state()


def set_host_rng(state: tuple[Any, Any]) -> None:
    python, numpy_state = state
    if python is not None:
        random.setstate(python)
    numpy = sys.modules.get("numpy")
    if numpy is not None and numpy_state is not None:
        numpy.random.set_state(numpy_state)


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """Hold back SIGINT (Ctrl-C) inside; one that arrived is handled on exit, as it would have been."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        # only the main thread receives signals and may set a handler; None: one set outside Python, kept
        yield
        return
    caught: list[tuple[int, Any]] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            if callable(previous):
                previous(*caught[0])  # the default handler raises KeyboardInterrupt here
            elif previous == signal.SIG_DFL:
                signal.raise_signal(signal.SIGINT)


def restore_all(api: str, restores: tuple[Callable[[], None], ...], pending: BaseException | None = None) -> None:
    """Run every restore, uninterrupted (NOTE above), even when one fails; then tell what failed.

    ``pending``: the exception the body raised. A failure becomes a RematError (chained to
    ``pending``), except that a KeyboardInterrupt or another BaseException that is not an
    Exception keeps going, carrying the failures as notes: Ctrl-C still stops the program.
    """
    failures: list[str] = []
    stop: BaseException | None = None
    try:
        with uninterrupted():
            for restore in restores:
                try:
                    restore()
                except RematError as exc:
                    failures.append(str(exc))
                except Exception as exc:  # noqa: BLE001 (told below, after the other restores)
                    failures.append(f"{api}: failed to restore the model's state ({type(exc).__name__}: {exc}).")
                except BaseException as exc:  # noqa: BLE001 (re-raised below, after the other restores)
                    stop = stop or exc
    except BaseException as exc:  # noqa: BLE001 (the Ctrl-C held back meanwhile, raised below)
        stop = stop or exc
    stop = stop or (pending if pending is not None and not isinstance(pending, Exception) else None)
    if stop is not None:
        for failure in failures:
            stop.add_note(failure)
        if stop is not pending:
            raise stop
        return
    if failures:
        raise RematError(" ".join(failures))


@contextlib.contextmanager
def restoring(api: str, *restores: Callable[[], None]) -> Iterator[None]:
    """Run ``restores`` when the body ends, however it ends (NOTE [Restores run whatever stops the step])."""
    try:
        yield
    except BaseException as exc:
        restore_all(api, restores, exc)
        raise
    restore_all(api, restores)

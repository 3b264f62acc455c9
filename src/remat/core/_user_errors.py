"""Errors raised by the user's model while remat runs it, told with where and when.

NOTE [Which step, which block]
``remat.profile``, ``remat.measure`` and ``remat.auto`` run training steps of the
user's model; an exception from it, passed on raw, would say nothing of it having
happened inside remat's step, in which block, or that the model was restored. The
error is wrapped in a RematError naming the step and the innermost module of the
model on the traceback (and the block it belongs to), with the original as
``__cause__``. remat's own errors pass through as they are; a ``torch.OutOfMemoryError``
becomes ``remat.errors.OutOfMemory``, still one (NOTE [Out of memory, told and still caught]).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from types import TracebackType

import torch
from torch import nn

from remat.core._hf import CACHE_OFF, ran_without_cache
from remat.core._step import input_tensors
from remat.core.checkpoint import is_wrapped
from remat.errors import OutOfMemory, RecomputeError, RematError


def _innermost_module(model: nn.Module, tb: TracebackType | None) -> str | None:
    """The qualified name of the deepest module of ``model`` whose method is on the traceback."""
    names = {id(m): n for n, m in model.named_modules()}
    found = None
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if owner is not None and id(owner) in names:
            found = names[id(owner)]
        tb = tb.tb_next
    return found


def first_line(exc: BaseException) -> str:
    """The first line of what ``exc`` says, for a message that goes on after it ("no message" if it says nothing)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no message"


def where_raised(model: nn.Module, exc: BaseException, blocks: Iterable[str] = ()) -> str:
    """`` in block 'b' (module 'b.m')``, `` in module 'm'``, `` in Model.forward`` or ``""`` (outside the model: the
    loss, say)."""
    module = _innermost_module(model, exc.__traceback__)
    if module is None:
        return ""
    if module == "":
        return f" in {type(model).__name__}.forward" + (" (outside every block)" if blocks else "")
    block = next((b for b in blocks if module == b or module.startswith(b + ".")), None)
    if block is None:
        return f" in module {module!r}"
    return f" in block {block!r}" + (f" (module {module!r})" if module != block else "")


@contextlib.contextmanager
def model_errors(model: nn.Module, api: str, step: str, blocks: Iterable[str] = ()) -> Iterator[None]:
    """Re-raise an exception from ``model`` during ``step`` as a RematError (NOTE above)."""
    try:
        yield
    except RecomputeError as exc:  # already says what failed; add where, from the model's own exception
        where = where_raised(model, exc.__cause__, list(blocks)) if exc.__cause__ is not None else ""
        raise RecomputeError(f"{api}: recomputation{where} failed during {step}: {exc}") from exc.__cause__
    except RematError:
        raise
    except torch.OutOfMemoryError as exc:
        reason = first_line(exc)
        raise OutOfMemory(
            f"{api}: {step} ran out of device memory ({reason}). The model was restored. To plan for the memory you "
            "have, call remat.auto(model, inputs, budget), which profiles on fake tensors when the step without "
            "checkpointing does not fit, or profile with fake=True (nothing is allocated); or lower the batch size."
        ) from exc
    except Exception as exc:
        told = str(exc).rstrip().rstrip(".")  # the sentence goes on after it
        cache = f" ({CACHE_OFF})" if ran_without_cache(model, exc) else ""
        raise RematError(
            f"{api}: the training step raised {type(exc).__name__}{where_raised(model, exc, list(blocks))} during "
            f"{step}: {told}. The model was restored; fix the error (run one step yourself, or see this error's "
            f"__cause__, for the full traceback){cache}, then call again."
        ) from exc


def require_module(model: object, api: str) -> None:
    """A RematError unless ``model`` is an ``nn.Module`` (remat finds blocks and restores state through it)."""
    if not isinstance(model, nn.Module):
        hint = (
            " (a function: wrap it in an nn.Module, or checkpoint it with remat.checkpoint)" if callable(model) else ""
        )
        raise RematError(f"{api}: model must be a torch.nn.Module, got {type(model).__name__}{hint}.")


def checkpointed_modules(model: nn.Module) -> list[str]:
    """Names of the modules of ``model`` that remat.wrap checkpoints (the blocks of a measured step)."""
    return [n for n, m in model.named_modules() if is_wrapped(m)]


def check_devices(model: nn.Module, inputs: object, api: str) -> None:
    """A RematError when every parameter sits on one device and an input tensor on another."""
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1:
        return  # no parameters, or a model spread over devices on purpose
    (device,) = devices
    stray = next((t.device for t in input_tensors(inputs) if t.device != device), None)
    if stray is not None:
        raise RematError(
            f"{api}: the model's parameters are on {device} but an input tensor is on {stray}; move the inputs "
            f"with .to({str(device)!r}) (or the model with model.to({str(stray)!r}))."
        )

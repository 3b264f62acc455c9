"""MODEL on the command line: a zoo name with options, or ``path/to/file.py:factory``.

A factory returns ``(model, inputs)``, ``(model, inputs, loss_fn)`` or a
:class:`remat.zoo.ZooModel`; the model options given on the command line are passed
to it as keyword arguments, as they are to the zoo builders.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import inspect
import re
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from remat.core._typing import Inputs, LossFn
from remat.errors import RematError

#: Flags mapped to the zoo builders' keyword arguments of the same name.
ZOO_FLAGS = ("layers", "hidden", "heads", "seq", "batch", "image", "vocab")
_EXPECTED = "(model, inputs), (model, inputs, loss_fn) or a remat.zoo.ZooModel"


@dataclass
class Loaded:
    """A model ready for a training step, and what it was built from."""

    label: str
    """The MODEL argument, for messages and titles."""
    model: nn.Module
    inputs: Inputs
    loss_fn: LossFn | None
    options: dict[str, Any]
    """The options it was built with (only those given on the command line)."""


def add_model_options(parser: argparse.ArgumentParser, *, batch: bool = True) -> None:
    """The zoo-sizing flags and ``--opt KEY=VALUE``."""
    group = parser.add_argument_group("model options (passed to the zoo builder or the factory; only those given)")
    for name in ZOO_FLAGS:
        if name != "batch" or batch:
            group.add_argument(f"--{name}", type=int, metavar="N")
    group.add_argument(
        "--opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other builder keyword, e.g. --opt dropout=0.0 --opt depths=1,1",
    )


def _literal(text: str) -> Any:
    # Numbers, tuples ("1,1") and booleans as Python reads them; anything else is a string.
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def model_options(args: argparse.Namespace) -> dict[str, Any]:
    """The model options given on the command line (``--opt`` wins over a flag of the same name)."""
    options = {k: getattr(args, k) for k in ZOO_FLAGS if getattr(args, k, None) is not None}
    for item in args.opt:
        key, sep, value = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise RematError(f"remat: --opt {item!r} is not KEY=VALUE; write e.g. --opt dropout=0.0.")
        options[key.strip()] = _literal(value.strip())
    return options


def is_factory(spec: str) -> bool:
    """True for ``file.py:factory`` (and anything path-like), False for a zoo name."""
    return ":" in spec or spec.endswith(".py") or "/" in spec or "\\" in spec


def check_zoo_name(spec: str) -> None:
    """Refuse an unknown zoo name before any slow work."""
    from remat.zoo import names

    if spec not in names():
        raise RematError(
            f"remat: unknown model {spec!r}; known models: {', '.join(names())}, or give path/to/file.py:factory."
        )


def _import_file(path_text: str) -> types.ModuleType:
    path = Path(path_text)
    if not path.is_file():
        raise RematError(f"remat: model file {path_text!r} does not exist; give path/to/file.py:factory.")
    name = "_remat_model_" + re.sub(r"\W", "_", path.stem)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RematError(f"remat: cannot import {path_text!r} as Python; give path/to/file.py:factory.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up here
    sys.path.insert(0, str(path.resolve().parent))  # so the file can import its neighbours
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise RematError(f"remat: importing {path_text} raised {type(exc).__name__}: {exc}") from exc
    return module


def _factory(spec: str) -> Callable[..., Any]:
    path_text, _, name = spec.rpartition(":")
    if not path_text or not name:
        raise RematError(
            f"remat: {spec!r} names no factory; give path/to/file.py:factory, the function that returns {_EXPECTED}."
        )
    module = _import_file(path_text)
    factory = getattr(module, name, None)
    if not callable(factory):
        found = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module.__name__)
        raise RematError(
            f"remat: {path_text} has no function {name!r}; functions defined there: {', '.join(found) or 'none'}."
        )
    return factory


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} ({', '.join(type(v).__name__ for v in value)})"
    return f"a {type(value).__name__}"


def _unpack(result: Any, spec: str) -> tuple[nn.Module, Inputs, LossFn | None]:
    from remat.zoo import ZooModel

    if isinstance(result, ZooModel):
        result = (result.model, result.inputs, result.loss_fn)
    if isinstance(result, (tuple, list)) and len(result) in (2, 3):
        model, inputs, loss_fn = (*result, None)[:3]
        if isinstance(model, nn.Module) and (loss_fn is None or callable(loss_fn)):
            return model, inputs, loss_fn
    raise RematError(
        f"remat: {spec} returned {_describe(result)}; it must return {_EXPECTED}, "
        "with model an nn.Module and loss_fn callable."
    )


def _call_factory(spec: str, options: dict[str, Any]) -> tuple[nn.Module, Inputs, LossFn | None]:
    factory = _factory(spec)
    try:
        inspect.signature(factory).bind(**options)
    except TypeError:
        raise RematError(
            f"remat: {spec} does not take the options {sorted(options)}; its signature is "
            f"{spec.rpartition(':')[2]}{inspect.signature(factory)}."
        ) from None
    except ValueError:
        pass  # builtins without a signature: let the call decide
    try:
        result = factory(**options)
    except RematError:
        raise
    except Exception as exc:
        raise RematError(f"remat: {spec} raised {type(exc).__name__}: {exc}") from exc
    return _unpack(result, spec)


def _retarget(loss_fn: LossFn | None, convert: Callable[[torch.Tensor], torch.Tensor]) -> LossFn | None:
    # Loss functions close over their targets (the zoo's labels, most factories' too); a
    # model moved to another device needs them there as well. A new function is made,
    # the caller's is left as it was.
    if not isinstance(loss_fn, types.FunctionType) or not loss_fn.__closure__:
        return loss_fn
    cells = []
    for cell in loss_fn.__closure__:
        try:
            contents = cell.cell_contents
        except ValueError:  # a cell not yet filled
            cells.append(cell)
            continue
        cells.append(types.CellType(tree_map(lambda t: convert(t) if isinstance(t, torch.Tensor) else t, contents)))
    moved = types.FunctionType(
        loss_fn.__code__, loss_fn.__globals__, loss_fn.__name__, loss_fn.__defaults__, tuple(cells)
    )
    moved.__kwdefaults__ = loss_fn.__kwdefaults__
    return moved


def check_device(device: str | None) -> None:
    """Refuse a device this machine does not have, before any slow work."""
    if device is None or device == "cpu":
        return
    if not re.fullmatch(r"cuda(:\d+)?", device):
        raise RematError(f"remat: --device {device!r} is not a device; use cpu or cuda (cuda:N).")
    if not torch.cuda.is_available():
        raise RematError(
            f"remat: --device {device}: CUDA is not available here (torch {torch.__version__}, "
            f"CUDA build: {torch.version.cuda or 'none'}); use --device cpu, or --fake --target h100 to plan "
            "for a GPU without one."
        )
    index = torch.device(device).index
    if index is not None and index >= torch.cuda.device_count():
        raise RematError(f"remat: --device {device}: this machine has {torch.cuda.device_count()} CUDA devices.")


def _to_device(loaded: Loaded, device: str) -> Loaded:
    move = lambda t: t.to(device)  # noqa: E731
    loaded.model.to(device)
    loaded.inputs = tree_map(lambda t: move(t) if isinstance(t, torch.Tensor) else t, loaded.inputs)
    loaded.loss_fn = _retarget(loaded.loss_fn, move)
    return loaded


def _build_zoo(spec: str, options: dict[str, Any], *, fake: bool) -> Loaded:
    from remat.zoo import build

    if not fake:
        zoo = build(spec, **options)
        return Loaded(spec, zoo.model, zoo.inputs, zoo.loss_fn, options)
    # Planning without allocating: weights and inputs on the meta device (the fake profile
    # needs only shapes). Labels a loss closes over are used as data by the fake run,
    # so they become CPU zeros of their shape (valid class indices, a few bytes).
    with torch.device("meta"):
        zoo = build(spec, **options)
    zeros = lambda t: torch.zeros(t.shape, dtype=t.dtype) if t.is_meta else t  # noqa: E731
    return Loaded(spec, zoo.model, zoo.inputs, _retarget(zoo.loss_fn, zeros), options)


def load_model(spec: str, options: dict[str, Any], *, device: str | None = None, fake: bool = False) -> Loaded:
    """Build MODEL; with ``device`` move model, inputs and the loss's targets there."""
    if is_factory(spec):
        loaded = Loaded(spec, *_call_factory(spec, options), options)
    else:
        check_zoo_name(spec)
        loaded = _build_zoo(spec, options, fake=fake)
    return _to_device(loaded, device) if device is not None else loaded

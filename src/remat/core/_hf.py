"""Hugging Face specifics.

transformers models append to a KV cache in every forward when
``config.use_cache`` is on, also in training. A checkpointed layer recomputes on a copy
of the cache as it found it (NOTE [Caches in recomputation] in remat.core._caches), but
the cache itself keeps every layer's keys and values for the whole step, which a plan
made to save memory should not: remat turns the cache off on every config of the model
while a plan is on it, as transformers' own gradient checkpointing does, and turns it
back on when the plan is removed.

NOTE [LayerDrop while planning]
LayerDrop (BART, Whisper, Wav2Vec2, ... with ``layerdrop > 0``) skips each layer of a
stack at random in training: ``if torch.rand([]) < self.layerdrop: continue``. A step
profiled and verified on one draw plans for the layers that draw ran, and a later step
that runs more of them keeps more: 1.25-1.64x the budget on BART, without a word. And a
fake profile cannot take the branch at all (a random value has no shadow). Skipping a
layer only ever keeps less, so remat profiles and verifies the step in which every layer
runs: while it does, each LayerDrop probability it finds (a module's or a config's
attribute whose name holds ``layerdrop``, a float in (0, 1]; every transformers model names
it so) is 0, and it is put back afterwards. A plan of that step holds whichever layers a
later step skips. Branches on random draws it cannot turn off are found as the step runs
(NOTE [Branches on random draws] in ``remat.profiling._random_branches``).

NOTE [LayerDrop and nested segments]
That holds for plans one level deep, where each block is its own region: a skipped layer is
a region that does not run. A nested segment runs its blocks as one region from its first
block's call (NOTE [How a run of blocks becomes one region] in ``remat.core._segment``), so
it cannot skip one: a layer skipped inside it ran anyway, and a skipped first block left the
next one called with another input, which the segment refuses mid-training. Verification
did not see it, since LayerDrop is off while it runs: on wav2vec2 (``layerdrop`` 0.1 by
default, 4 layers) ``remat.auto`` at its floor applied a verified plan with two segments
whose later steps computed other losses and gradients. So a profile records the model's
LayerDrop settings (``Profile.skips_layers``), the planner makes no nested segment for it,
and ``remat.apply`` refuses segments on a model with LayerDrop on.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn

from remat.errors import RematError

log = logging.getLogger("remat")

_SAVED = "_remat_saved_use_cache"


class _Config(Protocol):
    """What remat touches on a transformers config (found by duck typing: transformers is not imported)."""

    use_cache: bool


def _configs(model: nn.Module) -> list[_Config]:
    """Every distinct config of ``model``: each submodule's ``config`` and the configs nested in them.

    NOTE [Every config, not only the top one]
    An encoder-decoder such as T5 gives its decoder stack a config of its own
    (``copy.deepcopy(config)``), and composite models keep ``text_config`` /
    ``decoder`` configs inside theirs. A stack reads its own ``use_cache`` when the
    caller passes none, so turning off only the top-level flag leaves the decoder
    appending to its cache in recomputation.
    """
    found: dict[int, _Config] = {}
    pending = [getattr(m, "config", None) for m in model.modules()]
    while pending:
        config = pending.pop()
        if config is None or id(config) in found or not hasattr(config, "use_cache"):
            continue
        found[id(config)] = config
        pending.extend(v for v in vars(config).values() if hasattr(v, "use_cache") and hasattr(v, "to_dict"))
    return list(found.values())


def _layerdrop_settings(model: nn.Module) -> list[tuple[object, str]]:
    """Every (owner, attribute) of ``model`` holding a LayerDrop probability above 0 (NOTE [LayerDrop while
    planning]): attributes of its modules, of their configs and of the configs nested in them."""
    owners: dict[int, object] = {}
    pending: list[object] = [*model.modules(), *(getattr(m, "config", None) for m in model.modules())]
    while pending:
        owner = pending.pop()
        if owner is None or id(owner) in owners:
            continue
        owners[id(owner)] = owner
        if not isinstance(owner, nn.Module):  # a config: its sub-configs (text_config, encoder, ...)
            pending.extend(v for v in vars(owner).values() if hasattr(v, "to_dict"))
    found = []
    for owner in owners.values():
        for name, value in list(vars(owner).items()):
            if "layerdrop" in name.lower() and type(value) is float and 0 < value <= 1:  # a probability
                found.append((owner, name))
    return found


def layerdrop_settings(model: nn.Module) -> tuple[str, ...]:
    """``model``'s LayerDrop probabilities above 0, for messages: ``"Wav2Vec2Config.layerdrop = 0.1"``."""
    found = _layerdrop_settings(model)
    return tuple(f"{type(owner).__name__}.{name} = {getattr(owner, name)}" for owner, name in found)


@contextlib.contextmanager
def every_layer_runs(model: nn.Module) -> Iterator[None]:
    """While active, LayerDrop skips no layer of ``model`` (NOTE [LayerDrop while planning])."""
    settings = [(owner, name, getattr(owner, name)) for owner, name in _layerdrop_settings(model)]
    if settings:
        log.info(
            "remat: LayerDrop off on %d setting(s) of %s while remat runs its steps",
            len(settings),
            type(model).__name__,
        )
    try:
        for owner, name, _ in settings:
            setattr(owner, name, 0.0)
        yield
    finally:
        for owner, name, value in settings:
            setattr(owner, name, value)


def disable_cache(model: nn.Module) -> None:
    """Turn ``use_cache`` off on every config of ``model`` until :func:`restore_cache` (idempotent)."""
    if _SAVED in model.__dict__:
        return
    on = [c for c in _configs(model) if getattr(c, "use_cache", False)]
    if on:
        log.info(
            "remat: setting use_cache = False on %d config(s) of %s while checkpointing", len(on), type(model).__name__
        )
        model.__dict__[_SAVED] = on
        for config in on:
            config.use_cache = False


def restore_cache(model: nn.Module) -> None:
    for config in model.__dict__.pop(_SAVED, ()):
        config.use_cache = True


CACHE_OFF = (
    "remat ran this step with use_cache=False on the model's config(s), as checkpointing needs (transformers' own "
    "gradient checkpointing does the same); if your steps run only with use_cache=True, the model's path without a "
    "cache is what fails: run two steps with use_cache=False to see it without remat"
)
"""Said of an error the model raised while remat had its cache off: a model may fail only there (transformers
4.57's RecurrentGemma reads the previous step's recurrent state, already backpropagated, without a cache)."""


def ran_without_cache(model: nn.Module, exc: BaseException) -> bool:
    """Whether ``exc`` came from a step remat ran with the model's cache off (a plan on it, or a profile)."""
    return _SAVED in model.__dict__ or CACHE_OFF in getattr(exc, "__notes__", ())


@contextlib.contextmanager
def cache_disabled(model: nn.Module) -> Iterator[None]:
    already = _SAVED in model.__dict__
    try:
        disable_cache(model)
        yield
    except Exception as exc:
        # the model's own errors only: remat's say what they are, and running out of memory is not the cache's doing
        told = isinstance(exc, (RematError, torch.OutOfMemoryError)) or CACHE_OFF in getattr(exc, "__notes__", ())
        if not already and _SAVED in model.__dict__ and not told:
            exc.add_note(CACHE_OFF)  # read by remat's message of the error (remat.core._user_errors)
        raise
    finally:
        if not already:
            restore_cache(model)


@contextlib.contextmanager
def fake_tensors_untraced() -> Iterator[None]:
    """While active, transformers does not treat fake tensors as a sign of tracing.

    transformers (5.x, ``utils.import_utils.is_tracing``) takes its tracing path when it
    sees a FakeTensor: explicit causal masks and repeated K/V heads, which a GPU step
    does not build. A fake profile stands in for a real step, so it wants the real
    path; the data-dependent checks on that path read the values kept by
    ``remat.profiling._shadow`` (NOTE [Value shadows]). Nothing is patched when
    transformers is not imported or has no such check.
    """
    module = sys.modules.get("transformers.utils.import_utils")
    original = getattr(module, "is_fake_tensor", None)
    if module is None or original is None:
        yield
        return
    module.__dict__["is_fake_tensor"] = lambda x: False
    try:
        yield
    finally:
        module.__dict__["is_fake_tensor"] = original

"""Hugging Face specifics.

transformers models append to a KV cache in every forward when
``config.use_cache`` is on, also in training. Recomputation would append twice
(and selective recomputation fails on the extra slice), so remat turns the cache
off while it checkpoints, as transformers' own gradient checkpointing does.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

from torch import nn

log = logging.getLogger("remat")

_SAVED = "_remat_saved_use_cache"


def disable_cache(model: nn.Module) -> None:
    """Turn ``config.use_cache`` off until :func:`restore_cache` (idempotent)."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False) and _SAVED not in model.__dict__:
        log.info("remat: setting %s.config.use_cache = False while checkpointing", type(model).__name__)
        model.__dict__[_SAVED] = True
        config.use_cache = False


def restore_cache(model: nn.Module) -> None:
    if model.__dict__.pop(_SAVED, False):
        model.config.use_cache = True


@contextlib.contextmanager
def cache_disabled(model: nn.Module) -> Iterator[None]:
    already = _SAVED in model.__dict__
    disable_cache(model)
    try:
        yield
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
    if original is None:
        yield
        return
    module.is_fake_tensor = lambda x: False
    try:
        yield
    finally:
        module.is_fake_tensor = original

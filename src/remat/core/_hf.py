"""Hugging Face specifics.

transformers models append to a KV cache in every forward when
``config.use_cache`` is on, also in training. Recomputation would append twice
(and selective recomputation fails on the extra slice), so remat turns the cache
off while it checkpoints, as transformers' own gradient checkpointing does.
"""

from __future__ import annotations

import contextlib
import logging
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

"""remat: activation checkpointing for PyTorch that is correct by construction,
chosen automatically under a memory budget, and measured honestly."""

from remat._region import is_recomputing
from remat.checkpoint import POLICIES, SAVE_OPS, checkpoint, is_wrapped, unwrap, wrap
from remat.errors import RematError
from remat.measure import Measurement, measure

__version__ = "0.1.0"

__all__ = [
    "POLICIES",
    "SAVE_OPS",
    "Measurement",
    "RematError",
    "checkpoint",
    "is_recomputing",
    "is_wrapped",
    "measure",
    "unwrap",
    "wrap",
]

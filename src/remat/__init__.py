"""remat: activation checkpointing for PyTorch that is correct by construction,
chosen automatically under a memory budget, and measured honestly."""

from remat import distributed
from remat.core._recomputing import is_recomputing
from remat.core.checkpoint import POLICIES, SAVE_OPS, checkpoint, is_wrapped, unwrap, wrap
from remat.core.measure import Measurement, measure
from remat.diagnosis.doctor import DoctorReport, Finding, doctor
from remat.errors import RecomputeError, RematError
from remat.planning.apply import apply, auto, remove
from remat.planning.plan import Plan, parse_budget, plan
from remat.profiling._types import BlockProfile, Profile
from remat.profiling.profile import profile

__version__ = "0.1.0"

__all__ = [
    "POLICIES",
    "SAVE_OPS",
    "DoctorReport",
    "Finding",
    "BlockProfile",
    "Measurement",
    "Plan",
    "Profile",
    "RecomputeError",
    "RematError",
    "apply",
    "auto",
    "checkpoint",
    "distributed",
    "doctor",
    "is_recomputing",
    "is_wrapped",
    "measure",
    "parse_budget",
    "plan",
    "profile",
    "remove",
    "unwrap",
    "wrap",
]

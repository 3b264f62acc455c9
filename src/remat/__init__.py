"""remat: activation checkpointing for PyTorch that is correct by construction,
chosen automatically under a memory budget, and measured honestly."""

from remat import distributed
from remat._region import is_recomputing
from remat.apply import apply, auto, remove
from remat.checkpoint import POLICIES, SAVE_OPS, checkpoint, is_wrapped, unwrap, wrap
from remat.doctor import DoctorReport, Finding, doctor
from remat.errors import RematError
from remat.measure import Measurement, measure
from remat.plan import Plan, parse_budget, plan
from remat.profile import BlockProfile, Profile, profile

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

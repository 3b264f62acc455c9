"""What ``remat.checkpoint`` tells when a function fails while rerun in backward (``RecomputeError``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from remat.core._host_rng import _name_of
from remat.core._policies import policy_function
from remat.core._region import Region
from remat.errors import RecomputeError

__all__ = ["recompute_failure"]

#: What torch's selective checkpoint says when asked for an output it handed to a recomputation already.
_SAC_ONCE = ("Trying to backward an extra time", "encountered during backward but not found in storage")


def recompute_failure(fn: Callable, policy: Any, region: Region, exc: Exception) -> RecomputeError:
    """What to tell when ``fn`` failed while rerun in backward."""
    name = _name_of(fn)
    again = region.recomputations > 1 or not region.forward_done
    if (
        policy_function(policy) is not None
        and isinstance(exc, RuntimeError)
        and (_SAC_ONCE[0] in str(exc) or (again and _SAC_ONCE[1] in str(exc)))
    ):
        return RecomputeError(
            f"remat.checkpoint: {name} was recomputed more than once (backward twice with retain_graph=True, "
            "a double backward with create_graph=True, or torch.autograd.grad inside the function), which "
            f"policy={policy!r} cannot do: torch's selective checkpoint hands each output it keeps to one "
            f"recomputation only, and torch's own checkpoint with this policy fails the same way ({exc}). "
            "Use policy='full' for this function: it recomputes as often as backward asks."
        )
    return RecomputeError(
        f"remat.checkpoint: {name} failed when rerun in backward ({type(exc).__name__}: {exc}). The function "
        "must compute the same thing again: a forward side effect (a Hugging Face KV cache that a module "
        "holds rather than takes as an argument: pass use_cache=False, or set it to False on every config "
        "of the model, e.g. model.config and model.decoder.config; remat.apply does that; a counter or "
        "cache of your own: guard it with `if not remat.is_recomputing()`) "
        "or data-dependent control flow changed it."
    )

"""One real step of a plan, as ``remat.auto`` verifies it: its peak, what it computed, and out-of-memory
as an answer (NOTE [Out of memory is an answer])."""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.core._costs import spent
from remat.core._fingerprint import Fingerprint, fingerprint
from remat.core._hf import every_layer_runs
from remat.core._loop import NO_LOOP, Loop, OptimizerSnapshot
from remat.core._memtrack import empty_device_cache
from remat.core._state import capture, restoring
from remat.core._step import set_training
from remat.core._user_errors import first_line, model_errors
from remat.core.measure import compiled_peak, device_of, measure_peak
from remat.errors import OutOfMemory as TheStepRanOut
from remat.errors import RematError
from remat.planning._put import put
from remat.planning.plan import Plan
from remat.profiling._fake_learning import learn_on_fake_tensors
from remat.profiling._format import human_bytes

__all__ = ["OutOfMemory", "Step", "measured_step", "out_of_memory_reason"]


class OutOfMemory(RematError):
    """A step auto ran did not fit the device (NOTE [Out of memory is an answer])."""


# NOTE [Out of memory is an answer]
# A step that raises torch.OutOfMemoryError (torch.cuda.OutOfMemoryError is the same
# class) was over the memory the device has, which for auto means over the budget: it is
# a measurement, not a failure of the model. The step's snapshot puts parameters,
# gradients, buffers, RNG and optimizer back, the failed step's tensors are collected and
# the CUDA allocator's cache emptied (its blocks would crowd the next step), and auto
# tries a lower plan: halfway from the failed plan's predicted peak to the lowest peak,
# then the lowest-peak plan, then a RematError with the numbers. The plan is taken off
# the model whatever happens (NOTE [Within the budget] in remat.planning._within).


@dataclass(frozen=True)
class Step:
    """What one verification step measured."""

    peak: int
    """Allocated peak, bytes (``remat.measure``'s)."""
    summary: Fingerprint | None = None
    """What the step computed (None: compiled)."""
    reserved: int | None = None
    """The CUDA caching allocator's reserved peak, bytes (None: not CUDA, or compiled)."""


def measured_step(
    model: nn.Module, inputs: Any, loss_fn: Any, plan: Plan, backend: str | None = None, loop: Loop = NO_LOOP
) -> Step:
    """One real step of ``loop`` with ``plan`` applied, in the plan's mode (compiled with ``backend`` if given,
    then without a summary); model and optimizer restored. A step that runs out of device memory raises
    :class:`OutOfMemory` (NOTE [Out of memory is an answer])."""
    try:
        with spent("verification steps"):
            return _step(model, inputs, loss_fn, plan, backend, loop)
    except torch.OutOfMemoryError as exc:  # torch.cuda.OutOfMemoryError is the same class
        reason = out_of_memory_reason(exc)
    # the failed step's tensors are garbage now: free them, then give the allocator's cache back
    gc.collect()
    empty_device_cache()
    checkpointed = ", ".join(sorted(plan.checkpointed)) or "none"
    raise OutOfMemory(
        f"remat.auto: a step with blocks {checkpointed} checkpointed (predicted peak "
        f"{human_bytes(plan.predicted_peak_bytes)}) ran out of device memory ({reason}); the model was restored."
    )


def out_of_memory_reason(exc: BaseException) -> str:
    """The first line of what the device said when it ran out (under remat's own telling of it)."""
    return first_line(exc.__cause__ if isinstance(exc, TheStepRanOut) and exc.__cause__ is not None else exc)


def _step(model: nn.Module, inputs: Any, loss_fn: Any, plan: Plan, backend: str | None, loop: Loop) -> Step:
    put(model, plan)
    # NOTE [Snapshots a step without an optimizer needs]
    state = capture(model, "remat.auto", parameters=loop.optimizer is not None)
    optimizer_state = OptimizerSnapshot(loop.optimizer, "remat.auto")
    with (
        restoring("remat.auto", state.restore, optimizer_state.restore),
        every_layer_runs(model),  # NOTE [LayerDrop while planning]
        model_errors(model, "remat.auto", "the step that verifies the plan", plan.checkpointed),
    ):
        set_training(model, plan.training)  # NOTE [Training mode keeps the modules the user froze]
        if backend is not None:
            return Step(compiled_peak(model, inputs, loss_fn, backend=backend, loop=loop))
        learn_on_fake_tensors(model, inputs, loss_fn, plan.checkpointed)  # NOTE [Blocks a profile never ran]
        peak, _, loss = measure_peak(model, inputs, loss_fn, loop)
        device = device_of(model, inputs)
        # NOTE [Fitting a device]: measure_peak reset the peaks at the step's start
        reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None
        return Step(peak, fingerprint(model, loss), reserved)

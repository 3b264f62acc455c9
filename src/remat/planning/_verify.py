"""What ``remat.auto`` verifies with real steps: a plan's measured peak, and that it trains the same function.

NOTE [Verify when it can]
The peak model is exact on chains of blocks; data flow it does not follow (a
block's output used by the loss, tensors shared by every block) can make a plan
peak higher than predicted. With ``verify`` (the default, real tensors only),
auto measures one real step with the plan applied. Over the budget, it re-plans
with the measured error as a margin (at most ``REPLANS`` times), then tries the
lowest-peak plan; if none fits, it removes the plan and raises a RematError with
the measured numbers. ``plan.measured_peak_bytes`` holds the figure; fake-tensor
plans are not measured (``plan.verified`` is False).

NOTE [A verified plan trains the same function]
A plan can fit its budget and still compute something else: a nested segment runs
its blocks as one region, which is another function when the parent does more
between the blocks than hand each output to the next. The segment refuses what it
can see (``remat.core._segment``); for the rest, every eager step auto verifies is
compared with the step without checkpointing, from the same state: the loss, every
gradient and every buffer after the step (``remat.core._fingerprint``; bit for bit on
the CPU or with deterministic algorithms, within a tolerance elsewhere). A nested
plan that differs is replaced by its one-level twin; a one-level plan that differs is
refused with a RematError naming the blocks whose gradients differ. The plan's notes
say what was compared.

NOTE [The step verified plans are compared with]
Every plan is compared with the step without checkpointing: a block whose recomputation
computes another function (it rebinds a buffer, ``self.ema = 0.9 * self.ema + ...``; writes a
parameter in place; draws from a ``torch.Generator`` of its own) does so in every plan that
checkpoints it, so comparing plans with one another, the lowest-peak plan (every block
``full``) as the reference, found nothing: ``remat.auto`` called such plans verified while
their gradients differed from the model's. A budget below that step's peak is the reason to
checkpoint, and auto holds no more than the budget (NOTE [Within the budget] in
remat.planning._within): there the step without checkpointing, and each plan's comparison
step, run on a slice of the batch (NOTE [A reference on a slice of the batch] in
remat.planning._sub_batch), each plan's own step on the whole batch giving its peak. It is
measured first, before any faster plan (the low-memory side first). Only where the batch
cannot be sliced (one sample, no first dimension its inputs share, or not even one sample
predicted to fit), or where that step ran out of device memory on its smallest slice (or on the
whole batch, where the step fails on a slice), are plans compared with the lowest-peak one-level
plan, and the notes say what that cannot see: auto raised there, on the device the user has,
while the plan it would have verified fit. If the lowest-peak plan runs out too, auto raises.

NOTE [A traced forward is compared with the model's own]
A traced plan's units are segments of the model's forward as torch.fx recorded it, and
every plan of them, all-keep included, runs that recording. A recording that misses what
the forward does (an autograd Function's own backward, a no_grad region: refused when
traced since, NOTE [What a trace must not miss] in remat.profiling._traced_cut) computes
another function in every plan alike, so a traced plan is compared with the model's class
forward, not with the all-keep traced plan: generated models had trained with gradients of 0
under a verified plan.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from torch import nn

from remat.core._loop import Loop
from remat.core._policy_registry import KEEP
from remat.core.measure import device_of
from remat.errors import RematError
from remat.planning._candidates import Candidates, Findings, Unreachable
from remat.planning._compiled import chain_profile, design, fit, is_chain
from remat.planning._gpu_room import reserved_note
from remat.planning._put import put, remove
from remat.planning._verify_step import OutOfMemory, measured_step
from remat.planning.plan import Plan, parse_budget
from remat.planning.plan import plan as make_plan
from remat.profiling._format import human_bytes

__all__ = ["verified_plan"]

log = logging.getLogger("remat")

#: Re-plans ``auto`` makes with a measured margin before it gives up.
REPLANS = 2


def _compiled_profile(
    model: nn.Module, inputs: Any, loss_fn: Any, prof: Any, backend: str, loop: Loop
) -> tuple[Any, int, str]:
    """(the profile to plan the compiled step with, its compiled peak without checkpointing, a note).

    A chain of blocks gets the fitted compiled chain (NOTE [Predicting compiled peaks]); any other model
    the eager profile, whose peaks the caller scales by the compiled / eager peak without checkpointing.
    """
    names = [b.name for b in prof.blocks]
    keep = make_plan(prof, strategy="none", nested=False)

    def measure(policies: tuple[str, ...]) -> int:
        plan = replace(keep, assignment=dict(zip(names, policies, strict=True)))
        return measured_step(model, inputs, loss_fn, plan, backend, loop).peak

    baseline = measure((KEEP,) * len(names))
    if not is_chain(prof):
        return prof, baseline, "Not a chain of blocks: eager predictions scaled by the compiled peak."
    peaks = {a: measure(a) for a in design(prof.policies, len(names))}
    chained = chain_profile(prof, fit(peaks, prof.resting_bytes), label=f"compiled ({backend})")
    if chained is None:
        raise RuntimeError("chain_profile gave no profile for a chain")
    return chained, baseline, chained.notes[-1]


def verified_plan(
    model: nn.Module,
    inputs: Any,
    loss_fn: Any,
    prof: Any,
    budget: Any,
    backend: str | None,
    loop: Loop,
    findings: Findings,
    *,
    capacity: int | None = None,
) -> Plan:
    """The plan auto applies: measured within ``budget`` in a real step (NOTE [Verify when it can]); with
    ``capacity``, the most the CUDA allocator may reserve, its reserved peak within it too (NOTE [Fitting a
    device] in remat.planning._gpu_room)."""
    # Peaks of the execution verified for (eager, or compiled: NOTE [Plans for compiled execution]).
    baseline = prof.baseline_peak_bytes
    notes: list[str] = []
    scale = 1.0
    if backend is not None:
        eager_baseline = baseline
        planned, baseline, note = _compiled_profile(model, inputs, loss_fn, prof, backend, loop)
        notes += [
            f"Compiled ({backend}) without checkpointing: {human_bytes(baseline)} measured, "
            f"{baseline / eager_baseline:.2f} of the eager peak.",
            note,
        ]
        scale = 1.0 if planned is not prof else eager_baseline / baseline
        prof = planned
        findings.nested = False  # nested regions are not modelled (nor tested) under compile
    execution = "eager" if backend is None else "compiled"
    limit = parse_budget(budget, baseline)
    candidates = Candidates(model, inputs, loss_fn, prof, backend, findings, loop, None if backend else limit)

    def over_capacity(plan: Plan) -> int:
        """Bytes the step's reserved peak is over ``capacity`` (0: it fits, or was not measured)."""
        reserved = candidates.reserved_of(plan)
        return 0 if capacity is None or reserved is None else max(0, reserved - capacity)

    def accept(plan: Plan, measured: int) -> Plan:
        put(model, plan)  # the last step measured may have been another plan's (the reference, a cached one)
        reserved = candidates.reserved_of(plan)
        if reserved is not None:
            notes.append(reserved_note(measured, reserved))
        return replace(
            plan,
            budget_bytes=limit,
            measured_peak_bytes=measured,
            notes=tuple(notes + findings.notes),
            execution=execution,
        )

    if backend is None and baseline > limit:
        _reference_first(candidates, limit)  # NOTE [The step verified plans are compared with]
    target, margin = limit, 0
    for _ in range(REPLANS + 1):
        try:
            candidate = candidates.plan(int(target * scale))
        except RematError:
            break  # the margin leaves no plan: only the lowest-peak plan is left to try
        candidate, measured = candidates.measure(candidate)
        if measured is not None and measured <= limit and not over_capacity(candidate):
            return accept(candidate, measured)
        predicted = int(candidate.predicted_peak_bytes / scale)
        if measured is not None and measured <= limit:  # NOTE [Fitting a device]: reserved is what runs out
            margin = max(margin, over_capacity(candidate))
            target = limit - margin
            notes.append(
                f"A plan measured {human_bytes(measured)} allocated, but the caching allocator reserved "
                f"{human_bytes(over_capacity(candidate))} more than this GPU has for the process: re-planned with "
                f"a margin of {human_bytes(margin)}."
            )
        elif measured is None:  # NOTE [Out of memory is an answer]
            target = min(target, (int(candidates.floor() / scale) + predicted) // 2)
            notes.append(
                f"A plan predicted at {human_bytes(predicted)} ran out of device memory in its step: "
                f"re-planned for {human_bytes(target)}."
            )
        else:
            margin = max(margin, measured - predicted)
            target = limit - margin
            notes.append(
                f"A plan predicted at {human_bytes(predicted)} measured "
                f"{human_bytes(measured)}, over the budget: re-planned with a margin of {human_bytes(margin)}."
            )
        log.warning("remat.auto: %s", notes[-1])
    # The lowest peak of any plan, nested ones included (remat.plan reaches its own min_peak_bytes).
    lowest, measured = candidates.measure(candidates.lowest())
    if measured is not None and measured <= limit and not over_capacity(lowest):
        notes.append("The lowest-peak plan fits the budget.")
        return accept(lowest, measured)
    remove(model)
    predicted = int(lowest.predicted_peak_bytes / scale)
    if measured is None:
        found = f"ran out of device memory in a real step (predicted {human_bytes(predicted)})"
        if predicted <= limit:  # the step fits the budget; what sat beside it did not
            raise Unreachable(_beside_the_step(limit, found, candidates))
    else:
        found = (
            f"measured {human_bytes(measured)} ({measured} bytes) in a real step (predicted {human_bytes(predicted)})"
        )
        if measured <= limit:
            found += f", for which the caching allocator reserved {over_capacity(lowest)} bytes more than the GPU has"
    raise _unreachable(limit, prof, execution, found, predicted if measured is None else measured, baseline)


def _reference_first(candidates: Candidates, limit: int) -> None:
    """Before any other step, refuse a budget below every plan's predicted peak, then measure the step verified
    plans are compared with (the low-memory side first); Unreachable if it does not fit the device."""
    prof, floor = candidates.prof, candidates.floor()
    if floor > limit:  # no step runs: each would be over the budget
        remove(candidates.model)
        raise _unreachable(
            limit,
            prof,
            "eager",
            f"is predicted at {human_bytes(floor)} ({floor} bytes): the budget "
            "is below the lowest peak any plan reaches, so no step was run",
            floor,
        )
    try:
        candidates.reference(candidates.plan(floor))
    except OutOfMemory:
        remove(candidates.model)
        if candidates.reference_plan is None:
            raise RuntimeError("reference() sets its plan before it runs a step") from None
        predicted = candidates.reference_plan.predicted_peak_bytes
        findings = candidates.findings
        samples = findings.samples
        found = (
            f"is predicted at {human_bytes(floor)} ({floor} bytes), and {findings.compared_with}, the step "
            "verified plans are compared with, ran out of device memory "
            + (
                f"(predicted {human_bytes(predicted)}"
                if samples is None
                else f"on its first {samples[0]} of {samples[1]} samples (predicted within the budget there; "
                f"{human_bytes(predicted)} on the whole batch"
            )
            + ")"
            + (f", on the whole batch, not on a slice: {unsliced}" if (unsliced := findings.unsliced) else "")
        )
        # the step (a slice sized to fit, its smallest) fits the budget; what sat beside it did not
        if predicted <= limit or samples is not None:
            raise Unreachable(_beside_the_step(limit, found, candidates)) from None
        raise _unreachable(limit, prof, "eager", found, predicted) from None


def _beside_the_step(limit: int, found: str, candidates: Candidates) -> str:
    """The message for a step predicted within the budget that ran out of device memory all the same."""
    prof = candidates.prof
    snapshot = prof.param_bytes + prof.optimizer_bytes if candidates.loop.optimizer is not None else 0
    on_cpu = device_of(candidates.model, candidates.inputs).type == "cpu"
    beside = (
        f"on the CPU, with an optimizer, auto keeps a copy of the parameters and the optimizer's state "
        f"({human_bytes(snapshot)}) in the same memory to restore them after each verification step (on CUDA it "
        "goes to host memory); "
        if on_cpu and snapshot
        else ""
    )
    return (
        f"remat.auto: budget {human_bytes(limit)} ({limit} bytes) cannot be met on this device: the lowest-peak plan "
        f"{found}, a step within the budget, so the device held more than the step beside it: {beside}tensors the "
        "process holds outside the model and its batch count too. Free that memory, or pass a budget that much below "
        "what the device has: the plan then goes lower by as much."
    )


def _unreachable(
    limit: int, prof: Any, execution: str, found: str, fix: int, baseline: int | None = None
) -> Unreachable:
    baseline = prof.baseline_peak_bytes if baseline is None else baseline
    return Unreachable(
        f"remat.auto: budget {human_bytes(limit)} ({limit} bytes, {limit / baseline:.3f} of the "
        f"{human_bytes(baseline)} {execution} peak without checkpointing) cannot be met: the lowest-peak plan "
        f"{found}. Raise the budget to at least {fix} bytes, or lower the batch size / sequence length."
        + prof.held_by_loop()
    )

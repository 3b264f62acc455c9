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
The step without checkpointing is the reference only when it fits the budget; a budget
below its peak is the reason to checkpoint, and auto holds no more than the budget
(NOTE [Within the budget] in remat.planning._within). Below it, the reference is the
lowest-peak one-level plan (every block at its lowest policy, ``full`` mostly): torch's
checkpoint replays the RNG, so on blocks that recompute the same function it computes
the un-checkpointed step's loss and gradients bit for bit. It is measured first, before
any faster plan (the low-memory side first): if even it runs out of device memory, no
plan can be verified and auto raises. When only nested plans reach the budget it is
still run, over the budget, since a nested segment that computes another function
cannot be told apart without it (the one case auto holds more than the budget).
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from remat.core._costs import spent
from remat.core._fingerprint import Fingerprint, fingerprint
from remat.core._loop import NO_LOOP, Loop, OptimizerSnapshot
from remat.core._memtrack import empty_device_cache
from remat.core._policy_registry import KEEP
from remat.core._segment import NotAChain
from remat.core._state import capture, restoring
from remat.core._user_errors import model_errors
from remat.core.measure import compiled_peak, device_of, measure_peak
from remat.errors import OutOfMemory as TheStepRanOut
from remat.errors import RematError
from remat.planning._compiled import chain_profile, design, fit, is_chain
from remat.planning._gpu_room import reserved_note
from remat.planning._put import put, remove
from remat.planning.plan import Plan, parse_budget
from remat.planning.plan import plan as make_plan
from remat.profiling._format import human_bytes

__all__ = ["Findings", "OutOfMemory", "Unreachable", "out_of_memory_reason", "verified_plan"]

log = logging.getLogger("remat")

#: Re-plans ``auto`` makes with a measured margin before it gives up.
REPLANS = 2


class Unreachable(RematError):
    """No plan on this profile reaches the budget (predicted, or measured by auto's verification)."""


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


@dataclass
class Findings:
    """What auto's verification learned about the model, kept across the profiles of one ``auto`` call."""

    nested: bool = True
    """False once nested segments were found not to run, or not to compute the same, on this model."""
    reference: Fingerprint | None = None
    """The step without checkpointing, summarised (NOTE [A verified plan trains the same function])."""
    notes: list[str] = field(default_factory=list)
    """What was found, for the plan's notes."""
    compared_with: str = "the step without checkpointing"
    """The step verified plans are compared with (NOTE [The step verified plans are compared with])."""


@dataclass(frozen=True)
class Step:
    """What one verification step measured."""

    peak: int
    """Allocated peak, bytes (``remat.measure``'s)."""
    summary: Fingerprint | None = None
    """What the step computed (None: compiled)."""
    reserved: int | None = None
    """The CUDA caching allocator's reserved peak, bytes (None: not CUDA, or compiled)."""


def _measured(
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
    said = str(exc.__cause__ if isinstance(exc, TheStepRanOut) and exc.__cause__ is not None else exc).strip()
    return said.splitlines()[0] if said else "no message"


def _step(model: nn.Module, inputs: Any, loss_fn: Any, plan: Plan, backend: str | None, loop: Loop) -> Step:
    put(model, plan)
    # NOTE [Snapshots a step without an optimizer needs]
    state = capture(model, "remat.auto", parameters=loop.optimizer is not None)
    optimizer_state = OptimizerSnapshot(loop.optimizer, "remat.auto")
    with (
        restoring("remat.auto", state.restore, optimizer_state.restore),
        model_errors(model, "remat.auto", "the step that verifies the plan", plan.checkpointed),
    ):
        if plan.training is not None:
            model.train(plan.training)
        if backend is not None:
            return Step(compiled_peak(model, inputs, loss_fn, backend=backend, loop=loop))
        peak, _, loss = measure_peak(model, inputs, loss_fn, loop)
        device = device_of(model, inputs)
        # NOTE [Fitting a device]: measure_peak reset the peaks at the step's start
        reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None
        return Step(peak, fingerprint(model, loss), reserved)


def _blocks_of(names: list[str], blocks: list[str]) -> list[str]:
    """The blocks that own the parameters and buffers in ``names`` (``grad:blocks.3.fc.weight`` -> blocks.3)."""
    owners = []
    for name in names:
        path = name.partition(":")[2]
        owner = max((b for b in blocks if path.startswith(b + ".")), key=len, default=None)
        if owner is not None and owner not in owners:
            owners.append(owner)
    return owners


class _Candidates:
    """Plans for ``auto`` to measure, nested while the model runs nested segments.

    NOTE [Nested plans on models that are not chains]
    The profile sees a chain of blocks wherever their segments follow one another, but a
    nested segment also needs each block's output to be the next block's only input from
    the parent, unchanged (``remat.core._segment``); the parent's code is only seen when
    the plan runs. When a candidate with segments raises for that reason, or computes
    another function (NOTE [A verified plan trains the same function]), auto plans one
    level deep from then on (the one-level plan for the same budget), and says so in the notes.
    """

    def __init__(
        self,
        model: nn.Module,
        inputs: Any,
        loss_fn: Any,
        prof: Any,
        backend: str | None,
        findings: Findings,
        loop: Loop,
        limit: int | None = None,
    ) -> None:
        self.model, self.inputs, self.loss_fn, self.prof, self.backend = model, inputs, loss_fn, prof, backend
        self.loop = loop
        self.findings = findings
        self.limit = limit
        self.tried: list[tuple[Plan, int | None]] = []
        """Plans measured and their peaks (None: the step ran out of device memory)."""
        self.reserved: dict[int, int] = {}
        """The CUDA allocator's reserved peak of each plan measured on CUDA, by its index in ``tried``."""
        self.reference_plan: Plan | None = None
        """The plan whose step verified plans are compared with (None: the step without checkpointing)."""

    @property
    def nested(self) -> bool:
        return self.findings.nested

    def plan(self, budget: int | None) -> Plan:
        # bytes with their unit: a small model's peak in bytes can be under 1024, which a unitless number is not
        with spent("planning"):
            return make_plan(self.prof, None if budget is None else f"{int(budget)}B", nested=self.nested)

    def lowest(self) -> Plan:
        """The plan at the lowest peak any plan reaches (the nested floor while nesting)."""
        return self.plan(self.floor())

    def floor(self) -> int:
        """The lowest peak any plan is predicted to reach (nested ones while nesting)."""
        with spent("planning"):
            return make_plan(self.prof, strategy="none", nested=self.nested).min_peak_bytes

    def measure(self, plan: Plan) -> tuple[Plan, int | None]:
        """(the plan measured, its peak; None if it ran out of device memory): ``plan``, or its one-level twin
        if its segments cannot run."""
        same = [m for p, m in self.tried if (p.assignment, p.segments) == (plan.assignment, plan.segments)]
        if same:
            return plan, same[0]
        try:
            step = _measured(self.model, self.inputs, self.loss_fn, plan, self.backend, self.loop)
        except OutOfMemory as err:  # NOTE [Out of memory is an answer]
            log.info("%s", err)
            self.tried.append((plan, None))
            return plan, None
        except RematError as err:
            if not plan.segments:
                raise
            reason = str(err) if isinstance(err, NotAChain) else f"a step with them failed: {err}"
            return self._one_level(
                plan, f"Nested segments do not run on this model ({reason}); planned one level deep."
            )
        differ = self._differences(plan, step.summary)
        if differ and plan.segments:
            return self._one_level(
                plan,
                f"Nested segments {_spans(plan)} changed the step's {_what(differ)} "
                "(the parent does more between the blocks than pass each output on): "
                "planned one level deep.",
            )
        if differ:
            blocks = _blocks_of(differ, [b.name for b in self.prof.blocks])
            remove(self.model)
            raise RematError(
                f"remat.auto: with blocks {', '.join(sorted(plan.checkpointed))} checkpointed, the verified step's "
                f"{_what(differ)} differed from {self.findings.compared_with} (first: {differ[0]}"
                f"{'; gradients of ' + ', '.join(blocks) if blocks else ''}), so the plan would train another "
                "function. The model was left without checkpointing. Check these blocks for randomness torch's "
                "generators do not drive, or Python state their forward changes, then call again; "
                "remat.checkpoint(..., policy='keep') blocks you cannot change."
            )
        self._tried(plan, step)
        return plan, step.peak

    def _tried(self, plan: Plan, step: Step) -> None:
        if step.reserved is not None:
            self.reserved[len(self.tried)] = step.reserved
        self.tried.append((plan, step.peak))

    def reserved_of(self, plan: Plan) -> int | None:
        """The reserved peak measured for ``plan`` (None: not measured on CUDA)."""
        for i, (p, _) in enumerate(self.tried):
            if (p.assignment, p.segments) == (plan.assignment, plan.segments) and i in self.reserved:
                return self.reserved[i]
        return None

    def _one_level(self, plan: Plan, note: str) -> tuple[Plan, int | None]:
        self.findings.nested = False
        self.findings.notes.append(note)
        log.info("remat.auto: %s", note)
        try:
            twin = self.plan(plan.budget_bytes)
        except RematError:  # below the one-level minimum: its lowest-peak plan
            twin = self.lowest()
        return self.measure(twin)

    def reference(self, plan: Plan) -> Fingerprint | None:
        """What the step verified plans are compared with computes (NOTE [The step verified plans are compared
        with]), measured once; raises OutOfMemory if even it did not fit the device."""
        if self.findings.reference is not None:
            return self.findings.reference
        keep = replace(plan, assignment={name: KEEP for name in plan.assignment}, segments=())
        if self.limit is not None and self.prof.baseline_peak_bytes > self.limit:
            floor = make_plan(self.prof, strategy="none", nested=False).min_peak_bytes
            keep = make_plan(self.prof, f"{floor}B", nested=False)
            self.findings.compared_with = f"the step of the lowest-peak one-level plan ({_policies(keep)})"
            self.findings.notes.append(
                f"The step without checkpointing (predicted {human_bytes(self.prof.baseline_peak_bytes)}) is over "
                f"the budget: verified plans were compared with {self.findings.compared_with} instead."
            )
        self.reference_plan = keep
        step = _measured(self.model, self.inputs, self.loss_fn, keep, None, self.loop)
        self._tried(keep, step)
        self.findings.reference = step.summary
        return step.summary

    def _differences(self, plan: Plan, summary: Fingerprint | None) -> list[str]:
        if summary is None or not plan.checkpointed:
            return []
        reference = self.reference(plan)
        device = device_of(self.model, self.inputs)
        exact = device.type == "cpu" or torch.are_deterministic_algorithms_enabled()
        differ = [] if reference is None else reference.differences(summary, exact=exact)
        if not differ:
            same = "bit for bit" if exact else "within the tolerance of non-deterministic kernels"
            note = f"Verified: loss, gradients and buffers equal {self.findings.compared_with} ({same})."
            if note not in self.findings.notes:
                self.findings.notes.append(note)
        return differ


def _policies(plan: Plan) -> str:
    counts: dict[str, int] = {}
    for policy in plan.assignment.values():
        counts[policy] = counts.get(policy, 0) + 1
    return ", ".join(f"{n} {p}" for p, n in counts.items())


def _spans(plan: Plan) -> str:
    return ", ".join(f"{a}..{b}" for a, b in plan.segments)


def _what(differ: list[str]) -> str:
    kinds = ["loss" if d == "loss" else d.partition(":")[0] + "s" for d in differ]
    return " and ".join(dict.fromkeys(k.replace("grads", "gradients") for k in kinds))


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
        return _measured(model, inputs, loss_fn, plan, backend, loop).peak

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
    candidates = _Candidates(model, inputs, loss_fn, prof, backend, findings, loop, None if backend else limit)

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
    else:
        found = (
            f"measured {human_bytes(measured)} ({measured} bytes) in a real step (predicted {human_bytes(predicted)})"
        )
        if measured <= limit:
            found += f", for which the caching allocator reserved {over_capacity(lowest)} bytes more than the GPU has"
    raise _unreachable(limit, prof, execution, found, predicted if measured is None else measured, baseline)


def _reference_first(candidates: _Candidates, limit: int) -> None:
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
        raise _unreachable(
            limit,
            prof,
            "eager",
            (
                f"is predicted at {human_bytes(floor)} ({floor} bytes), and the lowest-peak one-level plan, the step "
                f"verified plans are compared with, ran out of device memory (predicted {human_bytes(predicted)})"
            ),
            predicted,
        ) from None


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

"""The plans ``remat.auto`` measures, and what its verification learned about the model
(NOTE [Nested plans on models that are not chains])."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from remat.core._costs import spent
from remat.core._fingerprint import Fingerprint
from remat.core._loop import Loop
from remat.core._policy_registry import KEEP
from remat.core._segment import NotAChain
from remat.core._user_errors import first_line
from remat.core.measure import device_of
from remat.errors import RematError
from remat.planning._budget import Unreachable
from remat.planning._put import remove
from remat.planning._sub_batch import MIN_SAMPLES, batch_size, reference_batch, sliced
from remat.planning._verify_step import OutOfMemory, Step, measured_step
from remat.planning.plan import Plan
from remat.planning.plan import plan as make_plan
from remat.profiling._format import human_bytes
from remat.profiling._traced import is_traced_plan

__all__ = ["Candidates", "Findings", "Unreachable"]

log = logging.getLogger("remat")


@dataclass
class Findings:
    """What auto's verification learned about the model, kept across the profiles of one ``auto`` call."""

    nested: bool = True
    """False once nested segments were found not to run, or not to compute the same, on this model."""
    one_level_because: str = ""
    """Why, once ``nested`` is False: the note that says so, for an error that follows it."""
    reference: Fingerprint | None = None
    """The step without checkpointing, summarised (NOTE [A verified plan trains the same function])."""
    notes: list[str] = field(default_factory=list)
    """What was found, for the plan's notes."""
    compared_with: str = "the step without checkpointing"
    """The step verified plans are compared with (NOTE [The step verified plans are compared with])."""
    unsliced: str = ""
    """Why the compared steps run on the whole batch where a slice was wanted ("" if they do not: NOTE [A step
    that depends on the batch size])."""
    samples: tuple[int, int] | None = None
    """(the first samples of the batch the compared steps run on, the batch's samples); None: the whole batch
    (NOTE [A reference on a slice of the batch])."""

    def compared(self) -> str:
        """The step verified plans are compared with, and on which samples."""
        if self.samples is None:
            return self.compared_with
        return f"{self.compared_with}, on the first {self.samples[0]} of the batch's {self.samples[1]} samples"


def _blocks_of(names: list[str], blocks: list[str]) -> list[str]:
    """The blocks that own the parameters and buffers in ``names`` (``grad:blocks.3.fc.weight`` -> blocks.3)."""
    owners = []
    for name in names:
        path = name.partition(":")[2]
        owner = max((b for b in blocks if path.startswith(b + ".")), key=len, default=None)
        if owner is not None and owner not in owners:
            owners.append(owner)
    return owners


class Candidates:
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
        self.compared_on: Any = inputs if findings.samples is None else sliced(inputs, *findings.samples)
        """The inputs of the steps compared: ``inputs``, or its first ``findings.samples``."""

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
            step = measured_step(self.model, self.inputs, self.loss_fn, plan, self.backend, self.loop)
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
        try:
            differ = self._differences(plan, self._compared_summary(plan, step.summary))
        except OutOfMemory as err:  # its comparison step on the slice: over the device all the same
            log.info("%s", err)
            self.tried.append((plan, None))
            return plan, None
        traced = is_traced_plan(plan.assignment)
        if differ and plan.segments:
            why = (
                "(a segment of the traced forward does more than pass its output on: it writes a buffer, say)"
                if traced
                else "(the parent does more between the blocks than pass each output on: it draws random numbers "
                "there, which a segment runs after its blocks' draws, say; or a block's recomputation computes "
                "another function)"
            )
            return self._one_level(
                plan,
                f"Nested segments {_spans(plan)} changed the step's {_what(differ)} {why}: planned one level deep.",
            )
        if differ and traced:
            remove(self.model)
            raise RematError(
                f"remat.auto: the model's forward, as torch.fx traced it and remat cut it, computed other "
                f"{_what(differ)} than the model's own forward (first: {differ[0]}; compared with "
                f"{self.findings.compared()}): the trace misses something the forward does. The model was left "
                "without checkpointing; pass blocks=[...] with the modules to checkpoint instead."
            )
        if differ:
            blocks = _blocks_of(differ, [b.name for b in self.prof.blocks])
            remove(self.model)
            raise RematError(
                f"remat.auto: with blocks {', '.join(sorted(plan.checkpointed))} checkpointed, the verified step's "
                f"{_what(differ)} differed from {self.findings.compared()} (first: {differ[0]}"
                f"{'; gradients of ' + ', '.join(blocks) if blocks else ''}), so the plan would train another "
                "function. The model was left without checkpointing. Check these blocks for randomness torch's "
                "default generators do not drive (a torch.Generator of their own) and for state their forward "
                "changes outside autograd (a buffer assigned anew, a parameter written in place, a Python "
                "counter), then call again; "
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
        self.findings.nested, self.findings.one_level_because = False, note
        self.findings.notes.append(note)
        log.info("remat.auto: %s", note)
        try:
            twin = self.plan(plan.budget_bytes)
        except RematError:  # below the one-level minimum: its lowest-peak plan
            twin = self.lowest()
        if self.limit is not None and twin.predicted_peak_bytes > self.limit:  # its step would be over: not run
            remove(self.model)
            floor = twin.predicted_peak_bytes
            raise Unreachable(
                f"remat.auto: budget {human_bytes(self.limit)} ({self.limit} bytes) cannot be met on this model: only "
                f"nested plans reach it, and {note[0].lower()}{note[1:]} The lowest-peak one-level plan is predicted "
                f"at {human_bytes(floor)}, so no step was run over the budget. Raise the budget to at least {floor} "
                "bytes, or lower the batch size / sequence length."
            )
        return self.measure(twin)

    def reference(self, plan: Plan) -> Fingerprint | None:
        """What the step verified plans are compared with computes (NOTE [The step verified plans are compared
        with]), measured once; raises OutOfMemory if even it did not fit the device."""
        if self.findings.reference is not None:
            return self.findings.reference
        traced = is_traced_plan(plan.assignment)
        # the model's own forward: a traced plan's assignment names segments, a block plan's its blocks
        own = {} if traced else {name: KEEP for name in plan.assignment}
        keep = replace(plan, assignment=own, segments=(), predicted_peak_bytes=self.prof.baseline_peak_bytes)
        below, over = self.limit is not None and self.prof.baseline_peak_bytes > self.limit, ""
        if below and self.limit is not None:
            over = self._slice_for(self.prof.baseline_peak_bytes, self.limit)
            if self.findings.samples is None:
                keep, over = self._lowest_instead(traced, over, self._lowest_one_level())
        self.reference_plan = keep
        try:
            step = self._reference_step(keep)
        except OutOfMemory as err:
            # out of memory on its smallest slice: the lowest-peak plan instead, where it is within the budget
            # (NOTE [The step verified plans are compared with])
            lowest = self._lowest_one_level()
            if self.limit is None or keep.assignment != own or lowest.predicted_peak_bytes > self.limit:
                raise
            log.info("remat.auto: the step without checkpointing ran out of device memory: %s", first_line(err))
            where = self._where_it_ran()
            self.findings.samples, self.compared_on, self.findings.unsliced = None, self.inputs, ""
            keep, over = self._lowest_instead(traced, f" ran out of device memory {where}", lowest)
            self.reference_plan = keep
            step = self._reference_step(keep)
        if self.findings.unsliced:
            over = f", on the whole batch, over the budget: {self.findings.unsliced}"
        if below:
            self.findings.notes.append(
                f"The step without checkpointing (predicted {human_bytes(self.prof.baseline_peak_bytes)}) is over "
                f"the budget: verified plans were compared with {self.findings.compared()}{over}."
            )
        self.findings.reference = step.summary
        return step.summary

    def _where_it_ran(self) -> str:
        """Which samples the step that ran out of memory ran on, for the note."""
        if self.findings.samples is not None:
            return f"on its first {self.findings.samples[0]} of the batch's {self.findings.samples[1]} samples"
        if self.findings.unsliced:
            return f"on the whole batch ({self.findings.unsliced})"
        return "on the whole batch"

    def _lowest_one_level(self) -> Plan:
        """The one-level plan at the lowest peak one-level plans reach."""
        floor = make_plan(self.prof, strategy="none", nested=False).min_peak_bytes
        return make_plan(self.prof, f"{floor}B", nested=False)

    def _lowest_instead(self, traced: bool, unsliced: str, keep: Plan) -> tuple[Plan, str]:
        """``keep``, the lowest-peak one-level plan, as the reference, where the step without checkpointing is over
        the budget and cannot run on a slice, or ran out of memory on its smallest (NOTE [The step verified plans
        are compared with]); what the note says of it."""
        missed = (
            "a trace that missed something the forward does"
            if traced
            else "a block whose recomputation computes another function in every plan alike (it rebinds a buffer, "
            "writes a parameter, or draws from a generator of its own)"
        )
        self.findings.notes.append(
            f"The step without checkpointing{unsliced}, so plans were compared with the lowest-peak one-level plan, "
            f"not with it: {missed} would not be seen "
            "(NOTE [The step verified plans are compared with])."
        )
        self.findings.compared_with = f"the step of the lowest-peak one-level plan ({policies_of(keep)})"
        return keep, self._slice_for(keep.predicted_peak_bytes, self.limit or 0)

    def _slice_for(self, predicted: int, limit: int) -> str:
        """Compare on a slice of the batch if the reference, predicted at ``predicted``, is over ``limit``
        (NOTE [A reference on a slice of the batch]); what the note says of it."""
        batch = batch_size(self.inputs)
        if predicted <= limit:
            return ""
        prof = self.prof
        fixed = prof.resting_bytes + (prof.grad_bytes if prof.accumulation_steps == 1 else 0)
        b = None if batch is None else reference_batch(batch, predicted, fixed, limit)
        if batch is None or b is None:
            if batch is None:
                why = "no first dimension is shared by more of its inputs than any other"
            elif batch // 2 < MIN_SAMPLES:
                why = f"a batch of {batch} sample has no smaller slice"
            else:
                why = f"even {MIN_SAMPLES} sample is predicted over"
            return f" (predicted {human_bytes(predicted)}, over the budget, and not compared on a slice: {why})"
        self._compare_on(b, batch)
        return (
            f" (predicted {human_bytes(predicted)} on the whole batch of {batch}, over the budget: each plan's loss, "
            "gradients and buffers are compared on that slice, its peak measured on the whole batch)"
        )

    def _compare_on(self, b: int, batch: int) -> None:
        self.findings.samples, self.compared_on = (b, batch), sliced(self.inputs, b, batch)

    def _reference_step(self, keep: Plan) -> Step:
        """The reference step; on a slice that runs out of memory, again on half the slice; on a slice the step
        fails on, on the whole batch (NOTE [A step that depends on the batch size]; ``findings.unsliced`` says
        why)."""
        while True:
            try:
                step = measured_step(self.model, self.compared_on, self.loss_fn, keep, None, self.loop)
            except OutOfMemory:
                if self.findings.samples is None or self.findings.samples[0] // 2 < MIN_SAMPLES:
                    raise
                b, batch = self.findings.samples
                self._compare_on(b // 2, batch)
                continue
            except RematError as err:
                if self.findings.samples is None:
                    raise
                self.findings.unsliced = _not_on_a_slice(self.findings.samples[0], err)
                self.findings.samples, self.compared_on = None, self.inputs
                log.info("remat.auto: the reference step runs on the whole batch: %s", self.findings.unsliced)
                continue
            if self.findings.samples is None:  # a slice's peak is not the plan's
                self._tried(keep, step)
            return step

    def _compared_summary(self, plan: Plan, summary: Fingerprint | None) -> Fingerprint | None:
        """What ``plan`` computed, on the inputs the reference ran on (a step of its own on a slice)."""
        if summary is None or not plan.checkpointed:
            return summary
        self.reference(plan)
        if self.findings.samples is None:
            return summary
        return measured_step(self.model, self.compared_on, self.loss_fn, plan, self.backend, self.loop).summary

    def _differences(self, plan: Plan, summary: Fingerprint | None) -> list[str]:
        if summary is None or not plan.checkpointed:
            return []
        reference = self.reference(plan)
        device = device_of(self.model, self.inputs)
        exact = device.type == "cpu" or torch.are_deterministic_algorithms_enabled()
        differ = [] if reference is None else reference.differences(summary, exact=exact)
        if not differ:
            same = "bit for bit" if exact else "within the tolerance of non-deterministic kernels"
            note = f"Verified: loss, gradients and buffers equal {self.findings.compared()} ({same})."
            if note not in self.findings.notes:
                self.findings.notes.append(note)
        return differ


# NOTE [A step that depends on the batch size]
# A slice of the batch (NOTE [A reference on a slice of the batch] in remat.planning._sub_batch) assumes the
# step runs on any number of samples. A loss_fn that closes over a target of the whole batch does not (a
# diffusers VAE's reconstruction loss, ``(output.sample - images).square().mean()``: the sliced step raised a
# shape mismatch, and auto told the user their training step had failed). The step the user runs is the
# whole batch's, so a reference that fails on the slice runs on the whole batch instead, over the budget, as
# it did before slices: on a device the budget is the size of, that step may run out of memory, and the
# lowest-peak one-level plan is the reference then. Every plan compared with it runs on the whole batch too.
def _not_on_a_slice(b: int, err: RematError) -> str:
    """Why a reference that failed on the first ``b`` samples runs on the whole batch."""
    said = err.__cause__ if err.__cause__ is not None else err
    return (
        f"the step on its first {b} samples raised {type(said).__name__} ({first_line(said).rstrip('.')}), as a "
        "forward or loss_fn that depends on the batch size does (a target of the whole batch, say)"
    )


def policies_of(plan: Plan) -> str:
    counts: dict[str, int] = {}
    for policy in plan.assignment.values():
        counts[policy] = counts.get(policy, 0) + 1
    return ", ".join(f"{n} {p}" for p, n in counts.items())


def _spans(plan: Plan) -> str:
    return ", ".join(f"{a}..{b}" for a, b in plan.segments)


def _what(differ: list[str]) -> str:
    kinds = ["loss" if d == "loss" else d.partition(":")[0] + "s" for d in differ]
    return " and ".join(dict.fromkeys(k.replace("grads", "gradients") for k in kinds))

"""``remat.apply`` / ``remat.remove`` / ``remat.auto``: put a plan on a model, in place and reversibly.

Blocks are checkpointed by giving the module an instance-level ``forward``
(``remat.wrap``), never by inserting wrapper modules, so ``state_dict()`` keys,
``named_parameters()`` and ``named_modules()`` are unchanged.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import replace
from typing import Any

from torch import nn

from remat.core._compiled import eager_module
from remat.core._conflicts import check_no_double_checkpointing
from remat.core._fine import FINE, inner_layers, unwrap_fine, wrap_fine
from remat.core._hf import disable_cache, restore_cache
from remat.core._segment import schedule_segments, unschedule
from remat.core._state import capture
from remat.core._user_errors import model_errors, require_module
from remat.core.checkpoint import unwrap, wrap
from remat.core._loop import NO_LOOP, Loop, OptimizerSnapshot, make_loop
from remat.core.measure import compiled_peak, measure_peak
from remat.errors import RematError
from remat.planning._compiled import chain_profile, design, fit, is_chain
from remat.planning._plan_checks import check_plan_fits
from remat.planning.plan import Plan, parse_budget, plan as make_plan
from remat.profiling._format import human_bytes
from remat.profiling._blocks import find_blocks
from remat.profiling.profile import profile as make_profile

__all__ = ["apply", "auto", "remove"]

log = logging.getLogger("remat")

#: Re-plans ``auto`` makes with a measured margin before it gives up.
REPLANS = 2


def _mode(training: bool) -> str:
    return "training" if training else "eval"


def _warn_mode(model: nn.Module, plan: Plan) -> None:
    if plan.training is None or plan.training == model.training:
        return
    warnings.warn(
        f"remat.apply: the plan was made from a profile in {_mode(plan.training)} mode, but this "
        f"{type(model).__name__} is in {_mode(model.training)} mode; dropout and BatchNorm change what the blocks "
        f"keep, so its predicted peak holds only in {_mode(plan.training)} mode. Profile in the mode you train in "
        "(remat.profile(..., training=True), the default) or switch the model with model.train().",
        stacklevel=3,
    )


def apply(model: nn.Module, plan: Plan) -> nn.Module:
    """Checkpoint ``model``'s blocks as ``plan`` says; all or nothing. Returns ``model``.

    Warns when the plan was made in training mode and the model is in eval mode now, or
    the other way round: the plan's predicted peak holds in the mode it was made in.
    ``model`` may be ``torch.compile(model)``: the plan goes on the module it wraps, and the
    next compiled call recompiles with it.
    """
    require_module(model, "remat.apply")
    if not isinstance(plan, Plan):
        raise RematError(f"remat.apply: expected a remat.Plan, got {type(plan).__name__}; make one with remat.plan(...).")
    _put(eager_module(model), plan)
    _warn_mode(model, plan)
    return model


def _put(model: nn.Module, plan: Plan) -> None:
    check_plan_fits(model, plan)
    modules = dict(model.named_modules())
    check_no_double_checkpointing(model, plan.checkpointed, api="remat.apply")
    for module in model.modules():
        unschedule(module)
    done: list[nn.Module] = []
    try:
        for name, policy in plan.assignment.items():
            unwrap_fine(modules[name])
            if policy == FINE:
                wrap_fine(modules[name])
            elif policy != "keep":
                wrap(modules[name], policy=policy)
            done.append(modules[name])
        schedule_segments(model, list(plan.assignment), plan.segments)
    except Exception:
        for module in done:
            unwrap_fine(module)
        raise
    if plan.checkpointed:
        disable_cache(model)


def remove(model: nn.Module) -> nn.Module:
    """Undo every remat checkpointing on ``model`` (``apply``, ``auto`` or ``wrap``). Returns ``model``."""
    for module in eager_module(model).modules():
        unschedule(module)
        unwrap(module)
    restore_cache(model)
    return model


def auto(
    model: nn.Module, inputs: Any, budget: Any, *, loss_fn: Any = None, verify: bool = True,
    compiled: bool | str = False, **profile_options: Any
) -> Plan:
    """Profile, plan for ``budget`` and apply, in one call. Returns the plan applied.

    ``inputs`` is what the model is called with: a tensor, a tuple, or a dict such as
    the batch a data loader yields (labels included: a Hugging Face model then
    returns ``output.loss``, which remat uses). ``profile_options`` go to
    :func:`remat.profile` (``blocks``, ``repeat``, ``training``, ``fake`` ...); with the loop's
    ``optimizer=`` and ``accumulation_steps=`` the plan is made, and verified, for the step the
    loop repeats (NOTE [The step a loop repeats]).

    NOTE [Verify when it can]
    The peak model is exact on chains of blocks; data flow it does not follow (a
    block's output used by the loss, tensors shared by every block) can make a plan
    peak higher than predicted. With ``verify`` (the default, real tensors only),
    auto measures one real step with the plan applied. Over the budget, it re-plans
    with the measured error as a margin (at most ``REPLANS`` times), then tries the
    lowest-peak plan; if none fits, it removes the plan and raises a RematError with
    the measured numbers. ``plan.measured_peak_bytes`` holds the figure; fake-tensor
    plans are not measured (``plan.verified`` is False).

    NOTE [Plans for compiled execution]
    A compiled step keeps fewer tensors than the eager one (fusion, the partitioner), so
    an eager plan is needlessly tight under compile. With ``compiled=True`` (or a
    ``torch.compile`` backend name such as ``"aot_eager"``) auto measures the compiled step
    without checkpointing (allocator-level, ``remat.core.measure.compiled_peak``); a
    fractional budget is a fraction of that peak. On a chain of blocks, auto measures the
    compiled steps of ``remat.planning._compiled.design`` (15 plans; 9 for two blocks) and
    plans with the chain fitted to them (NOTE [Predicting compiled peaks]); on any other
    model, with the eager profile's peaks scaled by compiled / eager peak without
    checkpointing. Either way the chosen plan is verified by a compiled step and re-planned
    as above if over. Each compiled step is a recompile (seconds to minutes) and resets
    dynamo's caches (NOTE [Each compiled measurement starts from an empty dynamo cache]).
    Plans are one level deep (nested segments are not modelled under compile). The plan
    says ``execution="compiled"``; its ``measured_peak_bytes`` is the compiled step's.

    Nothing is applied when profiling, planning or verification fails. A ``torch.compile``'d
    model is profiled and verified eagerly (the module it wraps, which gets the plan); its
    next compiled call recompiles with the plan (NOTE [Under torch.compile]).
    """
    model = eager_module(model)
    require_module(model, "remat.auto")
    parse_budget(budget, 1)  # a bad budget fails now, before any step runs
    backend = _compile_backend(compiled, verify, profile_options)
    loop = make_loop(model, profile_options.get("optimizer"), profile_options.get("accumulation_steps", 1),
                     "remat.auto")
    check_no_double_checkpointing(model, find_blocks(model, profile_options.get("blocks")), api="remat.auto")
    remove(model)
    disable_cache(model)
    try:
        prof = make_profile(model, inputs, loss_fn, **profile_options)
        try:
            chosen = _plan_and_put(model, inputs, loss_fn, prof, budget, backend, verify, loop)
        except _Unreachable:
            if not _may_go_finer(model, prof, backend, profile_options):
                raise
            # NOTE [Finer only when needed]
            prof = make_profile(model, inputs, loss_fn, **{**profile_options, "policies": (*prof.policies, FINE)})
            chosen = _plan_and_put(model, inputs, loss_fn, prof, budget, backend, verify, loop)
            note = (f"No plan of policies {', '.join(prof.policies[:-1])} reached the budget: profiled again with "
                    f"{FINE} (each block's sub-layers checkpointed inside its recomputation).")
            chosen = replace(chosen, notes=(*chosen.notes, note))
    except Exception:
        remove(model)
        raise
    if not chosen.checkpointed:
        restore_cache(model)
    return chosen


# NOTE [Finer only when needed]
# ``full-fine`` lowers the floor (a recomputed block's transient is one sub-layer's, issue
# #19) but profiling it costs one more traced step and its timed rounds, which every
# profile would pay for the few budgets that need it. So auto profiles the default
# policies first and, when no plan of theirs reaches the budget (eager execution, the
# policies not chosen by the caller, blocks with sub-layers), profiles once more with
# ``full-fine`` and plans again.
class _Unreachable(RematError):
    """No plan on this profile reaches the budget (predicted, or measured by auto's verification)."""


def _plan_and_put(model: nn.Module, inputs: Any, loss_fn: Any, prof: Any, budget: Any, backend: str | None,
                  verify: bool, loop: Loop) -> Plan:
    if verify and not prof.fake:
        return _verified_plan(model, inputs, loss_fn, prof, budget, backend, loop)
    try:
        chosen = make_plan(prof, budget)
    except RematError as exc:
        if parse_budget(budget, prof.baseline_peak_bytes) < make_plan(prof, strategy="none").min_peak_bytes:
            raise _Unreachable(str(exc)) from exc
        raise
    _put(model, chosen)
    return chosen


def _may_go_finer(model: nn.Module, prof: Any, backend: str | None, profile_options: dict) -> bool:
    if backend is not None or "policies" in profile_options or FINE in prof.policies:
        return False
    modules = dict(model.named_modules())
    return any(inner_layers(modules[b.name]) for b in prof.blocks)


def _compile_backend(compiled: bool | str, verify: bool, profile_options: dict) -> str | None:
    if compiled is False:
        return None
    if not verify or profile_options.get("fake"):
        raise RematError(
            f"remat.auto: compiled={compiled!r} verifies every candidate plan with a real compiled step, so it needs "
            "verify=True and real tensors (not fake=True); drop compiled= to plan for eager execution."
        )
    if compiled is True:
        return "inductor"
    if not isinstance(compiled, str) or not compiled:
        raise RematError(f"remat.auto: compiled must be True, False or a torch.compile backend name, got {compiled!r}.")
    return compiled


def _measured(model: nn.Module, inputs: Any, loss_fn: Any, plan: Plan, backend: str | None = None,
              loop: Loop = NO_LOOP) -> int:
    """Peak of one real step of ``loop`` with ``plan`` applied, in the plan's mode (compiled with ``backend`` if
    given); the model and the optimizer are restored after."""
    _put(model, plan)
    state, optimizer_state = capture(model), OptimizerSnapshot(loop.optimizer)
    try:
        if plan.training is not None:
            model.train(plan.training)
        with model_errors(model, "remat.auto", "the step that verifies the plan", plan.checkpointed):
            if backend is not None:
                return compiled_peak(model, inputs, loss_fn, backend=backend, loop=loop)
            peak, _, _ = measure_peak(model, inputs, loss_fn, loop)
    finally:
        state.restore()
        optimizer_state.restore()
    return peak


class _Candidates:
    """Plans for ``auto`` to measure, nested while the model runs nested segments.

    NOTE [Nested plans on models that are not chains]
    The profile sees a chain of blocks wherever their segments follow one another, but a
    nested segment also needs each block's output to be the next block's only input from
    the parent (``remat.core._segment``); the parent's code is only seen when the plan
    runs. When a candidate with segments raises for that reason, auto plans one level
    deep from then on (the one-level plan for the same budget), and says so in the notes.
    """

    def __init__(self, model: nn.Module, inputs: Any, loss_fn: Any, prof: Any, backend: str | None,
                 notes: list[str], loop: Loop) -> None:
        self.model, self.inputs, self.loss_fn, self.prof, self.backend = model, inputs, loss_fn, prof, backend
        self.loop = loop
        self.notes = notes
        self.nested = True
        self.tried: list[tuple[Plan, int]] = []

    def plan(self, budget: int) -> Plan:
        return make_plan(self.prof, budget, nested=self.nested)

    def lowest(self) -> Plan:
        """The plan at the lowest peak any plan reaches (the nested floor while nesting)."""
        return self.plan(make_plan(self.prof, strategy="none", nested=self.nested).min_peak_bytes)

    def measure(self, plan: Plan) -> tuple[Plan, int]:
        """(the plan measured, its peak): ``plan``, or its one-level twin if its segments cannot run."""
        same = [m for p, m in self.tried if (p.assignment, p.segments) == (plan.assignment, plan.segments)]
        if same:
            return plan, same[0]
        try:
            measured = _measured(self.model, self.inputs, self.loss_fn, plan, self.backend, self.loop)
        except RematError as err:
            if not plan.segments:
                raise
            self.nested = False
            self.notes.append(f"Nested segments do not run on this model ({err}); planned one level deep.")
            log.warning("remat.auto: %s", self.notes[-1])
            try:
                one_level = self.plan(plan.budget_bytes)
            except RematError:  # below the one-level minimum: its lowest-peak plan
                one_level = self.lowest()
            return self.measure(one_level)
        self.tried.append((plan, measured))
        return plan, measured


def _compiled_profile(model: nn.Module, inputs: Any, loss_fn: Any, prof: Any, backend: str,
                      loop: Loop) -> tuple[Any, int, str]:
    """(the profile to plan the compiled step with, its compiled peak without checkpointing, a note).

    A chain of blocks gets the fitted compiled chain (NOTE [Predicting compiled peaks]); any other model
    the eager profile, whose peaks the caller scales by the compiled / eager peak without checkpointing.
    """
    names = [b.name for b in prof.blocks]
    keep = make_plan(prof, strategy="none", nested=False)

    def measure(policies: tuple[str, ...]) -> int:
        return _measured(model, inputs, loss_fn, replace(keep, assignment=dict(zip(names, policies, strict=True))),
                         backend, loop)

    baseline = measure(("keep",) * len(names))
    if not is_chain(prof):
        return prof, baseline, "Not a chain of blocks: eager predictions scaled by the compiled peak."
    peaks = {a: measure(a) for a in design(prof.policies, len(names))}
    chained = chain_profile(prof, fit(peaks, prof.resting_bytes), label=f"compiled ({backend})")
    return chained, baseline, chained.notes[-1]


def _verified_plan(model: nn.Module, inputs: Any, loss_fn: Any, prof: Any, budget: Any, backend: str | None,
                   loop: Loop) -> Plan:
    # Peaks of the execution verified for (eager, or compiled: NOTE [Plans for compiled execution]).
    baseline = prof.baseline_peak_bytes
    notes: list[str] = []
    scale = 1.0
    if backend is not None:
        eager_baseline = baseline
        planned, baseline, note = _compiled_profile(model, inputs, loss_fn, prof, backend, loop)
        notes += [f"Compiled ({backend}) without checkpointing: {human_bytes(baseline)} measured, "
                  f"{baseline / eager_baseline:.2f} of the eager peak.", note]
        scale = 1.0 if planned is not prof else eager_baseline / baseline
        prof = planned
    execution = "eager" if backend is None else "compiled"
    limit = parse_budget(budget, baseline)
    candidates = _Candidates(model, inputs, loss_fn, prof, backend, notes, loop)
    candidates.nested = backend is None  # nested regions are not modelled (nor tested) under compile
    target, margin = limit, 0
    for _ in range(REPLANS + 1):
        try:
            candidate = candidates.plan(int(target * scale))
        except RematError:
            break  # the margin leaves no plan: only the lowest-peak plan is left to try
        candidate, measured = candidates.measure(candidate)
        if measured <= limit:
            return replace(candidate, budget_bytes=limit, measured_peak_bytes=measured, notes=tuple(notes),
                           execution=execution)
        predicted = int(candidate.predicted_peak_bytes / scale)
        margin = max(margin, measured - predicted)
        notes.append(
            f"A plan predicted at {human_bytes(predicted)} measured "
            f"{human_bytes(measured)}, over the budget: re-planned with a margin of {human_bytes(margin)}."
        )
        log.warning("remat.auto: %s", notes[-1])
        target = limit - margin
    # The lowest peak of any plan, nested ones included (remat.plan reaches its own min_peak_bytes).
    lowest, measured = candidates.measure(candidates.lowest())
    if measured <= limit:
        notes.append("The lowest-peak plan fits the budget.")
        return replace(lowest, budget_bytes=limit, measured_peak_bytes=measured, notes=tuple(notes),
                       execution=execution)
    remove(model)
    raise _Unreachable(
        f"remat.auto: budget {human_bytes(limit)} ({limit} bytes, {limit / baseline:.3f} of the "
        f"{human_bytes(baseline)} {execution} peak without checkpointing) cannot be met: the lowest-peak plan "
        f"measured {human_bytes(measured)} ({measured} bytes) in a real step (predicted "
        f"{human_bytes(int(lowest.predicted_peak_bytes / scale))}). Raise the budget to at least {measured} bytes, or lower the "
        "batch size / sequence length." + prof.held_by_loop()
    )

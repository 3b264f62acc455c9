"""``remat.apply`` / ``remat.remove`` / ``remat.auto``: put a plan on a model, in place and reversibly.

Blocks are checkpointed by giving the module an instance-level ``forward``
(``remat.wrap``), never by inserting wrapper modules, so ``state_dict()`` keys,
``named_parameters()`` and ``named_modules()`` are unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from torch import nn

from remat.core._compiled import eager_module
from remat.core._conflicts import check_no_double_checkpointing
from remat.core._costs import costs, spent
from remat.core._fine import FINE, inner_layers
from remat.core._hf import disable_cache, restore_cache
from remat.core._loop import Loop, make_loop
from remat.core._policies import POLICIES
from remat.core._user_errors import first_line, require_module
from remat.core.measure import device_of
from remat.errors import RandomBranchWarning, RematError
from remat.planning._budget import ACCEPTED_BUDGETS
from remat.planning._candidates import Findings, Unreachable
from remat.planning._gpu_room import Room, over_the_room_note, room_on
from remat.planning._put import put, remove
from remat.planning._verify import verified_plan
from remat.planning._within import device_target, profile_within
from remat.planning.plan import Plan, parse_budget
from remat.planning.plan import plan as make_plan
from remat.profiling._blocks import find_blocks
from remat.profiling._schedule import traced_only_if, young_collections
from remat.profiling._types import Profile
from remat.profiling.profile import profile as make_profile

__all__ = ["apply", "auto", "device_target", "remove"]

log = logging.getLogger("remat")


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
        raise RematError(
            f"remat.apply: expected a remat.Plan, got {type(plan).__name__}; make one with remat.plan(...)."
        )
    put(eager_module(model), plan)
    _warn_mode(model, plan)
    return model


def auto(
    model: nn.Module,
    inputs: Any,
    budget: Any,
    *,
    loss_fn: Any = None,
    verify: bool = True,
    compiled: bool | str = False,
    **profile_options: Any,
) -> Plan:
    """Profile, plan for ``budget`` and apply, in one call. Returns the plan applied.

    ``inputs`` is what the model is called with: a tensor, a tuple, or a dict such as
    the batch a data loader yields (labels included: a Hugging Face model then
    returns ``output.loss``, which remat uses). ``profile_options`` go to
    :func:`remat.profile` (``blocks``, ``repeat``, ``training``, ``fake`` ...); with the loop's
    ``optimizer=`` and ``accumulation_steps=`` the plan is made, and verified, for the step the
    loop repeats (NOTE [The step a loop repeats]).

    ``budget`` is bytes (``"8GiB"``) or a fraction of the peak without checkpointing (``0.6``);
    ``None`` on CUDA fits this GPU: what the process holds now and its free memory, less
    ``FRAGMENTATION_MARGIN`` for the caching allocator, whose reserved peak verification holds
    within the GPU (NOTE [Fitting a device] in remat.planning._gpu_room; the plan's notes give
    the figures). Auto never holds more device memory than the budget while some
    plan fits it: below the peak without checkpointing it plans on fake tensors, and a step
    that runs out of memory is a plan over the budget (NOTE [Within the budget] in remat.planning._within).

    With ``verify`` (the default, real tensors only) the plan applied is one whose real step
    measured within the budget and computed the loss, gradients and buffers of the step
    without checkpointing (``remat.planning._verify``: NOTE [Verify when it can], NOTE [A
    verified plan trains the same function]); ``plan.notes`` says what was compared.

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
    # the collections before each step look only at what auto made (NOTE [A garbage collection per traced step])
    with costs("remat.auto"), young_collections(full=_on_a_gpu(model)):  # NOTE [Where the time goes]
        return _auto(model, inputs, budget, loss_fn, verify, compiled, profile_options)


def _on_a_gpu(model: Any) -> bool:
    """Whether ``model`` holds GPU memory (anything else is checked, and refused, inside auto)."""
    if not isinstance(model, nn.Module):
        return False
    return any(t.is_cuda for t in (*model.parameters(), *model.buffers()))


def _auto(
    model: nn.Module, inputs: Any, budget: Any, loss_fn: Any, verify: bool, compiled: bool | str, profile_options: dict
) -> Plan:
    model = eager_module(model)
    require_module(model, "remat.auto")
    # the GPU's room is read before any step of auto's: budget=None plans for it, a given budget is checked against it
    fits_the_gpu, capacity = budget is None, None
    room = _room_of_device(model, inputs) if fits_the_gpu else _gpu_room(model, inputs)
    if fits_the_gpu and room is not None:
        budget, capacity = room.budget_bytes, room.capacity
    parse_budget(budget, 1)  # a bad budget fails now, before any step runs
    backend = _compile_backend(compiled, verify, profile_options)
    loop = make_loop(
        model, profile_options.get("optimizer"), profile_options.get("accumulation_steps", 1), "remat.auto"
    )
    check_no_double_checkpointing(model, find_blocks(model, profile_options.get("blocks")), api="remat.auto")
    remove(model)
    disable_cache(model)
    findings = Findings()
    verify = verify and not profile_options.get("fake")
    fit = verify and backend is None

    def planned(options: dict) -> Plan:
        prof = _profile(model, inputs, loss_fn, budget, fit, options, finer=fit)
        coarse = _coarse(prof, options)
        try:
            return _plan_and_put(model, inputs, loss_fn, coarse, budget, backend, verify, loop, findings, capacity)
        except Unreachable:
            if coarse is prof and not may_go_finer(model, prof, backend, options):
                raise
            # NOTE [Finer only when needed]
            how = "planned again with" if coarse is not prof else "profiled again with"
            if coarse is prof:
                prof = _profile(model, inputs, loss_fn, budget, fit, {**options, "policies": (*prof.policies, FINE)})
            chosen = _plan_and_put(model, inputs, loss_fn, prof, budget, backend, verify, loop, findings, capacity)
            return noted_finer(chosen, prof.policies, how)

    try:
        try:
            chosen = planned(profile_options)
        except Unreachable as err:
            units = _coarser_units(model, profile_options)
            if units is None:
                raise
            chosen = planned({**profile_options, "blocks": units})
            chosen = replace(chosen, notes=(*chosen.notes, _coarser_note(units, err)))
    except Unreachable as err:
        remove(model)
        raise _said_why_one_level(err, findings) from err.__cause__
    except BaseException:  # an interrupt too: nothing of the plan stays on the model
        remove(model)
        raise
    if not chosen.checkpointed:
        restore_cache(model)
    return _noted(chosen, room, fits_the_gpu)


# NOTE [Coarser units when the refined ones fall short]
# ``blocks="auto"`` refines fewer than eight units into the modules they call (NOTE [A block is refined into
# what it calls] in remat.profiling._blocks), which usually reaches lower. Where a block's own code does the
# work between its callees (peft's LoRA on both linears of a custom MLP block: the GELU between them), the
# refined units leave that work outside every unit: five such blocks refined into ten ``lora.Linear``
# reached 0.98 of the peak, and auto refused 0.6, which the five blocks reach (measured 0.56; the test in
# tests/planning/test_architectures.py). So where the refined units cannot meet the budget, auto plans once
# more on the coarse units, and the notes say so.
def _coarser_units(model: nn.Module, options: dict) -> list[str] | None:
    """The coarse units where ``blocks="auto"`` refined them into others (None: it did not, or units were given)."""
    if options.get("blocks") not in (None, "auto"):
        return None
    coarse = find_blocks(model, "coarse")
    return coarse if coarse and coarse != find_blocks(model, "auto") else None


def _coarser_note(units: list[str], err: Unreachable) -> str:
    why = str(err).partition("cannot be met: ")[2].partition(". Raise")[0] or first_line(err)
    return (
        f"The units blocks='auto' found (refined into the modules each block calls) could not meet the budget "
        f"({why}); planned on the {len(units)} coarser units instead ({units[0]} ...): NOTE [Coarser units when "
        "the refined ones fall short]."
    )


def _said_why_one_level(err: Unreachable, findings: Findings) -> Unreachable:
    """``err``, saying why nested plans were left out if they were and it does not say so: a budget that only
    they reach fails for that reason, which the error of a later, finer try would leave unsaid."""
    why = findings.one_level_because
    return err if not why or why.lower() in str(err).lower() else Unreachable(f"{err} {why}")


def _noted(chosen: Plan, room: Room | None, fits_the_gpu: bool) -> Plan:
    """``chosen`` with what the GPU's room says of it (NOTE [Fitting a device] in remat.planning._gpu_room): the
    budget ``budget=None`` took from it, or where a given budget leaves the allocator too little."""
    if room is None:
        return chosen
    if fits_the_gpu:
        return replace(chosen, notes=(room.note(), *chosen.notes))
    over = None if chosen.budget_bytes is None else over_the_room_note(chosen.budget_bytes, room)
    if over is None:
        return chosen
    log.warning("remat.auto: %s", over)
    return replace(chosen, notes=(*chosen.notes, over))


# NOTE [Finer only when needed]
# ``full-fine`` lowers the floor (a recomputed block's transient is one sub-layer's)
# but profiling it costs one more traced step and its timed rounds, which every
# profile would pay for the few budgets that need it. So auto profiles the default
# policies first and, when no plan of theirs reaches the budget (eager execution, the
# policies not chosen by the caller, blocks with sub-layers), profiles once more with
# ``full-fine`` and plans again. The fake profile auto starts with (NOTE [Within the
# budget]) traces ``full-fine`` from the start: one traced step more and no timed
# rounds, where profiling again would trace every policy again; auto still plans on the
# default policies first (``_coarse``), and a budget above the fake profile's peak
# without checkpointing is profiled for real as before, without ``full-fine``. Even there it traces
# ``full-fine`` last, and only where the other policies' lowest peak is above FINER_ABOVE of the
# budget (NOTE [A policy traced only when wanted]): a fifth of the fake profile saved for the
# budgets those policies reach. remat.distributed.auto does the same on every rank at once:
# rank 0's planning sends that no plan reached the budget, and every rank profiles again.


def _coarse(prof: Any, profile_options: dict) -> Any:
    """``prof`` without the ``full-fine`` policy it traced ahead of need (NOTE [Finer only when needed])."""
    if FINE not in prof.policies or FINE in profile_options.get("policies", ()):
        return prof
    policies = tuple(p for p in prof.policies if p != FINE)
    return replace(prof, policies=policies, segments={p: prof.segments[p] for p in policies})


def _profile(
    model: nn.Module, inputs: Any, loss_fn: Any, budget: Any, fit: bool, options: dict, *, finer: bool = False
) -> Any:
    """The profile auto plans on: within the budget when real steps follow it (``fit``; NOTE [Within the budget]
    in remat.planning._within); compiled verification measures the compiled step without checkpointing first,
    and is left as it was. ``finer``: a fake profile traces ``full-fine`` too, when auto may go finer (NOTE
    [Finer only when needed])."""
    with warnings.catch_warnings(), _told_as_auto():  # auto refuses such a profile itself
        warnings.simplefilter("ignore", RandomBranchWarning)
        if not fit:
            prof = make_profile(model, inputs, loss_fn, **options)
        elif not (finer and may_go_finer(model, None, None, options)):
            prof = profile_within(model, inputs, loss_fn, budget, api="remat.auto", options=options).profile
        else:  # NOTE [A policy traced only when wanted] in remat.profiling._schedule
            with traced_only_if(FINE, lambda coarse: _needs_finer(coarse, budget)):
                prof = profile_within(
                    model, inputs, loss_fn, budget, api="remat.auto", options=options, fake_options={"policies": FINEST}
                ).profile
    if prof.random_branches:
        raise RematError(
            f"remat.auto: the forward of {type(model).__name__} branches on random draws at "
            f"{', '.join(prof.random_branches)}, so a later step may take another path than the one profiled and "
            "verified, and keep more than the budget; no plan was applied. remat turns LayerDrop off while planning "
            "where its probability is an attribute named `layerdrop`. Make this draw fixed while remat.auto runs "
            "and restore it afterwards: for a layer skipped at random, its probability 0 (every layer runs, the most "
            "a step keeps), and the plan holds whichever layers a later step skips."
        )
    return prof


@contextlib.contextmanager
def _told_as_auto() -> Iterator[None]:
    """An error of auto's own profile names ``remat.auto``, the call the user made, not ``remat.profile``, which
    they did not (the same error, its type, cause and traceback kept)."""
    try:
        yield
    except RematError as err:
        said = err.args[0] if err.args and isinstance(err.args[0], str) else ""
        if said.startswith(_PROFILE_SAYS):
            err.args = (f"remat.auto (profiling the step): {said.removeprefix(_PROFILE_SAYS)}", *err.args[1:])
        raise


_PROFILE_SAYS = "remat.profile: "


#: The policies auto's fake profile may trace: the default ones, and ``full-fine`` last when wanted.
FINEST = (*POLICIES, FINE)

#: ``full-fine`` is traced ahead where the lowest peak of the other policies' plans is above this share of the
#: budget: the real steps of verification may measure a little above the prediction (NOTE [Finer only when needed]).
FINER_ABOVE = 0.9


def _needs_finer(coarse: Profile, budget: Any) -> bool:
    """Whether the plans of ``coarse``'s policies may not reach ``budget`` (NOTE [Finer only when needed])."""
    try:
        with spent("planning"):
            floor = make_plan(coarse, strategy="none").min_peak_bytes
    except RematError:  # no floor to compare with: trace it, as before this was asked
        return True
    return floor > FINER_ABOVE * parse_budget(budget, coarse.baseline_peak_bytes)


def _plan_and_put(
    model: nn.Module,
    inputs: Any,
    loss_fn: Any,
    prof: Any,
    budget: Any,
    backend: str | None,
    verify: bool,
    loop: Loop,
    findings: Findings,
    capacity: int | None,
) -> Plan:
    if verify:
        return verified_plan(model, inputs, loss_fn, prof, budget, backend, loop, findings, capacity=capacity)
    with spent("planning"):
        chosen = make_plan(prof, budget)  # Unreachable below the floor
    put(model, chosen)
    return chosen


def _gpu_room(model: nn.Module, inputs: Any) -> Room | None:
    """The room on the GPU the model is on (None: it is not on one)."""
    device = device_of(model, inputs)
    return room_on(device) if device.type == "cuda" else None


def _room_of_device(model: nn.Module, inputs: Any) -> Room:
    """``budget=None``: the room on the GPU the model is on (NOTE [Fitting a device] in remat.planning._gpu_room)."""
    room = _gpu_room(model, inputs)
    if room is None:
        raise RematError(
            f"remat.auto: budget=None fits the plan to the GPU the model is on, but it is on "
            f"{device_of(model, inputs)}, whose free memory remat cannot read; pass a budget: {ACCEPTED_BUDGETS}."
        )
    return room


def noted_finer(chosen: Plan, policies: tuple[str, ...], how: str) -> Plan:
    """``chosen``, planned on ``policies`` with ``FINE`` after no plan of the others reached the budget, saying so
    (NOTE [Finer only when needed])."""
    note = (
        f"No plan of policies {', '.join(p for p in policies if p != FINE)} reached the budget: {how} {FINE} "
        "(each block's sub-layers checkpointed inside its recomputation)."
    )
    return replace(chosen, notes=(*chosen.notes, note))


def may_go_finer(model: nn.Module, prof: Any, backend: str | None, profile_options: dict) -> bool:
    """Whether ``full-fine`` may reach what the profile's policies do not (``prof`` None: before profiling)."""
    if backend is not None or "policies" in profile_options or (prof is not None and FINE in prof.policies):
        return False
    modules = dict(model.named_modules())
    names = find_blocks(model, profile_options.get("blocks")) if prof is None else [b.name for b in prof.blocks]
    return any(n in modules and inner_layers(modules[n]) for n in names)  # traced blocks: not here


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

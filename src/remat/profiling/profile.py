"""``remat.profile``: run the traced steps of a model and return its :class:`Profile`.

The data it returns, and the peak model built on it, live in ``remat.profiling._types``
(see NOTE [The peak model] there).
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from typing import Any

from remat.core._costs import costs, spent
from remat.core._hf import every_layer_runs, layerdrop_settings
from remat.core._loop import Loop, make_loop
from remat.core._memtrack import empty_device_cache
from remat.core._policy_registry import FULL, KEEP, POLICIES
from remat.core._state import restoring
from remat.core._step import set_training
from remat.core._user_errors import check_devices, model_errors, require_module
from remat.errors import OutOfMemory, RandomBranchWarning, RematError
from remat.profiling._types import Profile

__all__ = ["profile"]


def profile(
    model: Any,
    inputs: Any,
    loss_fn: Any = None,
    *,
    blocks: str | list[str] | None = None,
    policies: tuple[str, ...] = POLICIES,
    warmup: int = 1,
    repeat: int = 3,
    fake: bool = False,
    target: Any = None,
    training: bool | None = True,
    optimizer: Any = None,
    accumulation_steps: int = 1,
) -> Profile:
    """Profile one training step of ``model`` on ``inputs`` under every policy.

    Args:
        model: the model as it is trained; restored exactly afterwards.
        inputs: a tensor, a tuple (positional) or a dict (keyword arguments).
        loss_fn: ``loss_fn(output) -> scalar``; default ``output.loss`` or the sum of the outputs.
        blocks: the checkpointing units: ``"auto"`` (default), ``"coarse"``, ``"fine"``,
            or a list of module names. A model with none is cut along its forward traced by
            ``torch.fx`` (NOTE [Cutting a traced forward] in ``remat.profiling._traced``).
        policies: the policies to profile (``keep`` is always added). Both selective
            policies by default: by module is cheap where each op's Python shows (fast
            GPUs, bf16), op by op keeps less where attention runs unfused; the planner
            weighs them per block. ``full-fine`` lowers the floor (``remat.auto`` adds it
            itself when no other plan reaches the budget).
        warmup: untimed steps per policy before the timed ones; the traced step of each
            policy (memory and FLOPs) is the first of them.
        repeat: timed steps per policy; times are medians.
        fake: run on fake tensors: nothing is allocated, so a model larger than
            this machine (built under ``torch.device("meta")``) can be planned.
            Memory is exact; times come from ``target``'s roofline model.
        target: for fake profiles, ``"h100"``, ``"a100"``, ``"cpu"`` (default,
            calibrated once) or a :class:`remat.profiling.targets.Target`.
        training: the mode to profile in: ``True`` (default) trains as the loop
            will, whatever mode the model is in now (``from_pretrained`` returns
            eval models; dropout and BatchNorm change what blocks keep), a model in
            training mode with the modes its modules have (frozen BatchNorm); ``False``
            profiles eval mode; ``None`` the model's modes as they are. The
            model's modes are restored afterwards.
        optimizer: the ``torch.optim.Optimizer`` the loop steps after each backward:
            its state (made by a step first) counts as resting memory and its step
            as the backward's last segment, so plans hold in the running loop
            (NOTE [The step a loop repeats]); its state is restored afterwards.
        accumulation_steps: backward passes per optimizer step (gradient
            accumulation; also 2 for loops that zero gradients with
            ``set_to_none=False``): from 2 on, every gradient is alive through
            the step.
    """
    from remat.profiling._blocks import find_blocks

    require_module(model, "remat.profile")
    if not fake:  # a fake profile takes a meta model with CPU inputs
        check_devices(model, inputs, "remat.profile")
    if warmup < 0 or repeat < 1:
        raise RematError(f"remat.profile: need warmup >= 0 and repeat >= 1, got warmup={warmup}, repeat={repeat}.")
    names = find_blocks(model, blocks)
    options = dict(
        policies=policies,
        warmup=warmup,
        repeat=repeat,
        fake=fake,
        target=target,
        training=training,
        optimizer=optimizer,
        accumulation_steps=accumulation_steps,
    )
    skips = layerdrop_settings(model)
    with every_layer_runs(model):  # NOTE [LayerDrop while planning]
        prof = _with_random_branches(
            _profile_units(model, inputs, loss_fn, blocks, names, options, skips), model, inputs, options
        )
    if skips:  # NOTE [LayerDrop and nested segments]
        prof.skips_layers = skips
        prof.notes.append(
            f"LayerDrop is on ({', '.join(skips)}): plans are one level deep, as a nested segment cannot skip a "
            "layer; set it to 0 for nested plans."
        )
    return prof


def _profile_units(
    model: Any,
    inputs: Any,
    loss_fn: Any,
    blocks: str | list[str] | None,
    names: list[str],
    options: dict,
    skips: tuple[str, ...],
) -> Profile:
    """The profile of ``names``, of units from the execution or of the traced forward's segments (not for a model
    with LayerDrop on, ``skips``: a trace fixes one draw's path, NOTE [LayerDrop and nested segments])."""
    from remat.profiling._blocks import suggest_blocks
    from remat.profiling._called import units_from_the_execution

    failed = ""
    if blocks in (None, "auto", "coarse", "fine"):  # NOTE [Units from the execution]
        names, failed = units_from_the_execution(model, inputs, names, options["training"], real=not options["fake"])
    if not names and skips:
        hint = suggest_blocks(model)
        fix = (
            f"Pass blocks=[...] with the module names to consider{hint}, or set LayerDrop to 0"
            if hint
            else "It has no submodule with layers of its own to name as blocks: set LayerDrop to 0"
        )
        raise RematError(
            f"remat.profile: found no blocks in {type(model).__name__} (no container with repeated children), and "
            f"it skips layers at random (LayerDrop: {', '.join(skips)}), so its forward is not cut along a trace, "
            f"which would fix one draw's path{failed}. {fix}."
        )
    if not names:  # NOTE [Cutting a traced forward]: its segments are the blocks while this profile runs
        return _traced_profile(model, inputs, loss_fn, options, suggest_blocks(model) + failed)
    prof = _module_profile(model, inputs, loss_fn, names, **options)
    if blocks not in (None, "auto") or skips or freeable_bytes(prof) >= _FREES_ENOUGH * activation_bytes(prof):
        return prof
    # NOTE [Units that free little]
    try:
        cut = _traced_profile(model, inputs, loss_fn, options, "")
    except RematError:  # not traceable: the module units stand
        return prof
    return cut if freeable_bytes(cut) > freeable_bytes(prof) else prof


def _with_random_branches(prof: Profile, model: Any, inputs: Any, options: dict) -> Profile:
    """``prof`` with where a real forward branches on random draws (NOTE [Branches on random draws]); a fake
    profile cannot take such a branch and has already said so."""
    from remat.profiling._called import random_branches

    if options["fake"]:
        return prof
    prof.random_branches = random_branches(model, inputs, training=options["training"])
    if prof.random_branches:
        note = (
            f"the forward branches on random draws at {', '.join(prof.random_branches)}: this profile is of one "
            "draw's path, and a step that takes another may keep more than a plan of it predicts. Make the draw "
            "fixed while profiling (its probability 0, the path that runs every layer; remat does so itself for "
            "LayerDrop probabilities named `layerdrop`)."
        )
        prof.notes.append(note)
        warnings.warn(f"remat.profile: {note}", RandomBranchWarning, stacklevel=3)
    return prof


# NOTE [Units that free little]
# Module units can leave most of a step's activations outside any unit: a ModuleList of Linears whose
# parent applies a tanh after each keeps every tanh output in the parent, where no plan of those units
# frees it (each Linear keeps only its input, which checkpointing keeps too, and the parent reads each
# output, so no nested segment spans two). Where the units together
# can free less than a quarter of what the step holds beyond its resting bytes and gradients, and blocks
# were not named, the forward is also cut along its fx trace (the parent's ops inside the segments) and
# the profile whose units can free more is returned: a second profile only for such models.
_FREES_ENOUGH = 0.25


def freeable_bytes(prof: Profile) -> int:
    """What plans of the units could free together: per unit, keep's saved bytes less the fewest any policy saves,
    and the output of each unit that hands it only to the next (a nested segment over both frees it)."""
    saved = sum(b.saved_bytes[KEEP] - min(b.saved_bytes.values()) for b in prof.blocks)
    handed = sum(b.output_bytes for b in prof.blocks[:-1] if b.name not in prof.unchained)
    return saved + handed


def activation_bytes(prof: Profile) -> int:
    """What the step without checkpointing holds at its peak beyond resting bytes and gradients."""
    return prof.baseline_peak_bytes - prof.resting_bytes - prof.grad_bytes


def _traced_profile(model: Any, inputs: Any, loss_fn: Any, options: dict[str, Any], hint: str) -> Profile:
    """The profile of ``model``'s forward cut into traced segments (NOTE [Cutting a traced forward])."""
    from remat.profiling._traced import traced_units
    from remat.profiling._traced_repeat import widen

    training = options["training"]
    with traced_units(model, inputs, training=training, api="remat.profile", hint=hint) as (names, full):
        prof = profile(model, inputs, loss_fn, blocks=names, **options)
    wide = prof if names == full else widen(prof, names, full)  # NOTE [Identical segments are profiled once]
    if wide is None:  # a record the widening cannot place: the whole chain is profiled
        with traced_units(model, inputs, training=training, api="remat.profile", hint=hint, shorten=False) as (
            names,
            _,
        ):
            wide = profile(model, inputs, loss_fn, blocks=names, **options)
    return wide


def _module_profile(
    model: Any,
    inputs: Any,
    loss_fn: Any,
    names: list[str],
    *,
    policies: tuple[str, ...],
    warmup: int,
    repeat: int,
    fake: bool,
    target: Any,
    training: bool | None,
    optimizer: Any,
    accumulation_steps: int,
) -> Profile:
    """The profile of ``model`` with the module units ``names``."""
    from remat.profiling._profile_run import validate_policies

    policies = validate_policies(policies)
    loop = make_loop(model, optimizer, accumulation_steps, "remat.profile")
    if training is not None and not isinstance(training, bool):
        raise RematError(f"remat.profile: training must be True, False or None, got {training!r}.")
    if target is not None and not fake:
        raise RematError(
            f"remat.profile: target={target!r} only applies to fake=True; a real profile measures this device."
        )
    modes = {m: m.training for m in model.modules()}

    def restore_modes() -> None:
        for m, mode in modes.items():
            if m.training != mode:
                m.training = mode

    try:
        with costs("remat.profile"), restoring("remat.profile", restore_modes):  # NOTE [Where the time goes]
            set_training(model, training)  # NOTE [Training mode keeps the modules the user froze]
            with model_errors(model, "remat.profile", "a profiled step" + (" on fake tensors" if fake else ""), names):
                prof = _run(model, inputs, loss_fn, names, policies, warmup, repeat, fake, target, loop)
    except OutOfMemory as exc:
        if fake:
            raise
        raise _told_out_of_memory(exc, model, inputs, loss_fn, names, policies, loop, training) from exc.__cause__
    prof.training = model.training if training is None else training
    prof.parameters = sum(p.numel() for p in model.parameters())
    return prof


def _run(
    model: Any,
    inputs: Any,
    loss_fn: Any,
    names: list[str],
    policies: tuple[str, ...],
    warmup: int,
    repeat: int,
    fake: bool,
    target: Any,
    loop: Loop,
) -> Profile:
    from remat.profiling._profile_run import run_profile

    if fake:
        from remat.profiling._fake import run_fake_profile
        from remat.profiling.targets import Target, get_target

        spec = target if isinstance(target, Target) else get_target(target or "cpu")
        with spent("fake profile"):
            short = _short_fake_profile(model, inputs, loss_fn, names, policies, spec, loop)
            if short is not None:
                return short
            return run_fake_profile(model, inputs, loss_fn, names=names, policies=policies, target=spec, loop=loop)
    with spent("real profile"):
        return run_profile(
            model, inputs, loss_fn, names=names, policies=policies, warmup=warmup, repeat=repeat, loop=loop
        )


def _short_fake_profile(
    model: Any, inputs: Any, loss_fn: Any, names: list[str], policies: tuple[str, ...], target: Any, loop: Loop
) -> Profile | None:
    """The fake profile of a short stack of alike blocks, widened (NOTE [Identical blocks are profiled once]);
    None where that does not apply."""
    from remat.profiling._fake import run_fake_profile
    from remat.profiling._repeated_blocks import short_stack, widened
    from remat.profiling._schedule import traced_if, traced_only_if

    with short_stack(model, names, loop) as stack:
        if stack is None:
            return None
        short, left_out = stack
        later = traced_if()
        # NOTE [A policy traced only when wanted]: asked of the whole model's profile, not of the short stack's
        wanted = (
            contextlib.nullcontext()
            if later is None
            else traced_only_if(later[0], lambda p: _wanted_of(later[1], widened(p, short, names, left_out)))
        )
        try:
            with wanted:
                prof = run_fake_profile(
                    model, inputs, loss_fn, names=short, policies=policies, target=target, loop=loop
                )
        except Exception:  # noqa: BLE001  # a forward that needs all its blocks: the whole model is profiled
            return None
    return widened(prof, short, names, left_out)


def _wanted_of(wanted: Any, prof: Profile | None) -> bool:
    """``wanted(prof)``; True where the short stack's profile cannot be widened (the policy is traced)."""
    return True if prof is None else bool(wanted(prof))


# NOTE [A profile that runs out of memory says how much it needs]
# A real profile runs the step without checkpointing, which is why it runs out of memory
# on the device that needs checkpointing. The error then gives the numbers the user needs:
# a profile on fake tensors (it allocates nothing) predicts the peak without checkpointing
# and the lowest peak any plan reaches, and remat.auto with a budget between the two plans
# within it (NOTE [Within the budget] in remat.planning._within).
def _told_out_of_memory(
    exc: OutOfMemory,
    model: Any,
    inputs: Any,
    loss_fn: Any,
    names: list[str],
    policies: tuple[str, ...],
    loop: Loop,
    training: bool | None,
) -> OutOfMemory:
    from remat.core.measure import device_of

    gc.collect()  # the failed step's tensors, then the allocator's cache they went to
    empty_device_cache()
    reason = str(exc.__cause__ or exc).strip().splitlines()[0]
    device = device_of(model, inputs)
    target = "cpu" if device.type != "cuda" else "h100"
    try:
        fake = profile(
            model,
            inputs,
            loss_fn,
            blocks=names,
            policies=(KEEP, FULL),
            fake=True,
            target=target,
            training=training,
            optimizer=loop.optimizer,
            accumulation_steps=loop.accumulation_steps,
        )
    except Exception:  # noqa: BLE001 - the numbers are a courtesy; the out-of-memory is the error
        fake = None
    if fake is None:
        numbers = ""
    else:
        full = fake.predict_peak({b.name: FULL for b in fake.blocks})
        numbers = (
            f" On fake tensors (nothing allocated) its step without checkpointing is predicted at "
            f"{fake.baseline_peak_bytes} bytes and with every block recomputed at {full} bytes."
        )
    return OutOfMemory(
        f"remat.profile: a profiled step on {device} ran out of device memory ({reason}); the model was restored."
        f"{numbers} A real profile runs the step without checkpointing; on a device it does not fit, call "
        "remat.auto(model, inputs, budget) (it plans on fake tensors and runs only steps predicted within the "
        "budget), or remat.profile(..., fake=True); or lower the batch size."
    )

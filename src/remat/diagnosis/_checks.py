"""The doctor's correctness findings: each built from the reference step and the checkpointed step.

Every check is a function of recorded numbers only (nothing here runs the model), so each
can be read and tested on its own. Messages say what happened with the numbers, and why;
``fix`` says what to change. The cost findings are in ``_cost_checks``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from remat.diagnosis._calls import CheckpointCall
from remat.diagnosis._findings import (
    ERROR,
    MISSING,
    Finding,
    StepRecord,
    call_sites,
    collapse,
    owner_of,
    reentrant_fix,
    same_python,
    union_of,
    where_called,
    within_module,
)


def _nonzero(grad: torch.Tensor | None) -> bool:
    return grad is not None and bool(grad.any())


def frozen(ref: StepRecord, ck: StepRecord) -> tuple[str, ...]:
    """Trainable parameters with a non-zero gradient without checkpointing and none (or zero) with it."""
    return tuple(n for n, g in ref.grads.items() if _nonzero(g) and not _nonzero(ck.grads.get(n)))


def check_frozen(ref: StepRecord, ck: StepRecord, params: tuple[str, ...]) -> list[Finding]:
    if not params:
        return []
    modules = collapse(params, ref.grads)
    owners = {owner_of(p) for p in params}
    causes = [
        c for c in ck.calls if c.reentrant and not c.inputs_require_grad and any(within_module(c, m) for m in owners)
    ]
    grads = [ref.grads[p] for p in params]
    present = [g for g in grads if g is not None]
    if len(present) != len(grads):
        raise RuntimeError("frozen parameters are those with a reference gradient")
    values = sum(g.numel() for g in present)
    largest = max(float(g.abs().max()) for g in present)
    message = (
        f"{len(params)} trainable parameters of {', '.join(modules)} ({values:,} values) get no gradient with "
        f"checkpointing but do without it (largest gradient without checkpointing: {largest:.3g}); "
        "they are not trained."
    )
    if causes:
        unset = any(c.use_reentrant_unset for c in causes)
        message += (
            f" Cause: {where_called(causes)} use{'s' if len(causes) == 1 else ''} the reentrant implementation "
            f"({'use_reentrant left unset, which torch 2.13 treats as True' if unset else 'use_reentrant=True'}) "
            "and no input of the checkpointed call requires grad (raw data, or the output of another such "
            "checkpoint), so its output does not require grad and backward never reaches the parameters inside."
        )
        fix = reentrant_fix(causes) + (
            " Once it trains, run the doctor again: a checkpoint around the first layer or the whole network saves "
            "little, since its recomputation rebuilds what the step without it keeps."
        )
    else:
        inside = [c for c in ck.calls if any(within_module(c, m) for m in owners)]
        message += f" The gradient is lost inside {where_called(inside) or 'a checkpointed region'}."
        fix = (
            "Make sure the checkpointed function's outputs depend on these parameters through autograd; "
            "use remat.checkpoint, which records the graph normally."
        )
    return [
        Finding(
            "frozen-by-checkpoint",
            ERROR,
            message,
            fix,
            modules,
            params,
            call_sites(causes),
            {"params": len(params), "values": values, "largest_reference_grad": largest},
        )
    ]


def check_gradients(ref: StepRecord, ck: StepRecord, skip: set[str], rtol: float, atol: float) -> list[Finding]:
    bad = []
    for name, g in ref.grads.items():
        h = ck.grads.get(name)
        if g is None or h is None or name in skip:
            continue
        err = float((h.double() - g.double()).abs().max())
        scale = float(g.abs().max())
        if err > atol + rtol * scale:
            bad.append((err / scale if scale else float("inf"), err, name))
    if not bad:
        return []
    bad.sort(reverse=True)
    worst = ", ".join(f"{n} (max abs error {e:.3g}, {r:.1%} of its largest gradient)" for r, e, n in bad[:3])
    random = [c for c in ck.calls if not c.preserve_rng_state and c.random_ops]
    if random:
        why = (
            f" Likely cause: {where_called(random)} draws random numbers with preserve_rng_state=False "
            "(see rng-not-preserved)."
        )
    else:
        why = (
            " The checkpointed function is not a pure function of its inputs: recomputation saw different state "
            "(random numbers, buffers or Python attributes) than the forward."
        )
    message = (
        f"Gradients of {len(bad)} parameters differ from the step without checkpointing beyond rtol={rtol:g}, "
        f"atol={atol:g}; worst: {worst}. Loss {ck.loss:.6g} with checkpointing, {ref.loss:.6g} without.{why}"
    )
    fix = (
        "Keep preserve_rng_state=True (the default) and keep state changes out of checkpointed regions, or use "
        "remat.checkpoint, which restores the RNG and buffers for recomputation."
    )
    params = tuple(n for _, _, n in bad)
    return [
        Finding(
            "wrong-gradients",
            ERROR,
            message,
            fix,
            collapse(params, ref.grads),
            params,
            call_sites(random),
            {
                "params": len(bad),
                "max_abs_error": bad[0][1],
                "max_rel_error": bad[0][0],
                "loss_reference": ref.loss,
                "loss_checkpointed": ck.loss,
            },
        )
    ]


def check_rng(ck: StepRecord) -> list[Finding]:
    groups: dict[tuple[str, str], list[CheckpointCall]] = defaultdict(list)
    for c in ck.calls:
        if not c.preserve_rng_state and c.random_ops:
            groups[(c.site, c.target)].append(c)
    findings = []
    for calls in groups.values():
        drawers = tuple(sorted(set().union(*(c.random_modules for c in calls))))
        ops = sum(c.random_ops for c in calls)
        verb = "draws" if len(drawers) == 1 else "draw"
        message = (
            f"{where_called(calls)} runs with preserve_rng_state=False, but {', '.join(drawers)} {verb} "
            f"random numbers inside it ({ops} random ops per step). Recomputation in backward draws different "
            "numbers (a different dropout mask), so gradients are computed for a forward that never happened."
        )
        fix = (
            "Remove preserve_rng_state=False: the default stashes and restores the RNG state, so dropout works "
            "inside a checkpoint and need not be moved out of the block; remat.checkpoint does the same."
        )
        findings.append(
            Finding(
                "rng-not-preserved",
                ERROR,
                message,
                fix,
                union_of([drawers, *(c.module_names for c in calls)]),
                (),
                call_sites(calls),
                {"random_ops": ops},
            )
        )
    return findings


def check_saved_random(ck: StepRecord) -> list[Finding]:
    groups: dict[tuple[str, str], list[CheckpointCall]] = defaultdict(list)
    for c in ck.calls:
        if c.saved_random_ops:
            groups[(c.site, c.target)].append(c)
    findings = []
    for calls in groups.values():
        ops = sorted({op for c in calls for op in c.saved_random_ops})
        count = sum(len(c.saved_random_ops) for c in calls)
        message = (
            f"{where_called(calls)} uses selective checkpointing that keeps the output of {', '.join(ops)}, "
            "which draws "
            f"random numbers ({count} such outputs kept per step). Recompute reuses the kept output without drawing, "
            "so the random number generator is not advanced and every later random op of the region (dropout) "
            "draws a different mask than the forward did. On CUDA, scaled_dot_product_attention with dropout is "
            "such an op."
        )
        fix = (
            "Use remat.checkpoint(fn, *args, policy=...) with the same op list or policy function: it advances "
            "the generator past every kept random op in recompute. With torch's checkpoint, leave random ops out "
            "of the save list (return PREFER_RECOMPUTE for them)."
        )
        findings.append(
            Finding(
                "saved-random-op",
                ERROR,
                message,
                fix,
                union_of(c.module_names for c in calls),
                (),
                call_sites(calls),
                {"saved_random_outputs": count},
            )
        )
    return findings


def check_rng_stream(ref: StepRecord, ck: StepRecord) -> list[Finding]:
    if len(ref.rng) == len(ck.rng) and all(torch.equal(a, b) for a, b in zip(ref.rng, ck.rng)):
        return []
    streams = ["CPU", *(f"cuda:{i}" for i in range(max(len(ref.rng), len(ck.rng)) - 1))]
    differ = [s for s, a, b in zip(streams, ref.rng, ck.rng) if not torch.equal(a, b)] or streams
    message = (
        f"After one step the random number stream{'s' if len(differ) > 1 else ''} ({', '.join(differ)}) differ from "
        "the step without checkpointing: recomputation drew from the global generator without restoring it, so "
        "every later step draws different dropout masks and data-loader shuffles than the model without "
        "checkpointing would."
    )
    fix = (
        "Keep preserve_rng_state=True (the default), which restores the generators around recomputation, or "
        "use remat.checkpoint; draw random numbers inside checkpointed regions only from the default generators."
    )
    return [Finding("rng-stream-changed", ERROR, message, fix, (), (), call_sites(ck.calls), {"streams": len(differ)})]


def check_buffers(ref: StepRecord, ck: StepRecord, before: dict[str, torch.Tensor | None]) -> list[Finding]:
    names = [n for n, b in ref.buffers.items() if n in ck.buffers and not torch.equal(b, ck.buffers[n])]
    if not names:
        return []
    modules = tuple(dict.fromkeys(owner_of(n) for n in names))
    numbers: dict[str, float] = {"buffers": len(names)}
    same_shape = [n for n in names if ref.buffers[n].shape == ck.buffers[n].shape]
    counters = [n for n in same_shape if not ref.buffers[n].is_floating_point() and before.get(n) is not None]
    detail = ""
    if counters:
        first = before[counters[0]]
        if first is None:
            raise RuntimeError("counters are the buffers read before the step")
        start = first.to(ref.buffers[counters[0]].device)
        r, c = (float((rec.buffers[counters[0]] - start).max()) for rec in (ref, ck))
        numbers |= {"advance_reference": r, "advance_checkpointed": c}
        detail = f": {counters[0]} advances by {c:g} per step instead of {r:g}"
    floats = [n for n in same_shape if ref.buffers[n].is_floating_point()]
    if floats:
        diff = max(float((ref.buffers[n].double() - ck.buffers[n].double()).abs().max()) for n in floats)
        numbers["max_abs_diff"] = diff
        detail += f"{'; ' if detail else ': '}running values differ by up to {diff:.3g}"
    calls = [c for c in ck.calls if any(within_module(c, m) for m in modules)]
    message = (
        f"{len(names)} buffers of {', '.join(modules)} end the step differently with checkpointing than "
        f"without{detail}. "
        f"{where_called(calls) or 'The checkpoint'} reruns the forward in backward, and the modules update their "
        "running "
        "statistics again in the recomputation."
    )
    fix = (
        "Use remat.checkpoint or remat.wrap, which update module buffers once per step and let the recomputation "
        "see the values the forward saw; or keep these modules outside checkpointed regions."
    )
    return [Finding("buffers-updated-twice", ERROR, message, fix, modules, tuple(names), call_sites(calls), numbers)]


def _show(value: Any) -> str:
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str):
        return f"{value[0]} of length {value[1]}"
    return "unset" if value is MISSING else repr(value)


def check_side_effects(ref: StepRecord, ck: StepRecord, hooks: dict[str, tuple[list[str], list[str]]]) -> list[Finding]:
    changed: dict[str, list[str]] = defaultdict(list)
    for key in dict.fromkeys([*ref.python, *ck.python]):
        if not same_python(ref, ck, key):
            a, b = ref.python.get(key, MISSING), ck.python.get(key, MISSING)
            changed[key[0]].append(f"{key[1]} is {_show(b)} after the step instead of {_show(a)}")

    def runs(record: StepRecord, m: str) -> int:
        return record.forward_calls.get(m, 0) + record.backward_calls.get(m, 0)

    for module, (pre, post) in hooks.items():
        again = (pre if runs(ck, module) > runs(ref, module) else []) + (
            post if ck.completed.get(module, 0) > ref.completed.get(module, 0) else []
        )
        if again:
            changed[module].append(f"forward hooks {', '.join(again)} run again with it")
    if not changed:
        return []
    lines = [
        f"{m} runs {runs(ck, m)} times per step ({ck.backward_calls.get(m, 0)} recomputed in backward) instead of "
        f"{runs(ref, m)}; {'; '.join(what)}"
        for m, what in changed.items()
    ]
    calls = [c for c in ck.calls if any(within_module(c, m) for m in changed)]
    where = where_called(calls) or "recomputation"
    message = f"Forward side effects repeat under checkpointing ({where}): " + ". ".join(lines) + "."
    fix = (
        "Keep side effects (counters, caches, logging, hooks) out of checkpointed regions, or guard them with "
        "`if not remat.is_recomputing():` and checkpoint with remat.checkpoint / remat.wrap."
    )
    worst = max(changed, key=lambda m: runs(ck, m) - runs(ref, m))
    return [
        Finding(
            "side-effects-repeated",
            ERROR,
            message,
            fix,
            tuple(changed),
            (),
            call_sites(calls),
            {"calls_reference": runs(ref, worst), "calls_checkpointed": runs(ck, worst)},
        )
    ]

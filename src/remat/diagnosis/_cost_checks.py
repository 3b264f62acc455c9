"""The doctor's cost findings: a checkpoint that does not lower the peak, a reentrant call, a speed-up
that is frozen layers. Functions of recorded numbers only, as in ``_checks``."""

from __future__ import annotations

from collections import defaultdict

from remat.diagnosis._calls import CallKey, CheckpointCall
from remat.diagnosis._findings import (
    WARNING,
    Costs,
    Finding,
    StepRecord,
    call_sites,
    collapse,
    fastest,
    reentrant_fix,
    union_of,
    where_called,
)
from remat.profiling._format import human_bytes


def _leaves(call: CheckpointCall, leaves: set[str]) -> int:
    return len({m for m in call.modules | set(call.module_names) if m in leaves})


def removable_units(calls: list[CheckpointCall]) -> dict[tuple[str, str], list[CallKey]]:
    """The top-level calls that train, by (site, target): removing a checkpoint removes every call of it."""
    units: dict[tuple[str, str], list[CallKey]] = {}
    for c in calls:
        if c.depth == 0 and c.output_requires_grad is not False:
            units.setdefault((c.site, c.target), []).append(c.key)
    return units


def check_cost(
    ck: StepRecord, costs: Costs, leaves: set[str], min_saving: float, budget: int | None = None
) -> list[Finding]:
    """``budget``: of the plan remat put on the model; a checkpoint without which the step is over it pays, however
    little it saves (the plan needs it). ``costs.without`` is keyed by :func:`removable_units`."""
    if costs.checkpointed is None:
        return []
    base = max(costs.reference.step_peak_bytes, 1)
    with_ = costs.checkpointed
    findings = []
    units = removable_units(ck.calls)
    by_key = {c.key: c for c in ck.calls}
    for unit, keys in units.items():
        without = costs.without.get(unit)
        if without is None:
            continue
        calls = [by_key[k] for k in keys]
        call = calls[0]
        saving = without.peak_bytes - with_.peak_bytes
        if saving >= min_saving * base or (budget is not None and without.peak_bytes > budget):
            continue
        if _leaves(call, leaves) <= 1:
            kept = " (here raw data, kept in memory anyway)" if not call.inputs_require_grad else ""
            why = f"A single layer keeps only its input{kept} for backward, and the checkpoint keeps that input too."
        else:
            why = (
                "The step's peak is set elsewhere (in another block's backward or the loss), so what this region "
                "frees does not lower it."
            )
        if budget is not None:
            why += f" Without it the step is still within the {human_bytes(budget)} budget of remat's plan."
        t_with, t_without = fastest(with_), fastest(without)
        times = f" ({len(calls)} calls)" if len(calls) > 1 else ""
        message = (
            f"{where_called(calls)}{times} lowers the step's peak memory by {human_bytes(saving)} "
            f"({saving / base:.1%} of the "
            f"step's own peak without checkpointing): {human_bytes(with_.peak_bytes)} with it, "
            f"{human_bytes(without.peak_bytes)} without. "
            f"Recomputing it makes the step {t_with * 1e3:.1f} ms instead of "
            f"{t_without * 1e3:.1f} ms (fastest of {len(with_.step_times_s)} timed steps). {why}"
        )
        fix = (
            f"Remove this checkpoint on {call.label} (it costs recomputation for nothing), or checkpoint larger "
            "blocks whose internals are much bigger than their inputs."
        )
        findings.append(
            Finding(
                "checkpoint-does-not-pay",
                WARNING,
                message,
                fix,
                call.module_names,
                (),
                call_sites(calls),
                {
                    "peak_bytes_with": with_.peak_bytes,
                    "peak_bytes_without": without.peak_bytes,
                    "saving_bytes": saving,
                    "step_time_s_with": t_with,
                    "step_time_s_without": t_without,
                    "extra_time_s": t_with - t_without,
                },
            )
        )
    return findings


def check_risky(ck: StepRecord) -> list[Finding]:
    groups: dict[str, list[CheckpointCall]] = defaultdict(list)
    for c in ck.calls:
        if c.reentrant:
            groups[c.site].append(c)
    findings = []
    for site, calls in groups.items():
        unset = any(c.use_reentrant_unset for c in calls)
        targets = tuple(dict.fromkeys(c.label for c in calls))
        how = (
            "leaves use_reentrant unset, which torch 2.13 treats as use_reentrant=True"
            if unset
            else "passes use_reentrant=True"
        )
        at = f" at {site}" if site else ""
        count = f"{len(calls)} call{'s' if len(calls) > 1 else ''} per step"
        message = (
            f"{calls[0].api}{at} ({', '.join(targets)}; {count}) {how}. The reentrant implementation gives no "
            "gradient to the parameters inside when no input requires grad, rejects keyword arguments and "
            "torch.autograd.grad; PyTorch recommends use_reentrant=False."
        )
        findings.append(
            Finding(
                "risky-call",
                WARNING,
                message,
                reentrant_fix(calls),
                union_of(c.module_names for c in calls),
                (),
                call_sites(calls),
                {"calls": len(calls), "use_reentrant_unset": float(unset)},
            )
        )
    return findings


def check_speedup(costs: Costs | None, ref: StepRecord, params: tuple[str, ...]) -> list[Finding]:
    if costs is None or costs.checkpointed is None or not params:
        return []
    r, c = costs.reference, costs.checkpointed
    t_ref, t_ck = fastest(r), fastest(c)
    if t_ck >= t_ref:
        return []
    modules = collapse(params, ref.grads)
    message = (
        f"The checkpointed step looks {t_ref / t_ck:.2f}x faster ({t_ck * 1e3:.1f} ms instead of {t_ref * 1e3:.1f} ms, "
        f"fastest of {len(c.step_times_s)} timed steps) with a peak of {human_bytes(c.peak_bytes)} instead of "
        f"{human_bytes(r.peak_bytes)}, although recomputation can only add work: {len(params)} parameters of "
        f"{', '.join(modules)} get no gradient, so their backward and the activations it needs are skipped. "
        "It is not a speed-up: those layers are not being trained."
    )
    fix = (
        "Fix frozen-by-checkpoint first, then compare again with remat.measure: correct checkpointing makes a step "
        "slower, not faster, and lighter only where it frees activations."
    )
    return [
        Finding(
            "illusory-speedup",
            WARNING,
            message,
            fix,
            modules,
            params,
            (),
            {
                "step_time_s_reference": t_ref,
                "step_time_s_checkpointed": t_ck,
                "peak_bytes_reference": r.peak_bytes,
                "peak_bytes_checkpointed": c.peak_bytes,
                "untrained_params": len(params),
            },
        )
    ]

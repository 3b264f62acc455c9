"""The doctor's findings, each built from the reference step, the checkpointed step and the costs.

Every check is a function of recorded numbers only (nothing here runs the model), so each
can be read and tested on its own. Messages say what happened with the numbers, and why;
``fix`` says what to change.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from remat.core.measure import Measurement
from remat.diagnosis._intercept import ROOT, CallKey, CheckpointCall
from remat.profiling._format import human_bytes

ERROR, WARNING = "error", "warning"


@dataclass(frozen=True)
class Finding:
    """One problem the doctor found, with the numbers behind it and how to fix it."""

    code: str
    """Stable identifier: ``frozen-by-checkpoint``, ``wrong-gradients``, ``rng-not-preserved``,
    ``saved-random-op``, ``rng-stream-changed``, ``buffers-updated-twice``, ``side-effects-repeated``,
    ``checkpoint-does-not-pay``,
    ``risky-call`` or ``illusory-speedup``."""
    severity: str
    """``"error"``: training differs from the model without checkpointing; ``"warning"``:
    training is right but the checkpointing is wasteful, risky or misread."""
    message: str
    """What happened, with the numbers, and why."""
    fix: str
    """What to change."""
    modules: tuple[str, ...] = ()
    """Qualified names of the modules involved (``<root>`` for the model itself)."""
    params: tuple[str, ...] = ()
    """Parameter names involved, worst first where there is an order."""
    sites: tuple[str, ...] = ()
    """``file:line`` of the checkpoint calls involved."""
    numbers: dict[str, float] = field(default_factory=dict)
    """The measured numbers the message quotes, by name."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


@dataclass
class StepRecord:
    """What one observed training step left behind."""

    loss: float
    grads: dict[str, torch.Tensor | None]
    """Gradient of every trainable parameter (None: received none)."""
    buffers: dict[str, torch.Tensor]
    python: dict[tuple[str, str], Any]
    """Watched Python values after the step (``remat.diagnosis._python_state``)."""
    calls: list[CheckpointCall]
    forward_calls: dict[str, int]
    """Module forwards started in forward, by module name."""
    backward_calls: dict[str, int]
    """Module forwards started during backward (recomputation)."""
    completed: dict[str, int]
    """Module forwards that returned (their forward hooks ran), forward and backward."""
    rng: list[torch.Tensor] = field(default_factory=list)
    """The RNG states after the step: CPU, then each CUDA device (when CUDA is initialised)."""


@dataclass
class Costs:
    """Measured steps: reference (no checkpointing), as written, and without one region each."""

    reference: Measurement
    checkpointed: Measurement | None
    without: dict[CallKey, Measurement]


def _owner(param: str) -> str:
    return param.rpartition(".")[0] or ROOT


def collapse(chosen: Iterable[str], every: Iterable[str]) -> tuple[str, ...]:
    """The outermost modules below the root all of whose parameters (among ``every``) are in ``chosen``."""
    chosen, every = list(chosen), list(every)
    picked = set(chosen)
    out: list[str] = []
    for name in chosen:
        parts = name.split(".")[:-1]
        for i in range(min(1, len(parts)), len(parts) + 1):
            prefix = ".".join(parts[:i])
            under = [p for p in every if not prefix or p.startswith(prefix + ".")]
            if all(p in picked for p in under):
                module = prefix or ROOT
                if module not in out:
                    out.append(module)
                break
    return tuple(out)


def _union(groups: Iterable[Iterable[str]]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(m for g in groups for m in g))


def _where(calls: Iterable[CheckpointCall]) -> str:
    seen = dict.fromkeys(f"{c.api}({c.label})" + (f" at {c.site}" if c.site else "") for c in calls)
    return "; ".join(seen)


def _sites(calls: Iterable[CheckpointCall]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(c.site for c in calls if c.site))


def _inside(call: CheckpointCall, module: str) -> bool:
    return module in call.modules or any(module == m or module.startswith(m + ".") for m in call.module_names)


def reentrant_fix(calls: Iterable[CheckpointCall]) -> str:
    apis = {c.api for c in calls}
    fixes = ["use remat.checkpoint(fn, *args) or remat.wrap(module), which never freeze parameters"]
    if "Hugging Face gradient checkpointing" in apis:
        fixes.append('call model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})')
    if "torch checkpoint_wrapper" in apis:
        fixes.append("pass checkpoint_impl=CheckpointImpl.NO_REENTRANT to checkpoint_wrapper")
    if apis & {"torch.utils.checkpoint.checkpoint", "torch.utils.checkpoint.checkpoint_sequential"}:
        fixes.append("pass use_reentrant=False")
    text = "; or ".join(fixes)
    return text[0].upper() + text[1:] + "."


def _nonzero(grad: torch.Tensor | None) -> bool:
    return grad is not None and bool(grad.any())


def frozen(ref: StepRecord, ck: StepRecord) -> tuple[str, ...]:
    """Trainable parameters with a non-zero gradient without checkpointing and none (or zero) with it."""
    return tuple(n for n, g in ref.grads.items() if _nonzero(g) and not _nonzero(ck.grads.get(n)))


def check_frozen(ref: StepRecord, ck: StepRecord, params: tuple[str, ...]) -> list[Finding]:
    if not params:
        return []
    modules = collapse(params, ref.grads)
    owners = {_owner(p) for p in params}
    causes = [c for c in ck.calls if c.reentrant and not c.inputs_require_grad and any(_inside(c, m) for m in owners)]
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
            f" Cause: {_where(causes)} use{'s' if len(causes) == 1 else ''} the reentrant implementation "
            f"({'use_reentrant left unset, which torch 2.13 treats as True' if unset else 'use_reentrant=True'}) "
            "and no input of the checkpointed call requires grad (raw data, or the output of another such "
            "checkpoint), so its output does not require grad and backward never reaches the parameters inside."
        )
        fix = reentrant_fix(causes) + (
            " Once it trains, run the doctor again: a checkpoint around the first layer or the whole network saves "
            "little, since its recomputation rebuilds what the step without it keeps."
        )
    else:
        inside = [c for c in ck.calls if any(_inside(c, m) for m in owners)]
        message += f" The gradient is lost inside {_where(inside) or 'a checkpointed region'}."
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
            _sites(causes),
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
            f" Likely cause: {_where(random)} draws random numbers with preserve_rng_state=False "
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
            _sites(random),
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
            f"{_where(calls)} runs with preserve_rng_state=False, but {', '.join(drawers)} {verb} "
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
                _union([drawers, *(c.module_names for c in calls)]),
                (),
                _sites(calls),
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
            f"{_where(calls)} uses selective checkpointing that keeps the output of {', '.join(ops)}, which draws "
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
                _union(c.module_names for c in calls),
                (),
                _sites(calls),
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
    return [Finding("rng-stream-changed", ERROR, message, fix, (), (), _sites(ck.calls), {"streams": len(differ)})]


def check_buffers(ref: StepRecord, ck: StepRecord, before: dict[str, torch.Tensor | None]) -> list[Finding]:
    names = [n for n, b in ref.buffers.items() if n in ck.buffers and not torch.equal(b, ck.buffers[n])]
    if not names:
        return []
    modules = tuple(dict.fromkeys(_owner(n) for n in names))
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
    calls = [c for c in ck.calls if any(_inside(c, m) for m in modules)]
    message = (
        f"{len(names)} buffers of {', '.join(modules)} end the step differently with checkpointing than "
        f"without{detail}. "
        f"{_where(calls) or 'The checkpoint'} reruns the forward in backward, and the modules update their running "
        "statistics again in the recomputation."
    )
    fix = (
        "Use remat.checkpoint or remat.wrap, which update module buffers once per step and let the recomputation "
        "see the values the forward saw; or keep these modules outside checkpointed regions."
    )
    return [Finding("buffers-updated-twice", ERROR, message, fix, modules, tuple(names), _sites(calls), numbers)]


_MISSING = object()


def _show(value: Any) -> str:
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str):
        return f"{value[0]} of length {value[1]}"
    return "unset" if value is _MISSING else repr(value)


def check_side_effects(ref: StepRecord, ck: StepRecord, hooks: dict[str, tuple[list[str], list[str]]]) -> list[Finding]:
    changed: dict[str, list[str]] = defaultdict(list)
    for key in dict.fromkeys([*ref.python, *ck.python]):
        a, b = ref.python.get(key, _MISSING), ck.python.get(key, _MISSING)
        if a != b and not (isinstance(a, float) and isinstance(b, float) and a != a and b != b):
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
    calls = [c for c in ck.calls if any(_inside(c, m) for m in changed)]
    where = _where(calls) or "recomputation"
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
            _sites(calls),
            {"calls_reference": runs(ref, worst), "calls_checkpointed": runs(ck, worst)},
        )
    ]


def fastest(m: Measurement) -> float:
    """The fastest timed step: other work on the machine only ever adds time, so comparisons use it."""
    return min(m.step_times_s)


def _leaves(call: CheckpointCall, leaves: set[str]) -> int:
    return len({m for m in call.modules | set(call.module_names) if m in leaves})


def check_cost(ck: StepRecord, costs: Costs, leaves: set[str], min_saving: float) -> list[Finding]:
    if costs.checkpointed is None:
        return []
    base = max(costs.reference.step_peak_bytes, 1)
    with_ = costs.checkpointed
    findings = []
    for call in ck.calls:
        without = costs.without.get(call.key)
        if without is None:
            continue
        saving = without.peak_bytes - with_.peak_bytes
        if saving >= min_saving * base:
            continue
        if _leaves(call, leaves) <= 1:
            kept = " (here raw data, kept in memory anyway)" if not call.inputs_require_grad else ""
            why = f"A single layer keeps only its input{kept} for backward, and the checkpoint keeps that input too."
        else:
            why = (
                "The step's peak is set elsewhere (in another block's backward or the loss), so what this region "
                "frees does not lower it."
            )
        t_with, t_without = fastest(with_), fastest(without)
        message = (
            f"{_where([call])} lowers the step's peak memory by {human_bytes(saving)} ({saving / base:.1%} of the "
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
                _sites([call]),
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
                _union(c.module_names for c in calls),
                (),
                _sites(calls),
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

"""``remat.doctor``: find the silent checkpointing bugs in a model as the user wrote it.

NOTE [How the doctor decides]
Both forum users of ``shared/seeds`` had models that ran, converged worse or not at all,
and raised nothing. The only trustworthy reference is the same model without its
checkpointing, so the doctor runs one training step twice from identical weights,
buffers, RNG state and Python attributes: once with every checkpoint call turned into a
plain call (``remat.diagnosis._intercept``), once as written, observing each checkpointed
call (its site, implementation, inputs, the modules and random ops inside it). It then
compares gradients, buffers, Python side effects and module call counts (leaving out what
differs between two steps without checkpointing: NOTE [A model must agree with itself
before checkpointing is blamed] in ``remat.diagnosis._noise``). With
``measure_cost=True`` it also measures (``remat.measure``) the step without checkpointing,
as written, and as written minus one top-level region at a time (peaks from one tracked
step each, times from interleaved rounds), for the regions that cost time without
lowering the peak, and for speed-ups that only come from skipped work.
Afterwards the model, the RNG streams and torch are exactly as before, also on errors.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn

from remat.core._autocast import outside_autocast
from remat.core._state import ModelState, capture, restoring
from remat.core._step import InputGrads, LossFn, call_model, compute_loss, training_step
from remat.core.measure import Measurement, _sync, device_of, measure
from remat.diagnosis import _checks as checks
from remat.diagnosis import _cost_checks as cost_checks
from remat.diagnosis._calls import CallKey, CheckpointCall
from remat.diagnosis._findings import ERROR, Costs, Finding, StepRecord
from remat.diagnosis._intercept import Interceptor, always, never, observing, session
from remat.diagnosis._noise import Differences, check_reproducible, differences, without_noise
from remat.diagnosis._python_state import PythonState
from remat.errors import RematError
from remat.planning._put import applied_budget

__all__ = ["doctor", "DoctorReport", "Finding", "CheckpointSite"]

Plain = Callable[[CallKey], bool]
"""Which checkpointed calls (by key) run as plain calls."""


@dataclass(frozen=True)
class CheckpointSite:
    """A place in the code that checkpoints, as seen in one training step."""

    site: str
    """``file:line`` of the call (the first frame outside torch and remat's machinery)."""
    target: str
    """The module (qualified name) checkpointed there, or the function and the modules it runs."""
    api: str
    """How: ``torch.utils.checkpoint.checkpoint``, ``checkpoint_sequential``, ``remat.wrap``, ..."""
    calls: int
    """Checkpointed calls per step from this site and target."""
    reentrant: bool
    """True when torch's reentrant implementation runs."""
    preserve_rng_state: bool
    """False when recomputation does not restore the RNG state."""


@dataclass(frozen=True)
class DoctorReport:
    """What :func:`doctor` found."""

    findings: tuple[Finding, ...]
    """Every problem found, errors first."""
    checkpoints: tuple[CheckpointSite, ...]
    """The checkpointing the model does (empty: none; then there is nothing to diagnose)."""
    loss_reference: float
    """Loss of the step without checkpointing."""
    loss_checkpointed: float
    """Loss of the step as written."""
    reference: Measurement | None = None
    """The step without checkpointing, measured (None with ``measure_cost=False``)."""
    checkpointed: Measurement | None = None
    """The step as written, measured (None with ``measure_cost=False`` or when it trains nothing)."""

    @property
    def ok(self) -> bool:
        """True when there is nothing to fix."""
        return not self.findings

    @property
    def errors(self) -> tuple[Finding, ...]:
        """Findings where training differs from the model without checkpointing."""
        return tuple(f for f in self.findings if f.severity == ERROR)

    def codes(self) -> list[str]:
        """The findings' codes, in order."""
        return [f.code for f in self.findings]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (what ``remat doctor --json`` prints)."""
        return {
            "ok": self.ok,
            "findings": [f.to_dict() for f in self.findings],
            "checkpoints": [asdict(c) for c in self.checkpoints],
            "loss_reference": self.loss_reference,
            "loss_checkpointed": self.loss_checkpointed,
            "reference": None if self.reference is None else asdict(self.reference),
            "checkpointed": None if self.checkpointed is None else asdict(self.checkpointed),
        }


@dataclass
class _Run:
    """Everything one doctor call shares between its steps."""

    model: nn.Module
    inputs: Any
    loss_fn: LossFn | None
    icpt: Interceptor
    state: ModelState
    python: PythonState
    python_before: list


def _step(run: _Run, *, plain: bool) -> StepRecord:
    run.state.restore()
    run.python.restore(run.python_before)
    run.model.zero_grad(set_to_none=True)
    run.icpt.start(always if plain else never, recording=not plain)
    with observing(run.icpt):
        loss = compute_loss(call_model(run.model, run.inputs), run.loss_fn)
        if loss.requires_grad:
            with outside_autocast():  # NOTE [Autocast around remat's calls] in remat.core._autocast
                loss.backward()
        elif plain:
            raise RematError(
                "remat.doctor: the loss does not require grad even without checkpointing, so there is nothing to "
                "diagnose; check that the model has trainable parameters and that the step is not under "
                "torch.no_grad()."
            )
    icpt = run.icpt
    return StepRecord(
        loss=float(loss.detach()),
        grads={
            n: None if p.grad is None else p.grad.detach().clone()
            for n, p in run.model.named_parameters()
            if p.requires_grad
        },
        buffers={n: b.detach().clone() for n, b in run.model.named_buffers() if b is not None},
        python=run.python.summary(),
        calls=list(icpt.calls),
        forward_calls=dict(icpt.forward_calls),
        backward_calls=dict(icpt.backward_calls),
        completed=dict(icpt.completed),
        rng=_rng_states(),
    )


def _rng_states() -> list:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
    return [torch.get_rng_state(), *cuda]


def _measure(run: _Run, plain: Plain, warmup: int) -> Measurement:
    run.icpt.start(plain, recording=False)
    try:
        return measure(run.model, run.inputs, run.loss_fn, warmup=warmup, repeat=1)
    finally:
        run.python.restore(run.python_before)


def _interleaved_times(run: _Run, configs: dict[Any, Plain], repeat: int) -> dict[Any, list[float]]:
    # Rounds of one step per configuration: a burst of other work on the machine then slows
    # every configuration alike instead of flattering whichever ran in a quiet moment.
    device = device_of(run.model, run.inputs)
    times: dict[Any, list[float]] = {name: [] for name in configs}
    try:
        for _ in range(repeat):
            for name, plain in configs.items():
                run.icpt.start(plain, recording=False)
                run.model.zero_grad(set_to_none=True)
                _sync(device)
                start = time.perf_counter()
                training_step(run.model, run.inputs, run.loss_fn)
                _sync(device)
                times[name].append(time.perf_counter() - start)
    finally:
        run.state.restore()
        run.python.restore(run.python_before)
    return times


def _costs(run: _Run, ck: StepRecord, warmup: int, repeat: int) -> Costs:
    configs: dict[Any, Plain] = {"reference": always}
    if any(g is not None for g in ck.grads.values()):  # as written the step trains something: time it too
        configs["checkpointed"] = never
        # Only top-level regions that train: turning off a nested one changes its parent's
        # recomputation, and a region whose output needs no grad "saves" by training nothing. Every
        # call of one target at one site goes off together: removing that checkpoint removes them all
        # (a shared layer called four times, ALBERT's).
        for unit, keys in cost_checks.removable_units(ck.calls).items():
            configs[unit] = frozenset(keys).__contains__
    peaks = {name: _measure(run, plain, warmup) for name, plain in configs.items()}
    times = _interleaved_times(run, configs, repeat)
    done = {
        name: replace(m, step_time_s=statistics.median(times[name]), step_times_s=tuple(times[name]))
        for name, m in peaks.items()
    }
    return Costs(done.pop("reference"), done.pop("checkpointed", None), done)


def _sites(calls: list[CheckpointCall]) -> tuple[CheckpointSite, ...]:
    groups: dict[tuple[str, str], list[CheckpointCall]] = {}
    for c in calls:
        groups.setdefault((c.site, c.label), []).append(c)
    return tuple(
        CheckpointSite(site, target, cs[0].api, len(cs), cs[0].reentrant, all(c.preserve_rng_state for c in cs))
        for (site, target), cs in groups.items()
    )


def _check_options(model: Any, rtol: float, atol: float, min_saving: float, warmup: int, repeat: int) -> None:
    if not isinstance(model, nn.Module):
        raise RematError(f"remat.doctor: model must be an nn.Module, got {type(model).__name__}.")
    if rtol < 0 or atol < 0 or not 0 <= min_saving < 1:
        raise RematError(
            f"remat.doctor: need rtol >= 0, atol >= 0 and 0 <= min_saving < 1, got rtol={rtol}, atol={atol}, "
            f"min_saving={min_saving}."
        )
    if warmup < 0 or repeat < 1:
        raise RematError(f"remat.doctor: need warmup >= 0 and repeat >= 1, got warmup={warmup}, repeat={repeat}.")


def doctor(
    model: nn.Module,
    inputs: Any,
    loss_fn: LossFn | None = None,
    *,
    rtol: float = 1e-4,
    atol: float = 1e-6,
    min_saving: float = 0.02,
    measure_cost: bool = True,
    warmup: int = 1,
    repeat: int = 3,
) -> DoctorReport:
    """Run a training step with and without ``model``'s checkpointing and report what differs.

    Works with whatever checkpointing the model uses: ``torch.utils.checkpoint`` (reentrant
    or not), ``checkpoint_sequential``, torch's ``checkpoint_wrapper``, Hugging Face
    gradient checkpointing, ``remat.checkpoint`` and ``remat.wrap``. The model, its
    gradients, the RNG streams and torch are restored afterwards. A compiled model
    (``torch.compile(model)``, ``model.compile()``) is diagnosed eagerly, as written:
    under compile its checkpointed blocks become torch's checkpoint operator, whose
    guarantees are those of NOTE [Under torch.compile] in ``remat.core._compiled``.

    Args:
        model: the model as the user trains it.
        inputs: what the model is called with: a tensor, a tuple or a dict.
        loss_fn: ``loss_fn(output) -> scalar``; default ``output.loss`` or the sum of
            the floating-point outputs.
        rtol, atol: a gradient is wrong when ``max|g - g_ref| > atol + rtol * max|g_ref|``.
        min_saving: a region "does not pay" when turning it off raises the peak by less
            than this fraction of the step's own peak without checkpointing, and, on a
            model ``remat.apply`` or ``remat.auto`` planned, keeps the step within the
            plan's budget (one the plan needs pays, however little it saves).
        measure_cost: also measure peak and time (needed for ``checkpoint-does-not-pay``
            and ``illusory-speedup``); False runs only the two observed steps.
        warmup, repeat: untimed steps before each configuration's peak measurement, and
            rounds of timed steps, one step per configuration per round (interleaved, so
            that other work on the machine slows every configuration alike).
    """
    _check_options(model, rtol, atol, min_saving, warmup, repeat)
    state, grads = capture(model, "remat.doctor"), InputGrads(inputs)
    icpt = Interceptor(model)
    python = PythonState(model)
    run = _Run(model, inputs, loss_fn, icpt, state, python, python.snapshot())
    stage = "the step without checkpointing"
    with restoring("remat.doctor", state.restore, grads.restore, functools.partial(python.restore, run.python_before)):
        try:
            with session(icpt), _eagerly():
                ref = _step(run, plain=True)
                stage = "the step with the model's checkpointing (it ran fine without)"
                ck = _step(run, plain=False)
                noise = Differences()
                if differences(ref, ck, rtol, atol):
                    stage = "a second step without checkpointing"
                    noise = differences(ref, _step(run, plain=True), rtol, atol)
                stage = "the measured steps"
                costs = _costs(run, ck, warmup, repeat) if measure_cost and ck.calls else None
        except RematError:
            raise
        except Exception as exc:
            raise RematError(
                f"remat.doctor: the model raised {type(exc).__name__} in {stage}: {exc}. The model was restored; "
                "fix the error (run one step yourself to see the full traceback), then run the doctor again."
            ) from exc
    budget = applied_budget(model)
    return _report(ref, ck, noise, costs, state, python, _leaf_names(model), rtol, atol, min_saving, budget)


def _eagerly() -> Any:
    """Every compiled module and function runs eagerly inside (torch >= 2.6; a no-op before)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def _leaf_names(model: nn.Module) -> set[str]:
    return {n for n, m in model.named_modules() if n and not any(True for _ in m.children())}


def _report(
    ref: StepRecord,
    ck: StepRecord,
    noise: Differences,
    costs: Costs | None,
    state: ModelState,
    python: PythonState,
    leaves: set[str],
    rtol: float,
    atol: float,
    min_saving: float,
    budget: int | None,
) -> DoctorReport:
    unchecked = check_reproducible(noise, ref.grads)
    ref, ck = without_noise(ref, noise), without_noise(ck, noise)
    frozen = checks.frozen(ref, ck)
    findings = [
        *checks.check_frozen(ref, ck, frozen),
        *checks.check_gradients(ref, ck, set(frozen), rtol, atol),
        *checks.check_rng(ck),
        *checks.check_saved_random(ck),
        *checks.check_rng_stream(ref, ck),
        *checks.check_buffers(ref, ck, state.buffers),
        *checks.check_side_effects(ref, ck, python.hooks),
        *unchecked,
        *(cost_checks.check_cost(ck, costs, leaves, min_saving, budget) if costs is not None else ()),
        *cost_checks.check_risky(ck),
        *cost_checks.check_speedup(costs, ref, frozen),
    ]
    return DoctorReport(
        findings=tuple(findings),
        checkpoints=_sites(ck.calls),
        loss_reference=ref.loss,
        loss_checkpointed=ck.loss,
        reference=costs.reference if costs else None,
        checkpointed=costs.checkpointed if costs else None,
    )

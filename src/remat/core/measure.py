"""``remat.measure``: the peak memory, step time and gradient health of a training step.

NOTE [What "peak" means, everywhere in remat]
The most bytes of tensor storage alive at once during one training step
(forward, loss, backward, optimizer step when given), counting parameters,
buffers, inputs, gradients, activations, temporaries and optimizer state. On
CUDA it comes from the caching allocator's own statistics after a reset and a
synchronisation; on other devices from ``remat.core._memtrack.StorageTracker``.
Never nvidia-smi (it shows the allocator's reserved pool plus the CUDA
context), never RSS.

Step time is the median of ``repeat`` synchronised steps after ``warmup``
steps. The model is restored afterwards: parameters, buffers, gradients,
``training`` flags, RNG streams, and the optimizer's state; so are the inputs'
gradients (NOTE [Each step's inputs are fresh] in ``remat.core._step``).
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn

from remat.core._compiled import eager_module, runs_compiled
from remat.core._costs import spent
from remat.core._hf import every_layer_runs
from remat.core._loop import NO_LOOP, Loop, OptimizerSnapshot, make_loop
from remat.core._memtrack import StorageTracker, allocator_peak, collections_paused, storage_bytes
from remat.core._state import capture, restoring
from remat.core._step import InputGrads, input_grads, input_tensors, trainable_parameters, training_step
from remat.core._typing import Inputs, LossFn
from remat.core._user_errors import check_devices, checkpointed_modules, model_errors, require_module
from remat.errors import RematError

__all__ = ["Measurement", "measure"]


@dataclass(frozen=True)
class Measurement:
    """What one measurement of a training step found."""

    peak_bytes: int
    """Most bytes of tensor storage alive at once during the step, resting bytes included."""
    resting_bytes: int
    """Bytes alive before the step: parameters, buffers, inputs (and optimizer state)."""
    step_time_s: float
    """Median wall time of one synchronised step after warm-up."""
    step_times_s: tuple[float, ...]
    """Every timed step, in order."""
    missing_grads: tuple[str, ...]
    """Trainable parameters that received no gradient."""
    zero_grads: tuple[str, ...]
    """Trainable parameters whose gradient is all zeros."""
    loss: float
    """Loss of the measured step."""
    device: str
    """Device the step ran on."""

    @property
    def grads_ok(self) -> bool:
        """True when every trainable parameter received a gradient."""
        return not self.missing_grads

    @property
    def step_peak_bytes(self) -> int:
        """Peak above the resting bytes: what the step itself adds at its worst moment."""
        return self.peak_bytes - self.resting_bytes


def device_of(model: nn.Module, inputs: Inputs) -> torch.device:
    """The device of the first parameter or input tensor (CPU when there is none)."""
    for t in [*model.parameters(), *input_tensors(inputs)]:
        return t.device
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def resting_tensors(model: nn.Module, inputs: Inputs, loop: Loop = NO_LOOP) -> list[torch.Tensor]:
    """What is alive before a step: parameters, buffers, inputs (and gradients they already hold), and what
    ``loop`` keeps between steps."""
    tensors = [
        *model.parameters(),
        *(b for b in model.buffers() if b is not None),
        *input_tensors(inputs),
        *input_grads(inputs),
    ]
    return tensors + loop.resident(model)


def measure_peak(
    model: nn.Module,
    inputs: Inputs,
    loss_fn: LossFn | None = None,
    loop: Loop = NO_LOOP,
    *,
    allocator: bool = False,
) -> tuple[int, int, float]:
    """(peak bytes, resting bytes, loss) of one step as ``loop`` repeats it; gradients are left on the model.

    The step starts from the loop's steady state (NOTE [The step a loop repeats]): the
    caller restores parameters, gradients and the optimizer's state; the inputs' gradients
    are put back here. ``allocator``: off CUDA, count the step from the CPU allocator's
    reports rather than from the dispatcher, for kernels it never sees (``torch.compile``'s).
    """
    grads = InputGrads(inputs)
    try:
        return _peak(model, inputs, loss_fn, loop, allocator)
    finally:
        grads.restore()


def _peak(
    model: nn.Module, inputs: Inputs, loss_fn: LossFn | None, loop: Loop, allocator: bool
) -> tuple[int, int, float]:
    device = device_of(model, inputs)
    loop.steady(model, inputs, loss_fn)
    loop.start(model)
    with spent("garbage collections"):
        gc.collect()
    step = lambda: training_step(model, inputs, loss_fn, loop.optimizer)  # noqa: E731
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        resting = torch.cuda.memory_allocated(device)
        with collections_paused():  # NOTE [Cyclic garbage during a counted step]
            loss = step()
        _sync(device)
        return torch.cuda.max_memory_allocated(device), resting, float(loss)
    known = resting_tensors(model, inputs, loop)
    if allocator or runs_compiled(model):  # NOTE [A compiled step is counted without a dispatch mode]
        step_peak, loss = allocator_peak(step)
        resting = storage_bytes(known)
        return resting + step_peak, resting, float(loss)
    tracker = StorageTracker(known=known)
    with tracker:
        loss = step()
    # ``discovered``: resting storages that are not the model's, such as DDP's gradient buckets.
    resting = storage_bytes(known) + tracker.discovered
    return resting + tracker.peak, resting, float(loss)


def measure(
    model: nn.Module,
    inputs: Inputs,
    loss_fn: LossFn | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    accumulation_steps: int = 1,
    warmup: int = 1,
    repeat: int = 3,
) -> Measurement:
    """Measure one training step of ``model`` on ``inputs`` honestly, then restore everything.

    Args:
        model: the model, as the user trains it (checkpointed or not).
        inputs: what the model is called with: a tensor, a tuple or a dict.
        loss_fn: ``loss_fn(output) -> scalar``; default ``output.loss`` or the
            sum of the floating-point outputs.
        optimizer: when given, the step includes ``optimizer.step()`` and the
            peak includes its state (made by a step first, as in a running loop).
        accumulation_steps: backward passes per optimizer step; from 2 on, the
            measured step starts with every gradient alive, as the loop's later
            backward passes do (NOTE [The step a loop repeats]).
        warmup: untimed steps first (lazy initialisation, allocator warm-up).
        repeat: timed steps; the reported time is their median.

    LayerDrop is off while it measures, as while remat plans (NOTE [LayerDrop while planning] in
    ``remat.core._hf``): the step measured runs every layer, the largest a later step can be, and a
    layer a draw skipped is not reported as missing its gradients.
    """
    require_module(model, "remat.measure")
    check_devices(model, inputs, "remat.measure")
    if warmup < 0 or repeat < 1:
        raise RematError(f"remat.measure: need warmup >= 0 and repeat >= 1, got warmup={warmup}, repeat={repeat}.")
    loop = make_loop(model, optimizer, accumulation_steps, "remat.measure")
    device = device_of(model, inputs)
    state, grads = capture(model, "remat.measure"), InputGrads(inputs)
    opt_state = OptimizerSnapshot(optimizer, "remat.measure")
    with (
        restoring("remat.measure", grads.restore, state.restore, opt_state.restore),
        model_errors(model, "remat.measure", "a measured step", checkpointed_modules(model)),
        every_layer_runs(model),
    ):
        loop.steady(model, inputs, loss_fn)
        times = []
        for i in range(warmup + repeat):
            loop.start(model)
            _sync(device)
            start = time.perf_counter()
            training_step(model, inputs, loss_fn, optimizer)
            _sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - start)
        peak, resting, loss = measure_peak(model, inputs, loss_fn, loop)
        params = trainable_parameters(model)
        missing = tuple(n for n, p in params.items() if p.grad is None)
        zero = tuple(n for n, p in params.items() if p.grad is not None and not p.grad.any())
    return Measurement(
        peak_bytes=peak,
        resting_bytes=resting,
        step_time_s=statistics.median(times),
        step_times_s=tuple(times),
        missing_grads=missing,
        zero_grads=zero,
        loss=loss,
        device=str(device),
    )


def compiled_peak(
    model: nn.Module, inputs: Inputs, loss_fn: LossFn | None, *, backend: str, loop: Loop = NO_LOOP
) -> int:
    """Peak bytes of one ``torch.compile(model, backend=backend)`` training step of ``loop``, allocator-level.

    One step compiles first, so the compiler's own allocations are not counted. Gradients,
    buffers and RNG are left as the steps left them: the caller restores the model.

    NOTE [Each compiled measurement starts from an empty dynamo cache]
    Every plan is a recompile of the same ``forward`` (dynamo guards on each block's), and
    past ``torch._dynamo.config.recompile_limit`` (8) compiles of one function dynamo runs
    it eagerly without a word: ``remat.auto(compiled=...)`` measures about ten plans, so the
    later ones would be eager steps, and a user's own ``torch.compile`` after it would meet
    a full cache. Hence ``torch._dynamo.reset()`` before and after: other compiled functions
    of the process recompile on their next call (time, not correctness).
    """
    torch._dynamo.reset()
    try:
        compiled = torch.compile(eager_module(model), backend=backend)
        if not isinstance(compiled, nn.Module):  # the stubs say a callable; a module compiles to an OptimizedModule
            raise RuntimeError(f"remat: torch.compile of a module returned a {type(compiled).__name__}")
        measure_peak(compiled, inputs, loss_fn, loop, allocator=True)
        peak, _, _ = measure_peak(compiled, inputs, loss_fn, loop, allocator=True)
    finally:
        torch._dynamo.reset()
    return peak

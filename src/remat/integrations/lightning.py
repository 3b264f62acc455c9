"""``RematCallback`` for PyTorch Lightning: profile, plan and apply on the first real batch.

NOTE [Profiling the training step itself]
In Lightning the loss is whatever ``training_step(batch, batch_idx)`` computes, and it often calls
submodules rather than ``forward``. ``on_train_batch_start`` receives the real batch (already on the
device) before that step runs, so the callback profiles the step itself: for the duration of
``remat.auto`` the module's ``forward`` is ``training_step`` on its batch (its ``loss``, or the loss in
its dict, is the loss), while a call to ``self(...)`` from inside the step still reaches the module's
own ``forward``. ``self.log`` is silenced meanwhile: the profiling steps are not training steps and
must not log (Lightning also refuses a key logged from two hooks), and what they change in plain
attributes is put back (NOTE [What a training step changes besides the model]). The plan then names the module's
own blocks, and is on them before this batch's forward and the first optimizer step
(NOTE [Plan on the first real batch]). Manual optimization steps optimizers inside
``training_step``, which profiling must not do, so it is refused.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

try:  # the unified package first: a Callback must come from the package whose Trainer runs it
    from lightning.pytorch import Callback, LightningModule, Trainer
except ImportError:
    from pytorch_lightning import Callback, LightningModule, Trainer

from remat import Plan, RematError
from remat.integrations._first_batch import check_budget, plan_on_batch, with_loop

__all__ = ["RematCallback"]

_API = "remat.integrations.lightning.RematCallback"


class RematCallback(Callback):
    """Checkpoint the LightningModule's blocks under ``budget`` from the first training batch on.

    ``budget``: bytes (``"20GiB"``) or a fraction of the peak without checkpointing (0.5).
    ``out_dir``: where ``remat_plan.json`` goes (default the Trainer's ``log_dir`` or ``default_root_dir``).
    ``options`` go to :func:`remat.auto` (``blocks``, ``repeat``, ``verify`` ...). The plan holds for the
    Trainer's steps: its optimizer's state and step and ``accumulate_grad_batches`` are part of the planned
    peak (``optimizer=None`` plans for forward and backward alone).
    After the first batch ``self.plan`` is the plan applied (``plan.measured_peak_bytes``: its step).
    """

    def __init__(self, budget: Any = None, *, out_dir: str | None = None, **options: Any) -> None:
        check_budget(budget, _API)
        if "loss_fn" in options:
            raise RematError(f"{_API}: the loss is what training_step returns; drop loss_fn=.")
        self.budget, self.out_dir, self.options = budget, out_dir, options
        self.plan: Plan | None = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.plan is not None:
            return
        if not pl_module.automatic_optimization:
            raise RematError(
                f"{_API}: {type(pl_module).__name__} uses manual optimization (automatic_optimization=False), so "
                "its training_step steps the optimizer, which profiling must not do. Use automatic optimization, or "
                "call remat.auto(model, inputs, budget) on the network inside it before fitting."
            )
        out_dir = self.out_dir or trainer.log_dir or trainer.default_root_dir
        context = getattr(trainer.precision_plugin, "train_step_context", contextlib.nullcontext)
        optimizer = trainer.optimizers[0] if len(trainer.optimizers) == 1 else None
        options = with_loop(self.options, optimizer, trainer.accumulate_grad_batches)
        with _step_as_forward(pl_module, batch_idx), context():
            self.plan = plan_on_batch(pl_module, (batch,), self.budget, options, out_dir, _API)


@contextlib.contextmanager
def _step_as_forward(module: LightningModule, batch_idx: int) -> Any:
    saved = {name: module.__dict__[name] for name in ("forward", "log", "log_dict") if name in module.__dict__}
    own_forward = module.forward
    inside = False

    def step_forward(*args: Any, **kwargs: Any) -> Any:
        nonlocal inside
        if inside:  # ``self(x)`` inside training_step
            return own_forward(*args, **kwargs)
        inside = True
        try:
            return module.training_step(*args, batch_idx, **kwargs)
        finally:
            inside = False

    module.forward = step_forward
    module.log = module.log_dict = lambda *args, **kwargs: None
    state = _StepState(module)
    try:
        yield
    finally:
        for name in ("forward", "log", "log_dict"):
            module.__dict__.pop(name, None)
        module.__dict__.update(saved)
        state.restore()


# NOTE [What a training step changes besides the model]
# remat's steps put back the model's own state (parameters, gradients, buffers, RNG), but a
# training_step also updates what it keeps in plain attributes: a torchmetrics metric's states
# (``tp``, ``fp``... are attributes, not buffers), a counter (``self.samples_seen += len(x)``). The
# callback's profiling and verification run the step about twenty times, and a two-step run logged
# another accuracy and counted 21504 samples seen for 2048. So the attributes of every module of the
# LightningModule that are tensors, lists of tensors or numbers are copied before and put back after.
_PLAIN = (bool, int, float)


class _StepState:
    """The plain attributes of ``module``'s modules (NOTE above): each object, and a host copy of its values."""

    def __init__(self, module: LightningModule) -> None:
        self.saved = [
            (m, name, value, _host_copy(value))
            for m in module.modules()
            for name, value in vars(m).items()
            if _plain(value) and name != "training"
        ]

    def restore(self) -> None:
        for m, name, value, copy in self.saved:
            object.__setattr__(m, name, value)  # the object itself: others may hold it
            if isinstance(value, torch.Tensor) and value._version != copy[1]:  # written in place (``tp += ...``)
                with torch.no_grad():
                    value.copy_(copy[0])
            elif isinstance(value, list):
                value[:] = copy


def _plain(value: Any) -> bool:
    if isinstance(value, list):
        return all(isinstance(v, torch.Tensor) for v in value)
    return isinstance(value, (torch.Tensor, *_PLAIN)) and not isinstance(value, torch.nn.Parameter)


def _host_copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):  # in host memory: profiling runs where device memory is short
        return value.detach().to("cpu", copy=True), value._version
    return list(value) if isinstance(value, list) else value

"""``RematCallback`` for Hugging Face ``Trainer``: profile, plan and apply on the first real batch.

NOTE [Why the first forward, not a Trainer event]
``on_train_begin`` has the model but no batch, and drawing one from the train dataloader would
advance its sampler and shuffle the run differently from the run without remat. No event sees the
batch ``Trainer.training_step`` gets. So ``on_train_begin`` puts a one-shot ``forward`` on the model
instance: the first call in training mode with gradients on (the first training step's forward,
with the real batch dict, labels and ``num_items_in_batch`` included) removes itself, runs
``remat.auto`` on those inputs (NOTE [Plan on the first real batch]) and then computes the forward
the Trainer asked for, now with the plan applied. Evaluation calls before training pass through.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from remat import Plan, RematError
from remat.integrations._first_batch import check_budget, plan_on_batch, with_loop

__all__ = ["RematCallback"]

_API = "remat.integrations.transformers.RematCallback"


class RematCallback(TrainerCallback):
    """Checkpoint the model's blocks under ``budget`` from the first training batch on.

    ``budget``: bytes (``"20GiB"``) or a fraction of the peak without checkpointing (0.5).
    ``out_dir``: where ``remat_plan.json`` goes (default the Trainer's ``args.output_dir``).
    ``options`` go to :func:`remat.auto` (``blocks``, ``repeat``, ``verify``, ``loss_fn`` ...). The plan holds
    for the Trainer's steps: its optimizer's state and step and ``gradient_accumulation_steps`` are part
    of the planned peak (``optimizer=None`` plans for forward and backward alone).
    After the first step ``self.plan`` is the plan applied (``plan.measured_peak_bytes``: its step).
    """

    def __init__(self, budget: Any = None, *, out_dir: str | None = None, **options: Any) -> None:
        check_budget(budget, _API)
        self.budget, self.out_dir, self.options = budget, out_dir, options
        self.plan: Plan | None = None
        self._armed: tuple[nn.Module, Any] | None = None

    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kwargs: Any
    ) -> None:
        if _hf_checkpointing(args, model):
            raise RematError(
                f"{_API}: transformers' own gradient checkpointing is on (TrainingArguments(gradient_checkpointing="
                "True), activation_checkpointing=True or model.gradient_checkpointing_enable()), so every block would "
                "be checkpointed twice; set gradient_checkpointing=False and let remat choose which blocks to "
                "recompute."
            )
        if model is None or self.plan is not None:
            return
        out_dir = self.out_dir or args.output_dir
        options = with_loop(self.options, kwargs.get("optimizer"), args.gradient_accumulation_steps)
        original = model.__dict__.get("forward")
        self._armed = (model, original)

        def first_forward(*f_args: Any, **f_kwargs: Any) -> Any:
            if not (model.training and torch.is_grad_enabled()):
                return (original or type(model).forward.__get__(model))(*f_args, **f_kwargs)
            self.disarm()
            if f_args and f_kwargs:
                raise RematError(
                    f"{_API}: the model was called with both positional and keyword inputs; remat.auto "
                    "profiles a dict (the Trainer's batch) or a tuple. Call the model with one of them."
                )
            self.plan = plan_on_batch(model, f_kwargs or f_args, self.budget, options, out_dir, _API)
            return model.forward(*f_args, **f_kwargs)  # the model's own, now with the plan's blocks

        model.forward = first_forward

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.disarm()  # training that ended before its first step leaves no one-shot forward behind

    def disarm(self) -> None:
        """Put the model's own ``forward`` back (once the plan is made, or when training ends first)."""
        armed, self._armed = self._armed, None
        if armed is None:
            return
        model, original = armed
        if original is None:
            model.__dict__.pop("forward", None)
        else:
            model.forward = original


def _hf_checkpointing(args: Any, model: nn.Module | None) -> bool:
    # transformers 5 renamed gradient_checkpointing to activation_checkpointing (the old names warn).
    flag = getattr(args, "activation_checkpointing", None)
    on = bool(args.gradient_checkpointing if flag is None else flag)
    if model is not None:
        attr = (
            "is_activation_checkpointing"
            if hasattr(type(model), "is_activation_checkpointing")
            else "is_gradient_checkpointing"
        )
        on = on or bool(getattr(model, attr, False))
    return on

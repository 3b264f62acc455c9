"""RematCallback in a real Hugging Face Trainer: 3 steps on a tiny GPT-2, trained exactly as without remat."""

import json
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _within_a_device import BATCH, STEPS, check_trains_within_a_device, on_a_device, tiny_gpt2, token_rows  # noqa: E402

import remat  # noqa: E402
from remat.integrations.transformers import RematCallback  # noqa: E402


def _model():
    return tiny_gpt2()


def _data():
    return token_rows()


class _Watch(transformers.TrainerCallback):
    """Which blocks were checkpointed when each optimizer step was about to run."""

    def __init__(self):
        self.wrapped_at_step = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.wrapped_at_step.append(sorted(n for n, m in model.named_modules() if remat.is_wrapped(m)))


def _arguments(tmp_path, **arguments):
    return transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        seed=0,
        data_seed=0,
        **arguments,
    )


def _train(tmp_path, *callbacks, **arguments):
    model = _model()
    args = _arguments(tmp_path, **arguments)
    watch = _Watch()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_data(), callbacks=[watch, *callbacks])
    trainer.train()
    return model, watch


def test_trainer_with_the_callback_trains_exactly_as_without(tmp_path, caplog):
    torch.use_deterministic_algorithms(True)
    reference, _ = _train(tmp_path / "plain")
    callback = RematCallback(budget=0.8, repeat=1)
    with caplog.at_level(logging.INFO, logger="remat"):
        model, watch = _train(tmp_path / "remat", callback)
    plan = callback.plan
    assert plan is not None and plan.checkpointed, "a budget of 0.8 needs recomputation on this model"
    # The plan was on the model before the first optimizer step, and stayed for every step.
    assert watch.wrapped_at_step == [sorted(plan.checkpointed)] * STEPS
    assert plan.measured_peak_bytes is not None and plan.measured_peak_bytes <= plan.budget_bytes
    for (name, want), got in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(want, got), name  # 3 optimizer steps later, bit-equal
    written = json.loads((tmp_path / "remat" / "remat_plan.json").read_text())
    assert written["assignment"] == plan.assignment and written["measured_peak_bytes"] == plan.measured_peak_bytes
    assert any("measured peak" in r.getMessage() for r in caplog.records)
    assert "forward" not in model.__dict__  # the one-shot forward is gone


class _PeakAfterFirstStep(transformers.TrainerCallback):
    """The most bytes alive in the Trainer's own steps after the first (profiling done, AdamW's state made)."""

    def __init__(self):
        self.tracker = None

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if state.global_step == 1 and self.tracker is None:
            from remat.core._loop import optimizer_state
            from remat.core._memtrack import StorageTracker

            inner = getattr(optimizer, "optimizer", optimizer)
            self.known = [
                *model.parameters(),
                *model.buffers(),
                *optimizer_state(inner),
                *(p.grad for p in model.parameters() if p.grad is not None),
            ]
            self.tracker = StorageTracker(known=self.known)
            self.tracker.__enter__()

    def on_train_end(self, args, state, control, **kwargs):
        self.tracker.__exit__(None, None, None)

    @property
    def peak(self):
        from remat.core._memtrack import storage_bytes

        return storage_bytes(self.known) + self.tracker.peak


@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_plan_holds_in_the_trainers_own_loop(tmp_path, accumulation):
    """NOTE [The step a loop repeats]: AdamW's state and step, and accumulated gradients, are in the plan."""
    peaks = {}
    for loop in ("trainer's", "bare"):
        callback = RematCallback(
            budget=0.6, repeat=1, **({} if loop == "trainer's" else {"optimizer": None, "accumulation_steps": 1})
        )
        watch = _PeakAfterFirstStep()
        model = _model()
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / loop),
            max_steps=STEPS,
            per_device_train_batch_size=BATCH,
            learning_rate=1e-2,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            logging_strategy="no",
            seed=0,
            data_seed=0,
            gradient_accumulation_steps=accumulation,
        )
        transformers.Trainer(
            model=model, args=args, train_dataset=_data() * accumulation, callbacks=[callback, watch]
        ).train()
        peaks[loop] = watch.peak, callback.plan
    peak, plan = peaks["trainer's"]
    assert "AdamW's state and step" in plan.loop and (accumulation == 1 or "over 2 backward passes" in plan.loop)
    assert peak <= plan.budget_bytes
    # the Trainer's own temporaries beside remat's step (gradient clipping's norms, the loss it sums): a few KiB
    assert abs(peak - plan.predicted_peak_bytes) <= 0.01 * plan.predicted_peak_bytes
    peak, plan = peaks["bare"]
    assert plan.loop == "" and peak > plan.budget_bytes * 1.05  # planned for forward and backward alone


def test_callback_refuses_transformers_gradient_checkpointing_and_bad_budgets(tmp_path):
    with pytest.raises(remat.RematError, match="gradient_checkpointing=False"):
        _train(tmp_path, RematCallback(budget="20GiB"), gradient_checkpointing=True)
    with pytest.raises(remat.RematError, match="budget"):
        RematCallback(budget="twenty")
    with pytest.raises(remat.RematError, match="give budget="):
        RematCallback()


def _trained_on_a_device(tmp_path, capacity, *callbacks):
    """The model after ``_train`` run on a simulated device of ``capacity`` bytes, and the device."""
    model = _model()
    trainer = transformers.Trainer(
        model=model, args=_arguments(tmp_path), train_dataset=_data(), callbacks=list(callbacks)
    )
    return model, on_a_device(capacity, model, trainer.train)


def test_the_callback_plans_within_a_device_the_trainer_does_not_fit(tmp_path):
    """The Trainer's loop without checkpointing needs more than the device has; with the callback it trains,
    the same weights, and neither planning nor training ever holds more than the device."""
    check_trains_within_a_device(
        lambda name, capacity, *callbacks: _trained_on_a_device(tmp_path / name, capacity, *callbacks), RematCallback
    )

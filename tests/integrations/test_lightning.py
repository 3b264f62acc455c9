"""RematCallback in a real Lightning Trainer: 3 steps on a tiny module, trained exactly as without remat."""

import json

import pytest
import torch
from torch import nn

try:  # the package remat.integrations.lightning takes its Callback from
    import lightning.pytorch as pl
except ImportError:
    pl = pytest.importorskip("pytorch_lightning")

from _within_a_device import BATCH as GPT2_BATCH  # noqa: E402
from _within_a_device import check_trains_within_a_device, on_a_device, tiny_gpt2, token_rows  # noqa: E402

import remat  # noqa: E402
from remat.integrations.lightning import RematCallback  # noqa: E402

STEPS, BATCH = 3, 256


class TinyChain(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*[nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(4)])
        # what a training step keeps besides the model (a torchmetrics metric's states are such attributes)
        self.samples_seen, self.error_sum, self.losses = 0, torch.zeros(32), []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        loss = nn.functional.mse_loss(out, y)
        self.log("loss", loss)
        self.samples_seen += len(x)
        self.error_sum += (out - y).detach().abs().sum(0)  # in place, as a metric's update
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class _Watch(pl.Callback):
    def __init__(self):
        self.wrapped_at_step = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.wrapped_at_step.append(sorted(n for n, m in pl_module.named_modules() if remat.is_wrapped(m)))


def _fit(tmp_path, *callbacks, accumulate=1):
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(STEPS * BATCH * accumulate, 32, generator=g),
        torch.randn(STEPS * BATCH * accumulate, 32, generator=g),
    )
    module, watch = TinyChain(), _Watch()
    trainer = pl.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        callbacks=[watch, *callbacks],
        accumulate_grad_batches=accumulate,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=BATCH))
    return module, watch


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lightning_with_the_callback_trains_exactly_as_without(tmp_path, accumulate):
    torch.use_deterministic_algorithms(True)
    reference, _ = _fit(tmp_path / "plain", accumulate=accumulate)
    callback = RematCallback(budget=0.9, repeat=1)
    module, watch = _fit(tmp_path / "remat", callback, accumulate=accumulate)
    plan = callback.plan
    assert plan is not None and plan.checkpointed and plan.model == "TinyChain"
    # planned for the loop's step: the optimizer's momentum and step, the accumulated gradients
    assert plan.loop == "SGD's state and step" + (
        " and gradients accumulated over 2 backward passes" if accumulate == 2 else ""
    )
    assert watch.wrapped_at_step == [sorted(plan.checkpointed)] * STEPS  # before the first optimizer step
    assert plan.measured_peak_bytes is not None and plan.measured_peak_bytes <= plan.budget_bytes
    for (name, want), got in zip(reference.named_parameters(), module.parameters()):
        assert torch.equal(want, got), name
    assert json.loads((tmp_path / "remat" / "remat_plan.json").read_text())["assignment"] == plan.assignment
    assert not {"forward", "log", "log_dict"} & set(module.__dict__)  # the module is its own again
    # NOTE [What a training step changes besides the model]: the callback's steps left no trace there
    assert module.samples_seen == reference.samples_seen == STEPS * accumulate * BATCH
    assert torch.equal(module.error_sum, reference.error_sum)
    assert len(module.losses) == len(reference.losses) and all(map(torch.equal, module.losses, reference.losses))


def test_lightning_callback_refuses_manual_optimization_and_loss_fn(tmp_path):
    class Manual(TinyChain):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(remat.RematError, match="manual optimization"):
        RematCallback(budget=0.9).on_train_batch_start(None, Manual(), None, 0)
    with pytest.raises(remat.RematError, match="drop loss_fn"):
        RematCallback(budget=0.9, loss_fn=sum)


class TinyGPT2(pl.LightningModule):
    def __init__(self):
        super().__init__()
        pytest.importorskip("transformers")
        self.gpt = tiny_gpt2()

    def training_step(self, batch, batch_idx):
        loss = self.gpt(**batch).loss
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit_on_a_device(tmp_path, capacity, *callbacks):
    """The module after 3 steps of a tiny GPT-2 on a simulated device of ``capacity`` bytes, and the device."""
    module = TinyGPT2()
    trainer = pl.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        callbacks=list(callbacks),
    )
    loader = torch.utils.data.DataLoader(token_rows(), batch_size=GPT2_BATCH)
    return module, on_a_device(capacity, module, lambda: trainer.fit(module, loader))


def test_the_callback_plans_within_a_device_the_fit_does_not_fit(tmp_path):
    """Without checkpointing the fit needs more than the device has; with the callback it trains the same
    weights, and neither planning nor training ever holds more than the device."""
    check_trains_within_a_device(
        lambda name, capacity, *callbacks: _fit_on_a_device(tmp_path / name, capacity, *callbacks), RematCallback
    )

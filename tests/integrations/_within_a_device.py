"""What the Trainer and Lightning tests share: a tiny GPT-2, its batches, and the check that a callback trains
within a simulated device (tests/_device.py) that the loop without checkpointing does not fit."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from _device import SimulatedDevice

SEQ, BATCH, STEPS = 64, 4, 3


def tiny_gpt2() -> Any:
    """A 3-layer GPT-2 without dropout, the same weights every call."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=3,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=SEQ,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


def token_rows() -> list[dict[str, torch.Tensor]]:
    """STEPS x BATCH examples of SEQ tokens, labels the tokens."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (STEPS * BATCH, SEQ), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def on_a_device(capacity: int, model: torch.nn.Module, train: Callable[[], Any]) -> SimulatedDevice:
    """``train()`` run on a simulated device of ``capacity`` bytes that holds ``model`` from the start."""
    device = SimulatedDevice(capacity, [*model.parameters(), *model.buffers()])
    with device:
        train()
    return device


def check_trains_within_a_device(fit: Callable[..., tuple[torch.nn.Module, SimulatedDevice]], callback: type) -> None:
    """``fit(name, capacity, *callbacks)`` -> (the model trained, the device): without checkpointing the loop needs
    more than a device of 0.7 of its peak; with ``callback`` it trains the same weights, and neither planning nor
    training ever holds more than the device."""
    torch.use_deterministic_algorithms(True)
    reference, plain = fit("plain", 1 << 40)
    capacity = int(0.7 * plain.peak)
    try:
        fit("refused", capacity)
    except torch.OutOfMemoryError:
        pass
    else:
        raise AssertionError(f"the loop without checkpointing fitted {capacity} bytes (peak {plain.peak})")
    planner = callback(budget=capacity, repeat=1)
    model, device = fit("remat", capacity, planner)
    assert planner.plan.checkpointed and device.peak <= capacity, (device.peak, capacity)
    assert planner.plan.measured_peak_bytes <= capacity
    for (name, want), got in zip(reference.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(want, got), name

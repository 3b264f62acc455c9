"""remat in an Accelerate (or plain PyTorch) training loop: one call on the first batch, then train as usual.

    python examples/accelerate_loop.py --budget 0.7 --steps 3

``remat.auto(model, batch, budget)`` takes the batch dict exactly as the loop yields it (labels
included: the Hugging Face model returns ``output.loss``, which remat profiles), checkpoints the
blocks it chose, and verifies one real step under the budget. Call it after
``accelerator.prepare`` (so the batch is on the training device) and before the first backward.
Without accelerate installed the same loop runs as a plain PyTorch loop.
"""

from __future__ import annotations

import argparse
import json
import logging

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import remat


def tiny_gpt2(layers: int, seq: int) -> GPT2LMHeadModel:
    config = GPT2Config(
        n_layer=layers,
        n_embd=64,
        n_head=4,
        vocab_size=256,
        n_positions=seq,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def batches(steps: int, batch: int, seq: int) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 256, (steps, batch, seq), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": b, "attention_mask": torch.ones_like(b), "labels": b} for b in ids]


def prepare(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loader: list) -> tuple:
    """``accelerator.prepare`` when accelerate is installed; the objects as they are otherwise."""
    try:
        from accelerate import Accelerator
    except ImportError:
        return model, optimizer, loader, lambda loss: loss.backward()
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    return model, optimizer, loader, accelerator.backward


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", default="0.7", help="fraction of the peak without checkpointing, or bytes (6GiB)")
    ap.add_argument("--no-remat", action="store_true", help="train without remat (to compare the losses)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(0)
    model = tiny_gpt2(args.layers, args.seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader, backward = prepare(model, optimizer, batches(args.steps, args.batch, args.seq))
    plan, losses = None, []
    for batch in loader:
        if plan is None and not args.no_remat:  # the first real batch: profile, plan, apply, verify
            plan = remat.auto(model, batch, args.budget, repeat=1)
            logging.info("%s", plan.summary())
        loss = model(**batch).loss
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    result = {"losses": losses}
    if plan is not None:
        result.update(
            checkpointed=plan.checkpointed, budget_bytes=plan.budget_bytes, measured_peak_bytes=plan.measured_peak_bytes
        )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

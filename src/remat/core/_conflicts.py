"""Checkpointing that the model already does itself, found before remat adds its own.

NOTE [Why two checkpointings must not overlap]
A block that remat checkpoints and that the model also checkpoints itself
(Hugging Face's ``gradient_checkpointing_enable()``, timm's ``set_grad_checkpointing()``,
torch's ``checkpoint_wrapper`` or composable ``checkpoint``) is checkpointed twice, nested. When either of the
two is reentrant (transformers 4.x's default, ``CheckpointImpl.REENTRANT``) the
block's forward runs three times per step instead of two: recomputed twice.
When both are non-reentrant, torch 2.13 recomputes a nested region only once,
but the model's checkpoint still decides what is kept: a block remat plans as
``selective`` is recomputed fully, so the plan's predicted peak and time no
longer describe the step. Either way the user wants one of the two, so remat
refuses any overlap (the block is, contains or sits inside such a module) and
names both sides.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from remat.errors import RematError


def _composable_checkpoint(module: nn.Module) -> bool:
    try:
        from torch.distributed._composable.contract import _get_registry
    except ImportError:  # torch built without distributed
        return False
    return "checkpoint" in (_get_registry(module) or {})


def _how(module: nn.Module) -> str | None:
    """How ``module`` checkpoints itself (or its children), or None."""
    # transformers sets ``gradient_checkpointing = True`` on every module it
    # checkpoints through (its layers, and containers that loop over layers).
    if getattr(module, "gradient_checkpointing", False) is True:
        return "Hugging Face gradient checkpointing"
    # timm's models set ``grad_checkpointing = True`` (``set_grad_checkpointing()``) and run their blocks
    # through torch's checkpoint in forward (``checkpoint_seq``)
    if getattr(module, "grad_checkpointing", False) is True:
        return "timm gradient checkpointing"
    if "_checkpoint_wrapped_module" in module._modules:
        return "torch checkpoint_wrapper"
    if _composable_checkpoint(module):
        return "torch.distributed._composable.checkpoint"
    return None


def self_checkpointed(model: nn.Module) -> dict[str, str]:
    """Qualified name -> how, for every module that the model checkpoints itself."""
    found = {name: _how(m) for name, m in model.named_modules()}
    return {name: how for name, how in found.items() if how is not None}


def _overlaps(block: str, other: str) -> bool:
    if other == "" or block == other:
        return True
    return block.startswith(other + ".") or other.startswith(block + ".")


def check_no_double_checkpointing(model: nn.Module, blocks: Iterable[str], *, api: str) -> None:
    """Raise when a block remat would checkpoint is, contains or sits inside a self-checkpointed module."""
    own = self_checkpointed(model)
    clashes = [(b, o) for b in blocks for o in own if _overlaps(b, o)]
    if not clashes:
        return
    block = clashes[0][0]
    other = max((o for b, o in clashes if b == block), key=len)  # the most specific: the block itself if flagged
    count = len({b for b, _ in clashes})
    where = "is" if other == block else f"sits in or contains {other or type(model).__name__!r}, which is"
    hows = {own[o] for _, o in clashes}
    if "Hugging Face gradient checkpointing" in hows:
        fix = "call model.gradient_checkpointing_disable() (activation_checkpointing_disable() in transformers 5)"
    elif "timm gradient checkpointing" in hows:
        fix = "call model.set_grad_checkpointing(False)"
    else:
        fix = "remove the model's own checkpoint wrappers"
    raise RematError(
        f"{api}: remat would checkpoint block {block!r}, which {where} already checkpointed by {own[other]} "
        f"({count} such block(s)). Checkpointed twice, a block is "
        "recomputed twice in backward when either checkpoint is reentrant, and otherwise the model's "
        "checkpointing overrides remat's policy, so the plan's predicted peak and time would not hold. "
        f"Turn one of them off: {fix} before using remat, or keep the model's checkpointing and leave these "
        "blocks out of remat's plan (policy 'keep')."
    )

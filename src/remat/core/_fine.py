"""The ``full-fine`` policy: a block recomputed whole, its sub-layers checkpointed inside.

NOTE [Why a recomputed block's sub-layers are checkpointed too]
With every block ``full``, what is left of a transformer's peak (GPT-2, Llama in the
zoo) is not the stored block inputs (a small share of it) but
parameters, gradients, and one block's backward: its recomputation keeps every
intermediate of the block until that block's backward has
run through them. Nested segments of blocks cannot lower that. Checkpointing the
block's sub-layers (its children that are themselves containers: attention, MLP)
inside the block's region can: the block's recomputation then keeps only the
sub-layers' inputs, and each sub-layer is recomputed in turn during the block's
backward, so the transient is one sub-layer's (the zoo's GPT-2 and Llama: BENCHMARKS.md,
``benchmarks/nested.py --fine``, every block full against full-fine). It costs
one more forward of each sub-layer. Both levels are remat's own non-reentrant regions
(NOTE [Regions inside regions] in ``remat.core.checkpoint``), so gradients, RNG replay
and buffers keep their guarantees. Leaf children (norms, activations, dropout) are left
alone: checkpointing them saves nothing a sub-layer does not already keep. A block
without such children (conv-BN-ReLU) is simply ``full`` under this policy.
"""

from __future__ import annotations

from torch import nn

from remat.core._policy_registry import FULL, FULL_FINE
from remat.core.checkpoint import _CheckpointedForward, unwrap, wrap

__all__ = ["FINE", "inner_layers", "unwrap_fine", "wrap_fine"]

#: The policy name: ``full`` for the block, ``full`` for its container children inside it.
FINE = FULL_FINE


def inner_layers(module: nn.Module) -> list[nn.Module]:
    """The children of ``module`` that ``full-fine`` checkpoints: those that contain modules themselves."""
    return [child for child in module.children() if next(child.children(), None) is not None]


def wrap_fine(module: nn.Module) -> None:
    """Checkpoint ``module`` and, inside it, each of its :func:`inner_layers` (all ``full``); a block without
    sub-layers is simply ``full``."""
    layers = inner_layers(module)
    wrap(module, policy=FULL)
    for child in layers:
        wrap(child, policy=FULL)
    # The block's checkpointed forward remembers which sub-layers it wrapped, so that undoing it leaves
    # sub-layers the user wrapped alone.
    forward = module.forward
    if not isinstance(forward, _CheckpointedForward):
        raise RuntimeError("wrap() installs remat's checkpointed forward")
    forward.fine_layers = tuple(layers)


def unwrap_fine(module: nn.Module) -> None:
    """Undo :func:`wrap_fine` (and plain ``wrap``) on ``module``; no-op where nothing is wrapped."""
    for child in getattr(module.__dict__.get("forward"), "fine_layers", ()):
        unwrap(child)
    unwrap(module)

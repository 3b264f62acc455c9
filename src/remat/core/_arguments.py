"""The argument trees of checkpointed calls: their tensors, and whether the caller can change them."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["collect_tensors"]

_SCALARS = (type(None), bool, int, float, str)


def collect_tensors(tree: Any, out: list[torch.Tensor]) -> bool:
    """Append the tensors in ``tree`` to ``out``: built-in containers walked directly (a pytree walk costs tens of
    microseconds per block call), anything else through torch's pytree. Returns whether ``tree`` holds a list, a
    dict or another container the caller may change after the call (a tuple cannot change; NOTE [Arguments as the
    call saw them])."""
    kind = type(tree)
    if isinstance(tree, torch.Tensor):
        out.append(tree)
        return False
    if kind in _SCALARS:
        return False
    if kind is tuple or kind is list:
        inner = [collect_tensors(item, out) for item in tree]  # every item walked: no short cut
        return kind is list or any(inner)
    if kind is dict:
        for item in tree.values():
            collect_tensors(item, out)
        return True
    leaves, _ = torch.utils._pytree.tree_flatten(tree)
    out.extend(t for t in leaves if isinstance(t, torch.Tensor))
    mutable = isinstance(tree, (list, dict)) or kind in torch.utils._pytree.SUPPORTED_NODES
    return mutable and not isinstance(tree, tuple)


# NOTE [Arguments as the call saw them]
# A recomputation reruns the call on its arguments, and a caller may change a list or
# dict it handed the call once the call returns: torchvision's DenseNet appends each
# layer's output to the list every layer was handed. Rerun on the caller's list, a layer
# saw more features than its forward had (a shape error: the profile refused DenseNet);
# with an item replaced by a tensor of the same shape, it saw another input and the
# gradients were silently another function's (torch's own checkpoint reruns on the
# caller's containers too, and gives them). A forward may write its own argument list
# as well: timm's HRNet stages set ``x[i] = branch(x[i])``, so a recomputation on that
# list ran each branch on its own output (every gradient differed, no error). So a
# region keeps the containers of its argument tree as the call was handed them,
# holding the same tensors (their writes checked as before), lets the caller's go
# after the forward (held, they kept every feature DenseNet appends later), and each
# recomputation gets containers of its own. Only a tree that holds a list, a dict or
# another mutable pytree node pays the flatten (``collect_tensors`` tells, in the walk
# that finds the inputs).

"""Names for the shapes that recur in remat's signatures: a model's inputs, a loss function, a budget.

They sit in core, the lowest wing that knows torch, so that every wing above can use them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

import torch

Inputs: TypeAlias = Any
"""What a model is called with: a tensor (``model(x)``), a tuple (``model(*inputs)``) or a dict
(``model(**inputs)``), with any nesting of containers, tensors and other values inside. Any
pytree of the user's values is accepted, so no narrower type would be honest."""

LossFn: TypeAlias = Callable[[Any], torch.Tensor]
"""``loss_fn(output) -> scalar tensor``, called on whatever the model returns."""

Budget: TypeAlias = int | float | str
"""A memory budget as the user writes it: a fraction of the peak without checkpointing (``0.6``),
bytes (``6_000_000_000``), or text (``"80%"``, ``"20GiB"``, ``"6e9"``); NOTE [One budget rule]
in ``remat.planning.plan`` reads every form by one rule."""

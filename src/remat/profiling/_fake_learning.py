"""What a plan's "selective" blocks learn on their first call, learned on fake tensors before a real step.

NOTE [Blocks a profile never ran]
A block's first "selective" call runs op by op and learns its cheap submodules; later calls take the
by-module path the profile predicts (NOTE [Selective by module] in remat.core._by_module). A profile
runs alike blocks once, on a stack of five (NOTE in remat.profiling._repeated_blocks), so the other
blocks of a plan have never been called when auto's verification step runs: that step was their
first call, it kept what op-by-op selective keeps, and measured over the prediction (six GELU MLP
blocks: 6656 bytes, and auto re-planned with a margin and refused the floor it had named). So before
a real step with a selective block that has not learned, one step on fake tensors (no device memory;
weights, buffers and generators put back) lets every block learn, and the real step is one the plan
repeats. Where fake tensors cannot run the model, the real step learns, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from remat.core._hf import cache_disabled, fake_tensors_untraced
from remat.core._state import host_rng, set_host_rng
from remat.core._typing import Inputs, LossFn
from remat.core.checkpoint import knows_structure
from remat.profiling._fake import FakeWeights, fake_inputs
from remat.profiling._schedule import learn_structure
from remat.profiling._shadow import ValueShadows

__all__ = ["learn_on_fake_tensors"]

log = logging.getLogger("remat")


def learn_on_fake_tensors(model: nn.Module, inputs: Inputs, loss_fn: LossFn | None, blocks: Iterable[str]) -> bool:
    """Let the "selective" blocks among ``blocks`` that have not learned learn, in a step on fake tensors (NOTE
    above); True when one ran."""
    modules = dict(model.named_modules())
    if all(knows_structure(modules[name]) for name in blocks if name in modules):
        return False
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    shadows = ValueShadows()  # small tensors keep real values: a Hugging Face mask or position ids
    host = host_rng()  # torch's generators do not move under fake tensors; Python's and NumPy's do
    try:
        fakes = fake_inputs(mode, shadows, inputs)
        with FakeWeights(model, mode, None), cache_disabled(model), fake_tensors_untraced(), mode, shadows:
            learn_structure(model, fakes, loss_fn)
    except Exception as exc:  # noqa: BLE001 (fake tensors cannot run it: the real step learns)
        log.info("remat: selective blocks learn in the real step (fake tensors cannot run it: %s).", exc)
        return False
    finally:
        set_host_rng(host)
    return True

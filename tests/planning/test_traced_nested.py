"""Nested segments over traced units that update the model's buffers (NOTE [Buffers a segment reads] in
``remat.profiling._traced``): each statistic changes once per step, as without checkpointing."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from conftest import assert_buffers_equal, assert_grads_equal, twin
from torch import nn

import remat


class _Normed(nn.Module):
    """Linears with functional batch norms on the model's own buffers and a step counter in the parent: no
    submodule owns them, so remat cuts the forward along its trace."""

    def __init__(self, width: int = 16, layers: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        for i in (1, 4):
            self.register_buffer(f"mean{i}", torch.zeros(width))
            self.register_buffer(f"var{i}", torch.ones(width))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            y = layer(x)
            if i in (1, 4):
                stats = getattr(self, f"mean{i}"), getattr(self, f"var{i}")
                y = F.batch_norm(y.transpose(1, 2), *stats, training=self.training, momentum=0.1).transpose(1, 2)
            elif i == 6:
                self.count.add_(1)
            x = torch.tanh(y)
        return x


def _loss(out):
    return out.square().mean()


def test_nested_segments_over_traced_units_update_the_model_s_statistics_once():
    torch.manual_seed(0)
    model, x = _Normed(), torch.randn(4, 32, 16)
    reference = twin(model)
    prof = remat.profile(model, x, loss_fn=_loss, repeat=1, warmup=0)
    plans = [remat.plan(prof, budget) for budget in (0.7, 0.6, 0.55)]
    nested = [p for p in plans if p.segments]
    assert nested, "no nested plan to test"
    for plan in nested:
        remat.apply(model, plan)
        try:
            for _ in range(2):
                model.zero_grad(set_to_none=True)
                reference.zero_grad(set_to_none=True)
                _loss(model(x)).backward()
                _loss(reference(x)).backward()
                assert_grads_equal(reference, model)
                assert_buffers_equal(reference, model)
        finally:
            remat.remove(model)
    assert int(model.count) == int(reference.count) == 2 * len(nested)

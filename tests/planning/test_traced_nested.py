"""Nested segments over traced units: units that update the model's buffers (NOTE [Buffers a segment reads] in
``remat.profiling._traced``) change each statistic once per step, as without checkpointing; units that do not save
their input are predicted to the byte (NOTE [Outputs the parent keeps that nothing saves] in
``remat.planning._nested_walk``)."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from conftest import assert_buffers_equal, assert_grads_equal, twin
from torch import nn

import remat
from remat.planning._nested import Node, costs_of, simulate, to_plan


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


class _Cut(nn.Module):
    """Linears with their activations in the parent, cut into units of which some begin with a tanh: a unit that
    saves its output, not its input, so the keep run frees its input in the glue after it."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(5))

    def forward(self, x):
        a, b = self.layers[0](x).chunk(2, dim=-1)
        x = torch.cat([b.tanh(), a.sigmoid()], dim=-1)
        x = torch.tanh(self.layers[1](x))
        x = torch.tanh(self.layers[2](x)) * 1.5
        x = torch.tanh(self.layers[3](x)) * 1.5
        y = self.layers[4](x)
        return torch.where(torch.rand_like(y) < 0.8, y, y * 0.1).tanh()


def test_a_segment_holds_its_input_through_its_recomputation_and_a_selective_cache_past_the_glue():
    # A segment [to_tanh_3, to_layers_4] holds its input, to_layers_2's output, while it recomputes to_tanh_3,
    # whose keep run freed it in the glue; a selective to_layers_4 keeps its output past the glue's free in
    # to_output's keep run. Both were predicted one output (4096 B) under the measured peak.
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        torch.manual_seed(0)
        model, x = _Cut(), torch.randn(4, 16, 16)
        prof = remat.profile(model, x, loss_fn=_loss, repeat=1, warmup=0)
        c = costs_of(prof)
        keep, selective = c.chain.policies.index("keep"), c.chain.policies.index("selective")
        units = "to_cat to_layers_2 to_tanh_3 to_layers_4 to_output".split()
        assert [b.name for b in prof.blocks] == [f"remat_traced.{u}" for u in units]
        shapes = [
            (Node(0, end=2, children=(Node(0, keep),)), Node(2, end=4, children=(Node(2, keep),)), Node(4, keep)),
            (Node(0, end=2, children=(Node(0, keep),)), Node(2, c.full), Node(3, selective), Node(4, keep)),
        ]
        torch.manual_seed(1)
        _loss(model(x)).backward()
        reference = {n: p.grad.clone() for n, p in model.named_parameters()}
        none = remat.plan(prof, strategy="none")
        for nodes in shapes:
            assignment, segments = to_plan(c, nodes)
            plan = replace(none, assignment={b: assignment[b] for b in c.chain.blocks}, segments=segments)
            remat.apply(model, plan)
            try:
                model.zero_grad(set_to_none=True)
                torch.manual_seed(1)
                _loss(model(x)).backward()
                assert all(torch.equal(p.grad, reference[n]) for n, p in model.named_parameters())
                measured = remat.measure(model, x, loss_fn=_loss, repeat=1, warmup=0).peak_bytes
            finally:
                remat.remove(model)
            assert measured <= simulate(c, nodes) < measured + 4096, (segments, simulate(c, nodes), measured)
    finally:
        torch.use_deterministic_algorithms(deterministic)

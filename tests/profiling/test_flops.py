"""op_flops: torch's flop counter, total where torch's refuses (NOTE [An op torch's flop counter refuses])."""

import pytest
import torch
from torch.utils.flop_counter import flop_registry

from remat.profiling._flops import op_flops

aten = torch.ops.aten
FORWARD = [aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_flash_attention]
BACKWARD = [aten._scaled_dot_product_efficient_attention_backward, aten._scaled_dot_product_flash_attention_backward]


def _qkv(kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty(2, 8, 16, 32), torch.empty(2, kv_heads, 16, 32), torch.empty(2, kv_heads, 16, 32)


@pytest.fixture
def counter_of_torch_2_11(monkeypatch):
    """torch's SDPA counters as torch 2.11 had them: query, key and value must have the same heads."""

    def refuses_fewer_kv_heads(count):
        def count_as_2_11(*args, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if len({t.shape[1] for t in tensors}) > 1:
                raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")
            return count(*args, **kwargs)

        return count_as_2_11

    for op in (*FORWARD, *BACKWARD):
        monkeypatch.setitem(flop_registry, op, refuses_fewer_kv_heads(flop_registry[op]))


@pytest.mark.parametrize("op", FORWARD, ids=str)
def test_grouped_query_attention_counts_as_kv_repeated_to_the_query_heads(op, counter_of_torch_2_11):
    q, k, v = _qkv(kv_heads=2)
    with pytest.raises(AssertionError):  # what stopped real profiles of GQA models on CUDA with torch 2.11
        flop_registry[op](q, k, v, out_val=None)
    repeated = op_flops(op, _qkv(kv_heads=8), {}, None)
    assert repeated == 2 * 2 * 8 * 16 * 16 * 32 * 2 and op_flops(op, (q, k, v), {}, None) == repeated


@pytest.mark.parametrize("op", BACKWARD, ids=str)
def test_grouped_query_attention_backward_counts_as_kv_repeated(op, counter_of_torch_2_11):
    q, k, v = _qkv(kv_heads=2)
    grad = torch.empty_like(q)
    repeated = op_flops(op, (grad, *_qkv(kv_heads=8)), {}, None)
    assert repeated > 0 and op_flops(op, (grad, q, k, v), {}, None) == repeated


def test_an_op_torchs_counter_refuses_counts_nothing_and_raises_nothing():
    assert op_flops(aten.mm, (torch.empty(2, 3), torch.empty(4, 5)), {}, None) == 0
    assert op_flops(aten.mm, (torch.empty(2, 3), torch.empty(3, 5)), {}, None) == 2 * 2 * 3 * 5
    assert op_flops(aten.relu, (torch.empty(3),), {}, None) == 0  # not counted by torch at all

"""Floating-point operations of one op, for the time model: torch's flop counter, made total.

NOTE [An op torch's flop counter refuses]: torch's counter asserts that attention's query, key and
value have the same number of heads, but grouped-query attention calls fused SDPA with fewer K/V heads
(``enable_gqa``; transformers does so on CUDA). Counting must never stop a profile: such an attention
op is counted as if K/V were repeated to the query's heads (the work the kernel does), and any other op
the counter refuses counts 0 flops (its time then comes from the device's measurement or bandwidth).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import flop_counter
from torch.utils.flop_counter import flop_registry


def op_flops(packet: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """The flops torch's counter gives ``packet`` on these arguments; see NOTE [An op torch's flop counter refuses]."""
    count = flop_registry.get(packet)
    if count is None:
        return 0
    try:
        return int(count(*args, **kwargs, out_val=out))
    except Exception:  # noqa: BLE001 -- torch's counter raises AssertionError, or TypeError on odd arguments
        return _attention_with_fewer_kv_heads(packet, args)


def _attention_with_fewer_kv_heads(packet: Any, args: tuple) -> int:
    name = str(packet)
    if "scaled_dot_product" not in name:
        return 0
    backward = name.endswith("_backward")
    qkv = args[1:4] if backward else args[0:3]
    if len(qkv) < 3:
        return 0
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in qkv):
        return 0
    q, k, v = (tuple(t.shape) for t in qkv)
    heads = q[1]
    if k[1] == 0 or heads % k[1] or heads % v[1]:
        return 0
    k, v = (k[0], heads, *k[2:]), (v[0], heads, *v[2:])
    try:
        if backward:
            return int(flop_counter.sdpa_backward_flop_count(tuple(args[0].shape), q, k, v))
        return int(flop_counter.sdpa_flop_count(q, k, v))
    except Exception:  # noqa: BLE001 -- shapes torch's counter still refuses count nothing, as above
        return 0

"""CUDA's SDPA backend choice and composites, run on CPU (real tensors for the math path, fake for the rest)."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from remat.profiling._cuda_kernels import choose_backend, cuda_kernels, cuda_sdpa
from remat.profiling._target_data import A100, H100


def qkv(dtype=torch.float32, heads=4, kv_heads=4, dim=64, seq=128, device="meta"):
    make = lambda h: torch.empty(2, h, seq, dim, dtype=dtype, device=device)  # noqa: E731
    return make(heads), make(kv_heads), make(kv_heads)


@pytest.mark.parametrize(
    "rules,dtype,kv,mask,dropout,gqa,want",
    [
        (H100.sdpa, torch.float32, 4, None, 0.1, False, "efficient"),  # GPT-2 fp32 on the H100
        (H100.sdpa, torch.float32, 2, None, 0.0, True, "math"),  # Llama fp32: efficient takes no GQA
        (H100.sdpa, torch.bfloat16, 2, None, 0.0, True, "cudnn"),  # bf16 runs took cuDNN
        (H100.sdpa, torch.bfloat16, 4, None, 0.1, False, "cudnn"),
        (A100.sdpa, torch.bfloat16, 2, None, 0.0, True, "flash"),  # cuDNN last off sm90
        (A100.sdpa, torch.bfloat16, 4, "mask", 0.0, False, "efficient"),  # flash takes no mask
        (H100.sdpa, torch.float32, 2, None, 0.0, False, "math"),  # head counts differ without enable_gqa
    ],
)
def test_backend_choice(rules, dtype, kv, mask, dropout, gqa, want):
    q, k, v = qkv(dtype, kv_heads=kv)
    m = torch.empty(128, 128, dtype=torch.bool, device="meta") if mask else None
    assert choose_backend(rules, q, k, v, m, dropout, mask is None, gqa) == want


def test_cudnn_head_dim_limit_falls_back_to_flash():
    q, k, v = qkv(torch.bfloat16, dim=256)
    assert choose_backend(H100.sdpa, q, k, v, None, 0.0, True, False) == "flash"


@pytest.mark.parametrize("gqa,dim", [(True, 64), (False, 30)])  # fp32 with GQA, or a head size efficient refuses
def test_math_path_computes_sdpa(gqa, dim):
    torch.manual_seed(0)
    q, k, v = qkv(kv_heads=2 if gqa else 4, dim=dim, device="cpu")
    q, k, v = (torch.randn_like(t) for t in (q, k, v))
    assert choose_backend(H100.sdpa, q, k, v, None, 0.0, True, gqa) == "math"
    ours = cuda_sdpa(H100.sdpa, q, k, v, is_causal=True, enable_gqa=gqa)
    torch_out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    torch.testing.assert_close(ours, torch_out, rtol=1e-4, atol=1e-5)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(func.__name__)
        return func(*args, **(kwargs or {}))


def test_fake_step_takes_the_cuda_kernels_in_forward_and_backward():
    mode = FakeTensorMode()
    with mode, cuda_kernels(H100.sdpa):
        x = torch.empty(2, 4, 128, 64, requires_grad=True)
        log = _Ops()
        with log:
            y = F.dropout(x, 0.1)
            out = F.scaled_dot_product_attention(y, y, y, dropout_p=0.1, is_causal=True)
            out.sum().backward()
    assert {
        "native_dropout.default",
        "_scaled_dot_product_efficient_attention.default",
        "_scaled_dot_product_efficient_attention_backward.default",
    } <= log.seen
    assert "bernoulli_.float" not in log.seen  # CPU's dropout draws a float mask
    y = F.dropout(torch.ones(1000), 0.5)  # the CPU kernels are back
    assert set(y.unique().tolist()) <= {0.0, 2.0}

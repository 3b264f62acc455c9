"""CUDA's autocast lists on CPU tensors while a fake profile for a CUDA target runs."""

import torch

from remat.profiling._cuda_autocast import cuda_autocast_lists


def _dtypes():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    w = torch.randn(8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return {
            "pow": x.pow(3.0).dtype,  # CUDA: float32
            "softmax": torch.softmax(x, -1).dtype,  # CUDA: float32 result
            "layer_norm": torch.nn.functional.layer_norm(x, (8,)).dtype,  # CUDA: float32
            "mm": torch.mm(x.float(), w).dtype,  # both: lower precision
            "add": (x + w[:4]).dtype,  # neither list: type promotion
        }


def test_cuda_policies_while_active_and_cpu_policies_after():
    cpu = _dtypes()
    with cuda_autocast_lists():
        cuda = _dtypes()
    assert cuda == {
        "pow": torch.float32,
        "softmax": torch.float32,
        "layer_norm": torch.float32,
        "mm": torch.bfloat16,
        "add": torch.float32,
    }
    assert cpu["pow"] == torch.bfloat16 and cpu["softmax"] == torch.bfloat16 and cpu["mm"] == torch.bfloat16
    assert _dtypes() == cpu


def test_cross_entropy_parts_meet_cuda_policies():
    # CPU autocasts cross_entropy_loss as a whole; CUDA only its parts (log_softmax, nll_loss), so a
    # bfloat16 input gives a float32 log_softmax either way, but through the composite on CUDA.
    logits = torch.randn(4, 10, dtype=torch.bfloat16, requires_grad=True)
    target = torch.tensor([1, 2, 3, 4])
    with cuda_autocast_lists(), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(logits, target)
    assert loss.dtype == torch.float32
    loss.backward()
    assert logits.grad.dtype == torch.bfloat16

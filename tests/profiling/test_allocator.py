"""The CUDA caching allocator's block sizes, as fake profiles for a CUDA target count them."""

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import remat
from remat.profiling._allocator import cuda_block_bytes, cuda_blocks, expandable_segments
from remat.profiling._target_data import H100

MiB = 1 << 20


@pytest.mark.parametrize(
    "asked,counted",
    [
        (0, 0),  # an empty storage allocates nothing
        (4, 512),  # a scalar takes the smallest block
        (513, 1024),
        (MiB, MiB),  # the small pool's largest request
        (MiB + 1, MiB + 512),  # a 20 MiB segment, split: more than 1 MiB remains
        (9 * MiB + 100, 9 * MiB + 512),
        (10 * MiB, 10 * MiB),  # its own segment, exactly
        (11 * MiB, 12 * MiB),  # a 12 MiB segment with 1 MiB left over is not split
        (11 * MiB + 1, 12 * MiB),
        (13 * MiB, 14 * MiB),
        (int(12.5 * MiB), int(12.5 * MiB)),  # 1.5 MiB would remain: split
        (22 * MiB, 22 * MiB),
    ],
)
def test_blocks_as_the_caching_allocator_counts_them(asked, counted):
    assert cuda_block_bytes(asked) == counted


def test_expandable_segments_split_large_blocks_finely(monkeypatch):
    assert cuda_block_bytes(11 * MiB, expandable=True) == 11 * MiB
    assert cuda_block_bytes(11 * MiB + 1, expandable=True) == 11 * MiB + 512
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert not expandable_segments() and cuda_blocks()(11 * MiB) == 12 * MiB
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512, expandable_segments:True")
    assert expandable_segments() and cuda_blocks()(11 * MiB) == 11 * MiB


class Up(nn.Module):
    """An 11 MiB weight and an 11 MiB activation (fp32, 1024 x 2816: a Llama 4x1024 up-projection)."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(1024, 2816, bias=False)
        self.down = nn.Linear(2816, 1024, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def test_a_fake_cuda_profile_counts_blocks_and_a_cpu_one_bytes():
    with torch.device("meta"):
        model = nn.Sequential(Up(), Up())
    x = torch.randn(1024, 1024)
    cuda = remat.profile(model, x, fake=True, target="h100")
    cpu = remat.profile(model, x, fake=True, target="cpu")
    weights = [p.numel() * p.element_size() for p in model.parameters()]
    assert weights == [11 * MiB] * 4
    assert cpu.resting_bytes == 44 * MiB + 4 * MiB  # weights and the input, exactly
    assert cuda.resting_bytes == 48 * MiB + 4 * MiB + H100.persistent_bytes
    assert cuda.param_bytes == 48 * MiB and cpu.param_bytes == 44 * MiB
    assert cuda.grad_bytes == 48 * MiB and cpu.grad_bytes == 44 * MiB
    # each block keeps its ReLU's 11 MiB output for the down-projection: a whole 12 MiB block on the GPU
    assert [b.saved_bytes["keep"] for b in cuda.blocks] == [12 * MiB] * 2
    assert [b.saved_bytes["keep"] for b in cpu.blocks] == [11 * MiB] * 2
    # beside the libraries' bytes, the peaks differ by at least the slack of 4 weights, their 4 gradients and the
    # 2 saved activations (the GPU's kernels may add workspace)
    assert cuda.baseline_peak_bytes - H100.persistent_bytes - cpu.baseline_peak_bytes >= (4 + 4 + 2) * MiB


_FRESH_ALLOCATIONS = """
import json, sys, torch
counted = []
for nbytes in json.loads(sys.argv[1]):
    before = torch.cuda.memory_allocated()
    t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    counted.append(torch.cuda.memory_allocated() - before)
    del t
    torch.cuda.empty_cache()  # the next request finds no cached block: a new segment, as the rule assumes
print(json.dumps(counted))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_cuda_allocator_counts_blocks_as_the_rule_says():
    sizes = [4, 513, MiB, MiB + 1, 11 * MiB, 13 * MiB, int(12.5 * MiB), 22 * MiB]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    out = subprocess.run(
        [sys.executable, "-c", _FRESH_ALLOCATIONS, json.dumps(sizes)], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [cuda_block_bytes(n) for n in sizes]

"""The per-target tables: library memory kept across steps follows cuBLAS's workspace configuration."""

import pytest
import torch

import remat
from remat.profiling._target_data import A100, H100, cublas_workspace

MiB = 1 << 20


@pytest.mark.parametrize(
    "config,per_handle",
    [
        (None, 32 * MiB),  # the H100's default, :4096:8
        (":4096:8", 32 * MiB),
        (":16:8", 128 * 1024),  # what torch.use_deterministic_algorithms suggests
        (":4096:2:16:8", 8 * MiB + 128 * 1024),
        ("", 32 * MiB),  # not understood: torch takes its default
        ("4096", 32 * MiB),
    ],
)
def test_cublas_workspace_follows_the_variable(monkeypatch, config, per_handle):
    if config is None:
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    else:
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", config)
    assert cublas_workspace(32 * MiB) == per_handle
    assert H100.persistent_bytes == 2 * per_handle + 2 * MiB


def test_library_bytes_per_device(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert H100.persistent_bytes == 66 * MiB  # the measured excess of benchmarks/gpu-truth
    assert A100.persistent_bytes == 2 * (8 * MiB + 128 * 1024) + 2 * MiB  # sm80's default workspaces


def test_a_fake_profile_takes_the_library_bytes_of_its_environment(monkeypatch):
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    x = torch.randn(8, 64)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    default = remat.profile(model, x, fake=True, target="h100")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    deterministic = remat.profile(model, x, fake=True, target="h100")
    assert default.resting_bytes - deterministic.resting_bytes == 2 * (32 * MiB - 128 * 1024)
    assert default.baseline_peak_bytes - deterministic.baseline_peak_bytes == 2 * (32 * MiB - 128 * 1024)

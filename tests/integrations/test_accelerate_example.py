"""examples/accelerate_loop.py runs: remat.auto on the loop's first batch dict, then the same losses as without."""

import importlib.util
import pathlib

import pytest
import torch

pytest.importorskip("transformers")

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "accelerate_loop.py"


def _example():
    spec = importlib.util.spec_from_file_location("accelerate_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_accelerate_loop_example_plans_on_the_batch_dict_and_trains_the_same(capsys):
    torch.use_deterministic_algorithms(True)
    example = _example()
    small = ["--steps", "2", "--layers", "3", "--seq", "64"]
    ours = example.main(["--budget", "0.7", *small])
    plain = example.main(["--no-remat", *small])
    assert ours["checkpointed"] and ours["measured_peak_bytes"] <= ours["budget_bytes"]
    assert ours["losses"] == plain["losses"]  # the same floats: recomputation changes nothing
    assert '"losses"' in capsys.readouterr().out

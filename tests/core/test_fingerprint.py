"""A step's summary tells bit-equal steps from different ones, without keeping either."""

import torch
from torch import nn

from remat.core._fingerprint import fingerprint


def _stepped(model: nn.Module, x: torch.Tensor) -> float:
    model.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    loss.backward()
    return loss.item()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))


def test_equal_steps_have_equal_fingerprints():
    model, x = _model(), torch.randn(5, 8)
    a = fingerprint(model, _stepped(model, x))
    b = fingerprint(model, _stepped(model, x))  # BatchNorm's running stats moved: buffers differ
    assert a.differences(b, exact=True) == sorted(
        f"buffer:1.{n}" for n in ("num_batches_tracked", "running_mean", "running_var")
    )
    assert fingerprint(model, 1.0).differences(fingerprint(model, 1.0), exact=True) == []


def test_one_ulp_in_one_gradient_differs_bit_for_bit_and_not_within_tolerance():
    model, x = _model(), torch.randn(5, 8)
    loss = _stepped(model, x)
    before = fingerprint(model, loss)
    grad = model[2].weight.grad
    grad[1, 3] = torch.nextafter(grad[1, 3], torch.tensor(float("inf")))
    after = fingerprint(model, loss)
    assert before.differences(after, exact=True) == ["grad:2.weight"]
    assert before.differences(after, exact=False) == []
    grad[1, 3] += 1.0
    assert fingerprint(model, loss).differences(before, exact=False) == ["grad:2.weight"]


def test_a_missing_gradient_and_another_loss_differ():
    model, x = _model(), torch.randn(5, 8)
    loss = _stepped(model, x)
    before = fingerprint(model, loss)
    model[0].bias.grad = None
    assert before.differences(fingerprint(model, loss + 1e-3), exact=True) == ["loss", "grad:0.bias"]


def test_swapped_elements_differ():
    # The digest weighs each element by its position: a permutation is a difference.
    model, x = _model(), torch.randn(5, 8)
    loss = _stepped(model, x)
    before = fingerprint(model, loss)
    w = model[2].weight.grad
    w[0, 0], w[0, 1] = w[0, 1].clone(), w[0, 0].clone()
    assert before.differences(fingerprint(model, loss), exact=True) == ["grad:2.weight"]


def test_a_summary_leaves_the_tensor_as_it_was_and_its_digest_does_not_follow_the_chunks(monkeypatch):
    # NOTE [A summary fits beside the step]: chunks of a sixteenth of the tensor, arithmetic in place
    from remat.core import _fingerprint

    wide = torch.randn(40000, dtype=torch.float64)
    before = wide.clone()
    _fingerprint._summarise(wide)
    assert torch.equal(wide, before)  # float64 chunks are views of the tensor itself
    t = torch.randn(40000)
    chunked = _fingerprint._summarise(t)
    monkeypatch.setattr(_fingerprint, "_PARTS", 1)
    monkeypatch.setattr(_fingerprint, "_CHUNK", 1 << 30)
    whole = _fingerprint._summarise(t)
    assert chunked.digest == whole.digest and abs(chunked.total - whole.total) <= 1e-9 * whole.magnitude
    t[12345] = torch.nextafter(t[12345], torch.tensor(2.0))
    assert _fingerprint._summarise(t).digest != chunked.digest


def test_complex_gradients_are_told_apart_by_their_imaginary_parts_without_a_warning():
    # A Fourier layer's complex weights: a cast to float64 dropped the imaginary part (and warned the user), and
    # complex tensors had no bit digest, so gradients differing there were called bit-equal.
    import warnings

    from remat.core import _fingerprint

    a = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.cfloat)
    b = torch.tensor([1 - 7j, 3 + 5j], dtype=torch.cfloat)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _fingerprint._summarise(a).digest != _fingerprint._summarise(b).digest
        assert _fingerprint._summarise(a).digest == _fingerprint._summarise(a.clone()).digest
        assert _fingerprint._summarise(a.conj()).digest == _fingerprint._summarise(a.conj().resolve_conj()).digest
    bumped = a.clone()
    bumped.imag[1] = torch.nextafter(bumped.imag[1], torch.tensor(2.0))
    assert _fingerprint._summarise(bumped).digest != _fingerprint._summarise(a).digest

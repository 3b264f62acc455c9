"""Hugging Face specifics: transformers' tracing check under a fake profile."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from remat.core._hf import fake_tensors_untraced


def test_fake_tensors_are_not_tracing_while_untraced():
    pytest.importorskip("transformers")
    import_utils = pytest.importorskip("transformers.utils.import_utils")
    if not hasattr(import_utils, "is_tracing") or not hasattr(import_utils, "is_fake_tensor"):
        pytest.skip("this transformers has no FakeTensor check")
    with FakeTensorMode():
        fake = torch.empty(2)
    assert import_utils.is_tracing(fake)
    with fake_tensors_untraced():
        assert not import_utils.is_tracing(fake)
    assert import_utils.is_tracing(fake)

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


def _t5():
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = tf.T5Config(
        d_model=32,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        d_kv=16,
        vocab_size=100,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    ids = torch.randint(1, 100, (2, 8))
    return tf.T5ForConditionalGeneration(config).train(), {"input_ids": ids, "labels": ids}


def _use_cache(model):
    return {name: m.config.use_cache for name, m in model.named_modules() if hasattr(m, "config")}


def test_t5_cache_off_on_every_config_and_restored_and_all_recomputed_matches_plain():
    # T5's decoder stack has a config of its own with use_cache=True (NOTE [Every config, not only the top one]).
    import copy

    from conftest import assert_grads_equal

    import remat

    model, inputs = _t5()
    before = _use_cache(model)
    assert before[""] and before["decoder"]
    reference = copy.deepcopy(model)
    # The cache changes T5's float rounding (not its values): compare with the model as remat runs it.
    reference.config.use_cache = reference.decoder.config.use_cache = False
    plan = remat.plan(remat.profile(model, inputs, repeat=1, warmup=0), strategy="all")
    assert _use_cache(model) == before  # profiling restores them
    remat.apply(model, plan)
    assert not any(_use_cache(model).values())
    torch.manual_seed(1)
    reference(**inputs).loss.backward()
    calls = []
    model.decoder.block[1].layer[0].register_forward_pre_hook(lambda m, a: calls.append(remat.is_recomputing()))
    torch.manual_seed(1)
    model(**inputs).loss.backward()
    assert calls == [False, True]  # the decoder block was recomputed
    assert_grads_equal(reference, model)
    remat.remove(model)
    assert _use_cache(model) == before

"""Hugging Face specifics: transformers' tracing check under a fake profile, the cache, LayerDrop."""

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


def _use_cache(model):
    return {name: m.config.use_cache for name, m in model.named_modules() if hasattr(m, "config")}


def test_t5_cache_off_on_every_config_and_restored_and_all_recomputed_matches_plain():
    # T5's decoder stack has a config of its own with use_cache=True (NOTE [Every config, not only the top one]).
    import copy

    from conftest import assert_grads_equal, tiny_t5

    import remat

    model, inputs = tiny_t5()
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


# --- NOTE [LayerDrop while planning] -----------------------------------------------------------------------------


class _Config:
    """A config as transformers' are: plain attributes, ``to_dict``, configs nested in it."""

    def __init__(self, **values):
        self.__dict__.update(values)

    def to_dict(self):
        return dict(vars(self))


class _Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)
        self.layerdrop = 0.2
        self.use_layerdrop = True  # a flag, not a probability
        self.layerdrop_every = 2  # a count, not a probability
        self.config = _Config(encoder_layerdrop=0.1, decoder_layerdrop=0.0, text_config=_Config(layerdrop=0.3))


def test_every_layer_runs_sets_each_layerdrop_probability_to_zero_and_puts_it_back():
    from remat.core._hf import every_layer_runs

    stack = _Stack()
    with every_layer_runs(stack):
        assert stack.layerdrop == 0.0
        assert stack.config.encoder_layerdrop == 0.0
        assert stack.config.text_config.layerdrop == 0.0
        assert stack.use_layerdrop is True and stack.layerdrop_every == 2
    assert (stack.layerdrop, stack.config.encoder_layerdrop, stack.config.text_config.layerdrop) == (0.2, 0.1, 0.3)
    assert stack.config.decoder_layerdrop == 0.0


def test_every_layer_runs_puts_the_probabilities_back_when_the_step_fails():
    from remat.core._hf import every_layer_runs

    stack = _Stack()
    with pytest.raises(KeyboardInterrupt), every_layer_runs(stack):
        raise KeyboardInterrupt
    assert (stack.layerdrop, stack.config.encoder_layerdrop) == (0.2, 0.1)


def _bart_with_layerdrop():
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = tf.BartConfig(
        vocab_size=128,
        d_model=32,
        encoder_layers=6,
        decoder_layers=6,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        encoder_layerdrop=0.3,
        decoder_layerdrop=0.3,
        dropout=0.1,
    )
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    return tf.BartForConditionalGeneration(config).train(), dict(
        input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids
    )


def test_bart_with_layerdrop_plans_for_every_layer_and_each_later_draw_stays_within_the_budget():
    # Before: auto profiled one draw (some layers skipped) and later steps peaked at 1.25-1.64x the budget.
    import copy

    from conftest import assert_grads_equal

    import remat

    model, batch = _bart_with_layerdrop()
    reference = copy.deepcopy(model)
    plan = remat.auto(model, batch, budget=0.8)
    assert model.model.encoder.layerdrop == 0.3 and model.config.encoder_layerdrop == 0.3
    layers_run = set()
    for seed in range(6):
        torch.manual_seed(seed)
        peak = remat.measure(model, batch, warmup=0, repeat=1).peak_bytes
        assert peak <= plan.budget_bytes, (seed, peak, plan.budget_bytes)
        for m in (model, reference):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(seed)
            m(**batch).loss.backward()
        assert_grads_equal(reference, model)
        layers_run.add(frozenset(n for n, p in model.named_parameters() if p.grad is not None))
    assert len(layers_run) > 1  # the draws did skip different layers
    remat.remove(model)


# --- an error only the step without a cache raises ----------------------------------------------------------------


class _StateWithoutCache(torch.nn.Module):
    """transformers 4.57's RecurrentGemma in small: without a cache, a layer adds the state it kept from the previous
    step, whose graph that step's backward freed. With the cache on (the user's own steps) it trains."""

    def __init__(self):
        super().__init__()
        self.config = _Config(use_cache=True)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
        self.state = None

    def forward(self, x):
        h = self.layers[0](x)
        if not self.config.use_cache:
            if self.state is not None:
                h = h + self.state
            self.state = h[:1]
        return self.layers[1](h).pow(2).mean()


@pytest.mark.parametrize("call", ["profile", "auto", "fake profile"])
def test_an_error_of_the_step_without_a_cache_says_that_remat_ran_it_so(call):
    import remat

    model, x = _StateWithoutCache(), torch.randn(3, 4)
    for _ in range(2):
        model(x).backward()  # the user's steps, with the cache, train
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    run = {
        "profile": lambda: remat.profile(model, x, repeat=2, warmup=1),
        "auto": lambda: remat.auto(model, x, 0.9, repeat=2, warmup=1),
        "fake profile": lambda: remat.profile(model, x, fake=True),
    }[call]
    with pytest.raises(remat.RematError) as err:
        run()
    message = str(err.value)
    assert "use_cache=False" in message and "run two steps with use_cache=False" in message, message
    assert model.config.use_cache is True
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_an_error_of_a_step_with_the_cache_on_does_not_blame_the_cache():
    import remat

    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

        def forward(self, x):
            raise ValueError("the model's own bug")

    with pytest.raises(remat.RematError) as err:
        remat.profile(Broken(), torch.randn(3, 4))
    assert "the model's own bug" in str(err.value) and "use_cache" not in str(err.value)


def test_only_the_models_own_errors_are_told_of_the_cache():
    from remat.core._hf import CACHE_OFF, cache_disabled
    from remat.errors import OutOfMemory, RematError

    for exc in (
        ValueError("the model's"),
        RematError("remat's"),
        OutOfMemory("remat's"),
        torch.OutOfMemoryError("torch's"),
    ):
        model = _StateWithoutCache()
        with pytest.raises(type(exc)) as err, cache_disabled(model):
            raise exc
        assert (CACHE_OFF in getattr(err.value, "__notes__", ())) == (type(exc) is ValueError), exc
        assert model.config.use_cache is True

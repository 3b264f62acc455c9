"""remat.measure and the storage tracker, against bytes computed by hand."""

import signal
import warnings

import pytest
import torch
import torch.utils.checkpoint as tc
from conftest import Interruptible, UntouchedByCtrlC, assert_state_equal
from torch import nn

import remat
from remat.core._memtrack import StorageTracker, allocator_peak, storage_bytes
from remat.core._state import capture
from remat.core._step import training_step
from remat.zoo import SeedCifarCNN, build


def test_tracker_counts_storages_by_hand():
    with StorageTracker() as t:
        a = torch.empty(1000)  # 4000 B
        b = torch.empty(2000)  # 8000 B -> 12000 live
        del a  # 8000
        view = b.view(2, 1000)  # same storage: nothing new
        c = torch.empty(500, dtype=torch.float64)  # 4000 B -> 12000
        d = torch.empty(0)
        d.resize_(250)  # grows in place to 1000 B -> 13000
    assert t.peak == 13000
    assert t.current == 13000
    del b, view
    assert t.current == 5000  # the view kept b alive until now
    del c, d
    assert t.current == 0


def test_tracker_ignores_known_storages_and_their_views():
    w = torch.randn(100, 100)
    with StorageTracker(known=[w]) as t:
        wt = w.t()  # a view of a resting tensor: not new memory
        y = wt @ torch.ones(100)  # 400 B of output; the 400 B of ones is freed right after
    assert t.current == 400 and t.peak == 800
    del wt, y


def test_storage_bytes_deduplicates():
    x = torch.empty(10, 10)
    assert storage_bytes([x, x[0], x.t()]) == 400


class Scale(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * self.w


def test_measure_peak_of_a_step_by_hand():
    n, batch = 1000, 100
    model = Scale(n)
    x = torch.randn(batch, n)
    m = remat.measure(model, x, warmup=0, repeat=1)
    resting = 4 * n + 4 * n * batch
    # Forward keeps y (batch x n) until the loss exists; backward materialises grad * x
    # (batch x n) and reduces it into w.grad (n) while it is alive. y and grad * x never
    # live together; a few scalars (loss, its gradient) do.
    assert m.resting_bytes == resting
    assert 0 <= m.peak_bytes - (resting + 4 * n * batch + 4 * n) <= 64, m
    assert m.grads_ok and m.missing_grads == () and m.device == "cpu"


def _deep_mlp(depth=6, width=64, hidden=1024):
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width)) for _ in range(depth)]
    )


def test_checkpointing_every_block_lowers_the_measured_peak():
    model = _deep_mlp()
    x = torch.randn(256, 64)
    plain = remat.measure(model, x, repeat=1)
    for block in model:
        remat.wrap(block)
    ckpt = remat.measure(model, x, repeat=1)
    # Each block keeps 2 x 256 x 1024 floats (2 MiB); checkpointed, only its 64 KiB input.
    # Parameter gradients (3 MiB) and one recomputed block remain at the peak.
    saved = plain.step_peak_bytes - ckpt.step_peak_bytes
    assert saved > 3 * 2 * 2**20
    assert ckpt.step_peak_bytes < 0.5 * plain.step_peak_bytes
    assert ckpt.grads_ok and plain.grads_ok


def test_measure_reports_parameters_without_gradient():
    model = SeedCifarCNN()

    class Reentrant(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                h = tc.checkpoint(self.inner.cnn_block_1, x, use_reentrant=True)
            return self.inner.head(self.inner.flatten(self.inner.cnn_block_2(h)))

    m = remat.measure(Reentrant(model), torch.randn(4, 3, 32, 32), repeat=1)
    assert not m.grads_ok
    assert set(m.missing_grads) == {f"inner.cnn_block_1.{i}.{p}" for i in (0, 2) for p in ("weight", "bias")}


class _LayerDropStack(nn.Module):
    """LayerDrop as transformers writes it: a layer skipped when a draw falls below ``layerdrop``."""

    def __init__(self, layers=6, width=64):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.layerdrop = 0.5

    def forward(self, x):
        for layer in self.layers:
            if self.training and torch.rand([]) < self.layerdrop:
                continue
            x = torch.tanh(layer(x))
        return x


def test_measure_runs_every_layer_of_a_layerdrop_model():
    # NOTE [LayerDrop while planning]: the step measured is the largest one a later step can be, and a layer a draw
    # would skip is not reported as untrained. The same seed without it skips layers here.
    model, x = _LayerDropStack(), torch.randn(256, 64)
    torch.manual_seed(0)
    m = remat.measure(model, x, repeat=1, warmup=0)
    assert m.missing_grads == () and m.grads_ok
    assert model.layerdrop == 0.5
    torch.manual_seed(0)
    model.layerdrop = 1.0
    dropped = remat.measure(model, x, repeat=1, warmup=0)
    model.layerdrop = 0.0
    every = remat.measure(model, x, repeat=1, warmup=0)
    assert dropped.missing_grads == () and dropped.peak_bytes == every.peak_bytes == m.peak_bytes


def test_measure_restores_model_optimizer_and_rng():
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    model[3].eval()  # a mixed training flag must survive too
    model(torch.randn(4, 8)).sum().backward()  # pre-existing gradients
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(4, 8)
    before = capture(model)
    m = remat.measure(model, x, optimizer=opt, warmup=2, repeat=2)
    assert_state_equal(before, capture(model))
    assert opt.state_dict()["state"] == {}
    # Adam's two moments are resting memory once the warm-up created them.
    params = sum(p.numel() * 4 for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    step_counters = 4 * len(list(model.parameters()))  # Adam keeps a 0-dim float32 step per parameter
    assert m.resting_bytes == 3 * params + buffers + 4 * 8 * 4 + step_counters


def test_measure_restores_even_when_the_step_raises():
    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(4)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            y = self.bn(x)
            if self.calls == 2:
                raise ValueError("boom")
            return y

    model = Boom()
    x = torch.randn(3, 4)
    before = capture(model)
    with pytest.raises(
        remat.RematError, match=r"raised ValueError in Boom.forward during a measured step: boom\. The model"
    ) as info:
        remat.measure(model, x, warmup=1, repeat=2)
    assert isinstance(info.value.__cause__, ValueError)
    assert_state_equal(before, capture(model))


def _first_step_peak(model, x):
    """Peak of one step of a plain loop on a fresh copy of ``x``, counted by hand with the tracker."""
    x = x.detach().clone().requires_grad_(x.requires_grad)
    resting = [*model.parameters(), x]
    with StorageTracker(known=resting) as t:
        model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    return storage_bytes(resting) + t.peak


@pytest.mark.parametrize("warmup", [0, 2])
def test_every_measured_step_starts_with_the_input_gradient_as_given(warmup):
    # The input's gradient is made at the end of backward, where it sets this model's peak: a gradient
    # left on the input by an earlier step (alive, accumulated into) would have measured 4096 B more.
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(2)])
    x = torch.randn(16, 64, requires_grad=True)
    peak = _first_step_peak(model, x)
    assert remat.measure(model, x, warmup=warmup, repeat=2).peak_bytes == peak
    assert x.grad is None and x.requires_grad and x._version == 0
    assert remat.measure(model, x.detach(), warmup=warmup, repeat=2).peak_bytes < peak  # it is counted


def test_measure_leaves_a_gradient_the_input_holds_as_it_was():
    model = _deep_mlp(depth=2, hidden=256)
    x = torch.randn(16, 64, requires_grad=True)
    held = x.grad = torch.randn_like(x)
    values, version = held.clone(), held._version
    m = remat.measure(model, x, warmup=1, repeat=2)
    assert x.grad is held and torch.equal(held, values) and held._version == version
    assert x._version == 0 and x.requires_grad
    # alive through the step like the input (the step accumulates into it in place)
    assert m.resting_bytes == storage_bytes([*model.parameters(), x, held])


def test_an_input_with_a_graph_is_measured_without_backward_into_it():
    # Each step backpropagates into a fresh leaf over the input's data: a second backward through the
    # user's graph would raise, and the user's leaves would collect gradients.
    model = _deep_mlp(depth=2, hidden=256)
    w = torch.randn(16, 64, requires_grad=True)
    x = torch.tanh(w)
    remat.measure(model, x, warmup=1, repeat=2)
    assert w.grad is None and x.grad_fn is not None


@pytest.mark.parametrize("at", [0, 3])  # the loop's first step (the optimizer's state made), the measured one
def test_ctrl_c_in_a_measured_step_leaves_everything_as_it_was(at):
    model, x = Interruptible(at), torch.randn(4, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    untouched = UntouchedByCtrlC(model, optimizer)
    untouched.check(lambda: remat.measure(model, x, optimizer=optimizer, warmup=1, repeat=1))


def test_ctrl_c_while_measure_restores_waits_until_everything_is_back():
    # A second Ctrl-C (a real SIGINT) lands while the optimizer's state is loaded back: it is
    # held until every restore ran, then raised.
    model, x = Interruptible(at=2), torch.randn(4, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    optimizer.register_load_state_dict_pre_hook(lambda opt, state: signal.raise_signal(signal.SIGINT))
    untouched = UntouchedByCtrlC(model, optimizer)
    untouched.check(lambda: remat.measure(model, x, optimizer=optimizer, warmup=1, repeat=1))


def test_bad_arguments_raise_remat_error():
    with pytest.raises(remat.RematError, match="repeat >= 1"):
        remat.measure(nn.Linear(2, 2), torch.randn(1, 2), repeat=0)
    with pytest.raises(remat.RematError, match="scalar"):
        remat.measure(nn.Linear(2, 2), torch.randn(1, 2), loss_fn=lambda out: out)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_comes_from_allocator_statistics():
    model = _deep_mlp().cuda()
    x = torch.randn(256, 64, device="cuda")
    m = remat.measure(model, x, repeat=1)
    resting = sum(p.numel() * 4 for p in model.parameters()) + x.numel() * 4
    assert m.resting_bytes >= resting and m.peak_bytes > m.resting_bytes


def test_allocator_peak_agrees_with_the_storage_tracker_on_eager_code():
    # The allocator's view (used for torch.compile, whose kernels bypass the dispatcher) and
    # remat's tracker count the same storages; the allocator also sees a few scratch bytes.
    zoo = build("gpt2", layers=2, hidden=64, heads=4, vocab=512, seq=64, batch=2)
    tracked = remat.measure(zoo.model, zoo.inputs, warmup=1, repeat=1)
    zoo.model.zero_grad(set_to_none=True)
    allocated, _ = allocator_peak(lambda: training_step(zoo.model, zoo.inputs))
    assert allocated == pytest.approx(tracked.step_peak_bytes, rel=1e-3)
    assert allocated >= tracked.step_peak_bytes


def test_measuring_a_compiled_model_leaves_torch_compile_compiling():
    # NOTE [A compiled step is counted without a dispatch mode]: the step counted under the storage tracker made
    # dynamo skip the model's forward for good, and later torch.compile's of its class ran eagerly.
    from torch._dynamo.testing import CompileCounter

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 16)

        def forward(self, x):
            return self.b(torch.relu(self.a(x))).square().mean()

    torch._dynamo.reset()
    torch.manual_seed(0)
    x = torch.randn(32, 16)
    compiled = torch.compile(Net(), backend=CompileCounter())
    measured = remat.measure(compiled, x, lambda loss: loss, warmup=0, repeat=1)
    assert measured.peak_bytes > 0 and measured.missing_grads == ()
    later = CompileCounter()
    torch.compile(Net(), backend=later)(x).backward()
    assert later.frame_count >= 1  # a new compile of the class compiled: its forward was not marked skipped
    torch._dynamo.reset()

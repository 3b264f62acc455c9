"""The peak model on the data flows issue #21 names beyond shared tensors and aux outputs.

Every mix of policies over four blocks (3**4 = 81 assignments) is predicted and then
measured for models whose blocks are not a chain:

* a U-Net: encoder outputs kept in a list and read by the decoder in reverse order
  (skips over one, three and five blocks), joined by concatenation;
* tied weights: two blocks share one ``nn.Linear`` module, and the head reuses the
  embedding's weight;
* a block called twice in one step (the same module, two calls: one policy for both);
* an output captured by a forward hook on a block's sub-module and read by the loss,
  never returned by the block (how transformers collects Mixtral's router logits):
  a storage made inside a block and freed outside it.

The promise: never under-predicted, and exact within 0.5%; also for a tensor shared by
every block beside a block whose auxiliary output reaches into its graph early.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import remat

POLICIES = ("keep", "selective", "full")
TOLERANCE = 0.005


class Block(nn.Module):
    def __init__(self, d_in: int, d_out: int, shared: nn.Linear | None = None) -> None:
        super().__init__()
        self.fc1 = shared if shared is not None else nn.Linear(d_in, 2 * d_out)
        self.fc2 = nn.Linear(2 * d_out, d_out)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(nn.functional.gelu(self.fc1(x))))


class UNet(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.down = nn.ModuleList(Block(d, d) for _ in range(2))
        self.up = nn.ModuleList(Block(2 * d, d) for _ in range(2))
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
        for block in self.up:
            x = block(torch.cat([x, skips.pop()], dim=-1))
        return self.head(x).logsumexp(-1).mean()


class Tied(nn.Module):
    def __init__(self, d: int = 32, vocab: int = 50) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        shared = nn.Linear(d, 2 * d)
        self.blocks = nn.ModuleList([Block(d, d, shared), Block(d, d), Block(d, d, shared), Block(d, d)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return (x @ self.embed.weight.t()).logsumexp(-1).mean()


class CalledTwice(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, d) for _ in range(4))
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in (0, 1, 2, 1, 3):  # blocks.1 runs twice: one policy, two calls
            x = x + self.blocks[i](x)
        return self.head(x).logsumexp(-1).mean()


class _GatedBlock(Block):
    def __init__(self, d: int) -> None:
        super().__init__(d, d)
        self.gate = nn.Linear(d, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.gate(x).softmax(-1).mean(-1, keepdim=True)


class Captured(nn.Module):
    """Each block's gate output is collected by a forward hook and read by the loss
    (as transformers collects Mixtral's router logits); the blocks return only x."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_GatedBlock(d) for _ in range(4))
        self.head = nn.Linear(d, 10)
        self.seen: list[torch.Tensor] | None = None
        for block in self.blocks:
            block.gate.register_forward_hook(self._record)

    def _record(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if self.seen is not None and not remat.is_recomputing():
            self.seen.append(output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = []
        for block in self.blocks:
            x = x + block(x)
        seen, self.seen = self.seen, None
        return self.head(x).logsumexp(-1).mean() + 0.01 * torch.cat(seen).pow(2).mean()


def _unet():
    return UNet(), torch.randn(4, 64, 32, generator=torch.Generator().manual_seed(1))


def _tied():
    return Tied(), torch.randint(0, 50, (4, 64), generator=torch.Generator().manual_seed(1))


def _twice():
    return CalledTwice(), torch.randn(4, 64, 32, generator=torch.Generator().manual_seed(1))


def _captured():
    return Captured(), torch.randn(4, 64, 32, generator=torch.Generator().manual_seed(1))


MODELS = {"unet": _unet, "tied": _tied, "called-twice": _twice, "hook-captured": _captured}


def _measured(model: nn.Module, x: torch.Tensor, assignment: dict[str, str]) -> int:
    for name, policy in assignment.items():
        remat.wrap(model.get_submodule(name), policy=policy)
    try:
        return remat.measure(model, x, repeat=1, warmup=0).peak_bytes
    finally:
        remat.remove(model)


@pytest.fixture(scope="module", params=list(MODELS))
def profiled(request):
    torch.manual_seed(0)
    model, x = MODELS[request.param]()
    prof = remat.profile(model, x, repeat=1, warmup=0)
    return request.param, model, x, prof


def test_the_blocks_are_the_four_modules(profiled):
    name, _, _, prof = profiled
    assert len(prof.blocks) == 4, (name, [b.name for b in prof.blocks])


def test_every_mix_is_predicted_on_the_safe_side_and_within_tolerance(profiled):
    name, model, x, prof = profiled
    names = [b.name for b in prof.blocks]
    bad = []
    for pick in itertools.product(POLICIES, repeat=len(names)):
        assignment = dict(zip(names, pick))
        predicted, measured = prof.predict_peak(assignment), _measured(model, x, assignment)
        if not measured <= predicted <= measured * (1 + TOLERANCE):
            bad.append(
                f"{''.join(p[0] for p in pick)}: predicted {predicted}, measured {measured} "
                f"({measured / predicted - 1:+.3%})"
            )
    assert not bad, f"{name}: {len(bad)} of {3 ** len(names)} mixes: " + "; ".join(bad[:8])


def test_a_hook_captured_storage_is_in_the_ledger():
    # The gate outputs leave their blocks only through the hook: without following storages
    # a block makes and frees elsewhere, a selective block's kept gate output (held by the
    # SAC cache until its backward) would be freed with the loss in the walk.
    torch.manual_seed(0)
    model, x = _captured()
    prof = remat.profile(model, x, repeat=1, warmup=0)
    made = [c for c in prof.crossings if not c.receivers and c.producer is not None]
    assert len(made) >= len(prof.blocks)
    assert {c.producer[1] for c in made} == {b.name for b in prof.blocks}


class _SharedAux(nn.Module):
    """A tensor given to every block, and the middle block also returns an aux loss term."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.shared = nn.Linear(d, 4 * d)
        self.fc1 = nn.ModuleList(nn.Linear(d, 4 * d) for _ in range(3))
        self.blocks = nn.ModuleList(_AuxBlock(fc, aux=i == 1) for i, fc in enumerate(self.fc1))
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared, aux = self.shared(x), 0.0
        for block in self.blocks:
            x, term = block(x, shared)
            aux = aux + term
        return self.head(x).logsumexp(-1).mean() + 0.01 * aux


class _AuxBlock(nn.Module):
    def __init__(self, fc1: nn.Linear, aux: bool) -> None:
        super().__init__()
        self.fc1, self.fc2, self.aux = fc1, nn.Linear(fc1.out_features, fc1.in_features), aux

    def forward(self, x: torch.Tensor, shared: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | float]:
        y = x + self.fc2(nn.functional.gelu(self.fc1(x) + shared))
        return y, (y.pow(2).mean() if self.aux else 0.0)


def test_a_shared_tensor_beside_an_aux_output_is_predicted_exactly():
    # The aux term's backward recomputes the middle block early, inside the next block's backward, and
    # frees what it rebuilt there again: replayed at its position with those frees (NOTE [Where a
    # recomputation runs]); once 'fks' was under by 8192 B (-2.1%) and mixes over by up to 18%.
    torch.manual_seed(0)
    model = _SharedAux()
    blocks = [n for n, m in model.named_modules() if isinstance(m, _AuxBlock)]
    x = torch.randn(2, 32, 32, generator=torch.Generator().manual_seed(1))
    prof = remat.profile(model, x, blocks=blocks, repeat=1, warmup=0)
    bad = []
    for pick in itertools.product(POLICIES, repeat=len(blocks)):
        assignment = dict(zip(blocks, pick))
        predicted, measured = prof.predict_peak(assignment), _measured(model, x, assignment)
        if not measured <= predicted <= measured * (1 + TOLERANCE):
            bad.append(f"{''.join(p[0] for p in pick)}: predicted {predicted}, measured {measured}")
    assert not bad, "; ".join(bad)

"""Generated models for ``test_generated_models.py``: data flows real models have.

A spec is a plain dict (hypothesis draws it, the regression tests spell it out with
``spec``). The parent embeds the input (so that no block writes to the user's tensor) and
computes the tensor shared by every block from it, then calls its blocks in ``order`` (one
block may appear twice: weight sharing), each call on the previous output plus, for
``skip`` s > 0, the output from s blocks further back (it keeps every output in a list);
``offset`` adds a parameter to a block's output in place in the parent
(``x = block(x); x += self.offsets[k]``). A block: an optional ``nn.ReLU(inplace=True)`` on
its input, ``fc1``, the shared tensor added or multiplied in, an activation (functional
GELU, an ``nn.GELU`` module or ``nn.ReLU(inplace=True)``), dropout, ``fc2``, the residual
(``x + y`` or ``y.add_(x)``), BatchNorm1d (between transposes: its output is a view), and
an auxiliary loss term of its inner activation returned beside the output (a router's).
A block may be frozen (its parameters need no gradients, as in fine-tuning), and so may the
embedding (then frozen first blocks build no graph at all); it may round its output with a
straight-through estimator (``y + (y.round() - y).detach()``, as quantizers do).
"""

from __future__ import annotations

import copy

import torch
from hypothesis import strategies as st
from torch import nn

BATCH, SEQ = 4, 64


class Block(nn.Module):
    def __init__(self, d: int, mult: int, drop: float, b: dict) -> None:
        super().__init__()
        self.b = b
        self.pre = nn.ReLU(inplace=True) if b["relu_first"] else None
        self.fc1, self.fc2 = nn.Linear(d, mult * d), nn.Linear(mult * d, d)
        self.act = {"fn": None, "gelu": nn.GELU(), "relu_": nn.ReLU(inplace=True)}[b["act"]]
        self.drop = nn.Dropout(drop) if drop else None
        self.bn = nn.BatchNorm1d(d) if b["bn"] else None
        self.requires_grad_(not b["frozen"])

    def forward(self, x: torch.Tensor, shared: torch.Tensor | None = None) -> torch.Tensor | tuple:
        if self.pre is not None:
            x = self.pre(x)
        h = self.fc1(x)
        if self.b["shared"] == "add":
            h = h + shared
        elif self.b["shared"] == "mul":
            h = h * shared
        h = nn.functional.gelu(h) if self.act is None else self.act(h)
        if self.drop is not None:
            h = self.drop(h)
        y = self.fc2(h)
        if self.b["straight"]:
            y = y + (y.round() - y).detach()
        if self.b["add_"]:
            y.add_(x)
        else:
            y = x + y
        if self.bn is not None:
            y = self.bn(y.transpose(1, 2)).transpose(1, 2)
        return (y, h.pow(2).mean()) if self.b["aux"] else y  # from inside the block (a router's loss)


class GenModel(nn.Module):
    def __init__(self, spec: dict) -> None:
        super().__init__()
        d, mult = spec["d"], spec["mult"]
        self.spec = spec
        self.embed = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d, mult, spec["drop"], b) for b in spec["blocks"])
        uses_shared = any(b["shared"] for b in spec["blocks"])
        self.shared = nn.Linear(d, mult * d) if uses_shared else None
        self.offsets = (
            nn.Parameter(0.1 * torch.randn(len(spec["calls"]), d)) if any(c["offset"] for c in spec["calls"]) else None
        )
        self.head = nn.Linear(d, 10)
        self.embed.requires_grad_(not spec["frozen_embed"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        shared = self.shared(x) if self.shared is not None else None  # saves x, which no block writes
        outs, aux = [h], 0.0
        for k, (i, call) in enumerate(zip(self.spec["order"], self.spec["calls"])):
            inp = outs[-1]
            if call["skip"] and len(outs) > call["skip"]:
                inp = inp + outs[-1 - call["skip"]]
            block = self.blocks[i]
            out = block(inp, shared) if block.b["shared"] else block(inp)
            if isinstance(out, tuple):
                out, term = out
                aux = aux + term
            if call["offset"]:
                out += self.offsets[k]  # in place in the parent, between blocks
            outs.append(out)
        return self.head(outs[-1]).logsumexp(-1).mean() + 0.01 * aux


def block_specs() -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries(
        {
            # in-place ReLUs are rarer (while (4) and (7) are open they take selective out of the whole model);
            # a rare value sits mid-list, as hypothesis draws the first and last indices more often
            "bn": st.booleans(),
            "aux": st.booleans(),
            "relu_first": st.sampled_from([False] * 4 + [True] + [False] * 4),
            "add_": st.sampled_from([False, True, False]),
            "shared": st.sampled_from([None, "add", "mul"]),
            "act": st.sampled_from(["fn", "gelu"] * 2 + ["relu_"] + ["fn", "gelu"] * 2),
            "frozen": st.sampled_from([False, True, False]),
            "straight": st.sampled_from([False, False, True, False]),
        }
    )


@st.composite
def model_specs(draw: st.DrawFn) -> dict:
    # Skips, aux outputs and a second call each make the parent no chain (nested segments then refuse to run),
    # each on in a third to a half of the models; so is writing in place between blocks.
    maybe = st.sampled_from([False, True, False])
    blocks = draw(st.lists(block_specs(), min_size=2, max_size=5))
    if not draw(st.booleans()):
        blocks = [{**b, "aux": False} for b in blocks]
    order = list(range(len(blocks)))
    if draw(maybe):  # weight sharing: one block called again, right after itself or later
        i = draw(st.integers(0, len(blocks) - 1))
        order.insert(draw(st.integers(i + 1, len(order))), i)
    skips = st.sampled_from([0, 1, 2, 3] if draw(maybe) else [0])
    offsets = st.booleans() if draw(st.booleans()) else st.just(False)
    calls = [{"skip": draw(skips), "offset": draw(offsets)} for _ in order]
    return {
        "d": draw(st.sampled_from([8, 16])),
        "mult": draw(st.sampled_from([2, 4])),
        "drop": draw(st.sampled_from([0.0, 0.1])),
        "eval": draw(st.booleans()),
        "input_grad": draw(st.sampled_from([False, True, False, False])),
        "frozen_embed": draw(st.sampled_from([False, True, False, False])),
        "blocks": blocks,
        "order": order,
        "calls": calls,
    }


def spec(blocks: list[dict], order: list[int] | None = None, calls: list[dict] | None = None, **top) -> dict:
    """A spec by hand: block fields default to off, calls to no skip and no offset."""
    base = {
        "bn": False,
        "aux": False,
        "relu_first": False,
        "add_": False,
        "shared": None,
        "act": "fn",
        "frozen": False,
        "straight": False,
    }
    blocks = [{**base, **b} for b in blocks]
    order = list(range(len(blocks))) if order is None else order
    calls = [{"skip": 0, "offset": False, **c} for c in (calls or [{} for _ in order])]
    return {
        "d": 8,
        "mult": 2,
        "drop": 0.0,
        "eval": False,
        "input_grad": False,
        "frozen_embed": False,
        **top,
        "blocks": blocks,
        "order": order,
        "calls": calls,
    }


def build(spec: dict) -> tuple[GenModel, torch.Tensor]:
    torch.manual_seed(0)
    model = GenModel(spec)
    if spec["eval"]:
        model.eval()  # as from_pretrained returns it; remat plans in training mode
    x = torch.randn(BATCH, SEQ, spec["d"], generator=torch.Generator().manual_seed(1))
    return model, x.requires_grad_(spec["input_grad"])


def features(spec: dict) -> set[str]:
    """Names of what the spec generates (hypothesis ``event``s and the report)."""
    out = {f"block:{k}={v}" for b in spec["blocks"] for k, v in b.items() if v}
    out |= {"called-twice"} if len(spec["order"]) > len(spec["blocks"]) else set()
    out |= {f"skip={c['skip']}" for c in spec["calls"] if c["skip"]}
    out |= {"parent-inplace"} if any(c["offset"] for c in spec["calls"]) else set()
    out |= {k for k in ("eval", "input_grad", "frozen_embed") if spec[k]}
    return out | ({"dropout"} if spec["drop"] else set())


class Untouched:
    """What every remat call must leave as it was: parameters, grads (None stays None), buffers, every
    module's training flag, requires_grad, no instance-level forward, and the input's values and ``.grad``."""

    def __init__(self, model: nn.Module, x: torch.Tensor) -> None:
        self.model, self.x = model, x
        self.before = self._snap()

    def _snap(self) -> dict:
        m, x = self.model, self.x
        return {
            "params": {
                n: (p.detach().clone(), p.requires_grad, None if p.grad is None else p.grad.clone())
                for n, p in m.named_parameters()
            },
            "buffers": {n: b.clone() for n, b in m.named_buffers()},
            "training": {n: mod.training for n, mod in m.named_modules()},
            "forwards": {n for n, mod in m.named_modules() if "forward" in mod.__dict__},
            "x": (x.detach().clone(), x.requires_grad, None if x.grad is None else x.grad.clone()),
        }

    def problems(self) -> list[str]:
        a, b, out = self.before, self._snap(), []
        for n, (data, rg, g) in a["params"].items():
            data2, rg2, g2 = b["params"][n]
            if not (torch.equal(data, data2) and rg == rg2):
                out.append(f"parameter {n} changed")
            if (g is None) != (g2 is None) or (g is not None and not torch.equal(g, g2)):
                out.append(f"{n}.grad changed")
        out += [f"buffer {n} changed" for n, buf in a["buffers"].items() if not torch.equal(buf, b["buffers"][n])]
        if a["training"] != b["training"]:
            out.append("training flags changed")
        if b["forwards"]:
            out.append(f"instance-level forward left on {sorted(b['forwards'])}")
        (x1, r1, g1), (x2, r2, g2) = a["x"], b["x"]
        if not (torch.equal(x1, x2) and r1 == r2):
            out.append("the input changed")
        if (g1 is None) != (g2 is None) or (g1 is not None and not torch.equal(g1, g2)):
            out.append(f"input .grad {'set' if g1 is None else 'changed'}")
        return out


def reference_step(model: nn.Module, x: torch.Tensor, seed: int = 7) -> dict:
    """Loss, gradients (parameters and input) and buffers after one training step of a copy of ``model``."""
    return train_step(copy.deepcopy(model), x.detach().clone().requires_grad_(x.requires_grad), seed)


def train_step(model: nn.Module, x: torch.Tensor, seed: int = 7) -> dict:
    """One training step on ``model`` itself (the caller restores it); what it produced, cloned."""
    mode = model.training
    model.train()
    torch.manual_seed(seed)
    loss = model(x)
    loss.backward()
    model.train(mode)
    return {
        "loss": loss.detach().clone(),
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "x.grad": None if x.grad is None else x.grad.clone(),
    }


def same_step(ref: dict, got: dict) -> list[str]:
    """What differs between two steps' results (empty: loss, gradients and buffers all ``torch.equal``)."""
    out = [] if torch.equal(ref["loss"], got["loss"]) else [f"loss {got['loss'].item()} != {ref['loss'].item()}"]
    for n, g in ref["grads"].items():
        g2 = got["grads"][n]
        if (g is None) != (g2 is None):
            out.append(f"grad of {n} {'appeared' if g is None else 'missing'}")
        elif g is not None and not torch.equal(g, g2):
            out.append(f"grad of {n} differs (max {(g - g2).abs().max():.3g})")
    out += [f"buffer {n} differs" for n, b in ref["buffers"].items() if not torch.equal(b, got["buffers"][n])]
    g, g2 = ref["x.grad"], got["x.grad"]
    if (g is None) != (g2 is None) or (g is not None and not torch.equal(g, g2)):
        out.append("the input's gradient differs")
    return out

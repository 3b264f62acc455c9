"""Budget sweeps on models that are not chains: measured peak against budget and prediction (issue #21).

    python benchmarks/dataflow.py                      # every family, 20 budgets (about 2 minutes on 2 cores)
    python benchmarks/dataflow.py --families t5 --budgets 8 --auto-budgets 2
    python benchmarks/dataflow.py --write              # also into BENCHMARKS.md (``benchmarks/_sections.py``)

Families, built from tiny configs with random weights (nothing is downloaded), each
fed a batch dict with ``labels`` so that ``output.loss`` is the loss, in training mode
(dropout as the configs set it), with padding in every batch:

* ``mistral``: ``MistralForCausalLM`` (SDPA; a causal + padding mask built in forward
  and given to every layer, rotary embeddings shared by every layer);
* ``bert``: ``BertForMaskedLM`` with ``attn_implementation="eager"`` (the extended
  padding mask given to every layer);
* ``t5``: ``T5ForConditionalGeneration``: encoder and decoder blocks; the relative
  position bias made by the first block of each stack and given to the others, the
  encoder's output read by every decoder block;
* ``mixtral``: ``MixtralForCausalLM`` with ``output_router_logits=True``: every layer
  also returns its router logits, which the loss reads (``router_aux_loss_coef`` times
  the load-balancing loss is added to ``output.loss``);
* ``encoder``: ``torch.nn.TransformerEncoder`` under a small LM head, given a causal
  mask and a key padding mask that every layer receives.

Blocks are found by remat (``blocks=None``) for every family: the layers of each
Hugging Face model (T5: ``encoder.block.*`` and ``decoder.block.*``, 8 blocks), the
``layers.*`` of the ``TransformerEncoder``.

For each family: one profile (``repeat=1, warmup=0``), then for budgets evenly spaced
from 1.0 of the un-checkpointed peak down to the lowest peak any plan reaches:
``remat.plan``, ``remat.apply``, ``remat.measure``, ``remat.remove`` (the plain plan,
no verification). Then a few of those budgets through ``remat.auto`` (verify on; it
profiles again each time). Per family a table per budget, then a summary: budgets
broken (measured > budget), the worst measured-minus-budget (goal: never above 0), and
the prediction error measured/predicted - 1 (max: worst under-prediction, should be
<= 0; min: worst over-prediction).
"""

from __future__ import annotations

import argparse
import platform
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

import remat
from remat.profiling._format import human_bytes

VOCAB = 512

#: Benchmark sizes: 4 layers, 128 wide, 4 x 64 tokens.
SIZES = {"layers": 4, "hidden": 128, "heads": 4, "seq": 64, "batch": 4}


def _batch(batch: int, seq: int, *, pad: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    """Token ids, a padding mask (the second half of the batch ends in ``pad`` padding tokens), labels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[batch // 2 :, seq - pad :] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _mistral(layers: int, hidden: int, heads: int, seq: int, batch: int) -> tuple[nn.Module, dict]:
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=2 * seq,
        use_cache=False,
    )
    return MistralForCausalLM(config), _batch(batch, seq)


def _bert(layers: int, hidden: int, heads: int, seq: int, batch: int) -> tuple[nn.Module, dict]:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=2 * seq,
        attn_implementation="eager",
    )
    model = BertForMaskedLM(config)
    assert model.config._attn_implementation == "eager", model.config._attn_implementation
    inputs = _batch(batch, seq)
    masked = torch.zeros_like(inputs["labels"], dtype=torch.bool)
    masked[:, ::4] = True  # an MLM batch: a quarter of the tokens carry labels
    inputs["labels"] = inputs["labels"].masked_fill(~masked, -100)
    return model, inputs


def _t5(layers: int, hidden: int, heads: int, seq: int, batch: int) -> tuple[nn.Module, dict]:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB,
        d_model=hidden,
        d_kv=hidden // heads,
        d_ff=2 * hidden,
        num_layers=layers,
        num_decoder_layers=layers,
        num_heads=heads,
        use_cache=False,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    inputs = _batch(batch, seq)
    inputs["labels"] = _batch(batch, seq // 2, seed=1)["labels"]  # targets half as long as the sources
    return T5ForConditionalGeneration(config), inputs


def _mixtral(layers: int, hidden: int, heads: int, seq: int, batch: int) -> tuple[nn.Module, dict]:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.02,
        max_position_embeddings=2 * seq,
        use_cache=False,
    )
    return MixtralForCausalLM(config), _batch(batch, seq)


class EncoderLM(nn.Module):
    """``nn.TransformerEncoder`` under an embedding and an LM head; a causal and a padding mask for every layer."""

    def __init__(self, layers: int, hidden: int, heads: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.pos = nn.Parameter(torch.randn(seq, hidden) * 0.02)
        layer = nn.TransformerEncoderLayer(hidden, heads, 2 * hidden, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> dict:
        seq = input_ids.shape[1]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=input_ids.device).triu(1)  # True: not attended
        x = self.embed(input_ids) + self.pos[:seq]
        h = self.encoder(x, mask=causal, src_key_padding_mask=attention_mask == 0)
        logits = self.head(h)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits}


def _encoder(layers: int, hidden: int, heads: int, seq: int, batch: int) -> tuple[nn.Module, dict]:
    return EncoderLM(layers, hidden, heads, seq), _batch(batch, seq)


FAMILIES: dict[str, Callable[..., tuple[nn.Module, dict]]] = {
    "mistral": _mistral,
    "bert": _bert,
    "t5": _t5,
    "mixtral": _mixtral,
    "encoder": _encoder,
}


def build(family: str, **sizes: int) -> tuple[nn.Module, dict]:
    """The model (training mode, seeded weights) and its batch."""
    torch.manual_seed(0)
    model, inputs = FAMILIES[family](**{**SIZES, **sizes})
    return model.train(), inputs


def measured_peak(model: nn.Module, inputs: dict, plan: remat.Plan) -> int:
    remat.apply(model, plan)
    try:
        return remat.measure(model, inputs, repeat=1, warmup=0).peak_bytes
    finally:
        remat.remove(model)


def fractions(prof: remat.Profile, n: int) -> list[int]:
    """``n`` budgets in bytes evenly spaced from the baseline peak down to the lowest peak any plan reaches."""
    top, low = prof.baseline_peak_bytes, remat.plan(prof, strategy="none").min_peak_bytes
    if n == 1:
        return [top]
    return [round(top - (top - low) * i / (n - 1)) for i in range(n)]


#: One letter per policy in the tables; a policy without one is written out, so a message built with
#: ``letters`` (tests/planning/test_families.py's) is never lost to a KeyError.
LETTERS = {"keep": "k", "selective": "s", "selective-ops": "o", "full": "f", "full-fine": "F"}


def letters(plan: remat.Plan) -> str:
    """One letter per block; a nested plan's segments after it, as (first block, last block)."""
    out = "".join(LETTERS.get(p, f"<{p}>") for p in plan.assignment.values())
    return out + "".join(f" ({a}..{b})" for a, b in plan.segments)


@dataclass
class Row:
    budget: int
    predicted: int | None
    measured: int | None
    assignment: str = ""
    note: str = ""

    @property
    def over(self) -> int | None:
        return None if self.measured is None else self.measured - self.budget

    @property
    def error(self) -> float | None:
        return None if self.measured is None or not self.predicted else self.measured / self.predicted - 1


@dataclass
class Result:
    family: str
    blocks: list[str]
    baseline: int
    minimum: int
    plain: list[Row] = field(default_factory=list)
    verified: list[Row] = field(default_factory=list)
    seconds: float = 0.0


def sweep(family: str, n_budgets: int, n_auto: int) -> Result:
    start = time.perf_counter()
    model, inputs = build(family)
    prof = remat.profile(model, inputs, repeat=1, warmup=0)
    budgets = fractions(prof, n_budgets)
    result = Result(
        family,
        [b.name for b in prof.blocks],
        prof.baseline_peak_bytes,
        remat.plan(prof, strategy="none").min_peak_bytes,
    )
    for budget in budgets:
        plan = remat.plan(prof, budget)
        result.plain.append(Row(budget, plan.predicted_peak_bytes, measured_peak(model, inputs, plan), letters(plan)))
    picks = sorted({round(i * (len(budgets) - 1) / max(n_auto - 1, 1)) for i in range(n_auto)})
    for budget in [budgets[i] for i in picks]:
        try:
            plan = remat.auto(model, inputs, budget, repeat=1, warmup=0)
        except remat.RematError as err:
            found = re.search(r"at least (\d+) bytes", str(err))
            lowest = f"; the lowest-peak plan measured {found.group(1)} B" if found else ""
            result.verified.append(Row(budget, None, None, note=f"refused (RematError){lowest}"))
            continue
        try:
            again = remat.measure(model, inputs, repeat=1, warmup=0).peak_bytes  # the plan auto left applied
        finally:
            remat.remove(model)
        note = f"re-measured {again - plan.measured_peak_bytes:+d} B" if again != plan.measured_peak_bytes else ""
        note = "; ".join(filter(None, [note, *plan.notes]))
        result.verified.append(
            Row(budget, plan.predicted_peak_bytes, max(plan.measured_peak_bytes, again), letters(plan), note)
        )
    result.seconds = time.perf_counter() - start
    return result


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x:+.3%}"


def family_table(r: Result) -> str:
    lines = [
        f"### {r.family} ({len(r.blocks)} blocks: {r.blocks[0]} ... {r.blocks[-1]}; {r.seconds:.0f} s)",
        "",
        f"Un-checkpointed peak {human_bytes(r.baseline)} ({r.baseline} B), lowest planned "
        f"{human_bytes(r.minimum)} ({r.minimum / r.baseline:.3f}). Assignment: one letter per block "
        "(k keep, s selective, o selective-ops, f full, F full-fine), then nested segments.",
        "",
        "| sweep | budget (B) | x baseline | assignment | predicted (B) | measured (B) | measured - budget | "
        "measured / predicted - 1 | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, rows in (("plan", r.plain), ("auto", r.verified)):
        for row in rows:
            over = "" if row.over is None else f"{row.over:+d}" + (" **over**" if row.over > 0 else "")
            lines.append(
                f"| {label} | {row.budget} | {row.budget / r.baseline:.3f} | {row.assignment} | "
                f"{row.predicted or ''} | {row.measured or ''} | {over} | {_pct(row.error)} | {row.note} |"
            )
    return "\n".join(lines)


def _worst(rows: list[Row]) -> tuple[int, int, Row | None]:
    measured = [r for r in rows if r.measured is not None]
    broken = sum(1 for r in measured if r.over > 0)
    worst = max(measured, key=lambda r: r.over, default=None)
    return len(rows), broken, worst


def summary(results: list[Result]) -> str:
    lines = [
        "| family | blocks | budgets (plan) | broken (plan) | worst measured - budget (plan) | "
        "under-predicted (plan) | prediction error max / min | budgets (auto) | broken (auto) | "
        "refused (auto) | worst measured - budget (auto) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        n, broken, worst = _worst(r.plain)
        errors = [row.error for row in r.plain if row.error is not None]
        na, broken_a, worst_a = _worst(r.verified)
        refused = sum(1 for row in r.verified if row.measured is None)
        cell = lambda w: "" if w is None else f"{w.over:+d} B ({w.over / w.budget:+.3%})"  # noqa: E731
        under = sum(1 for e in errors if e > 0)
        lines.append(
            f"| {r.family} | {len(r.blocks)} | {n} | {broken} | {cell(worst)} | {under} | "
            f"{_pct(max(errors))} / {_pct(min(errors))} | {na} | {broken_a} | {refused} | {cell(worst_a)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--budgets", type=int, default=20, help="budgets per family for the plain plans")
    parser.add_argument("--auto-budgets", type=int, default=5, help="of those, how many go through remat.auto")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (peaks do not depend on it; 2 threads on 2 shared cores ran 100x slower)",
    )
    import _sections  # here, not at the top: tests/planning/test_families.py imports this file for its families

    _sections.add_write_option(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with _sections.recorded(__file__, "Budget sweeps on models that are not chains", write_to=args.write):
        _sweeps(args)


def _sweeps(args: argparse.Namespace) -> None:
    import transformers

    print(
        f"device cpu ({platform.machine()}, {torch.get_num_threads()} threads), torch {torch.__version__}, "
        f"transformers {transformers.__version__}, python {platform.python_version()}; sizes {SIZES}, "
        f"vocab {VOCAB}\n",
        flush=True,
    )
    results = []
    for family in args.families:
        results.append(sweep(family, args.budgets, args.auto_budgets))
        print(family_table(results[-1]) + "\n", flush=True)
    print("### Summary\n")
    print(summary(results))


if __name__ == "__main__":
    sys.exit(main())

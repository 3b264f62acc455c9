"""A model whose training step does not fit the GPU, trained through the Hugging Face Trainer and RematCallback.

    PYTHONPATH=src python benchmarks/gpu_fit.py [--config llama-1b-2048] [--fraction 0.5] [--steps 3] [--write]
    PYTHONPATH=src python benchmarks/gpu_fit.py --simulate     # the same run on the CPU, a small Llama

On CUDA this process is limited to ``--fraction`` of the GPU (``torch.cuda.set_per_process_memory_fraction``); then
a configuration of ``benchmarks/gpu-truth/h100.json`` (random weights) is trained for ``--steps`` steps with AdamW:

1. by the Trainer alone, which must run out of memory (else the model fits and the run proves nothing);
2. by the Trainer with ``RematCallback(budget=None)``: the plan fits the room this process has on the GPU.

It prints what auto chose, its predicted and verified peaks, the allocator's most allocated and reserved over
the whole second run (planning included) against the capacity, the step times (the first one holds auto) and
the losses. ``--simulate`` runs both on the CPU inside the fit tests' simulated device (``tests/_device.py``) of
0.7 of the Trainer's own peak, with that capacity as the budget (``budget=None`` is for CUDA), and with SGD: on
the CPU the snapshot auto's verification steps restore from sits in the memory the step runs in, and with AdamW
it holds the parameters and both moments (NOTE [Snapshots a step without an optimizer needs]), where on CUDA
it goes to host memory. ``--write`` puts the table into BENCHMARKS.md between this script's markers
(``benchmarks/_sections.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _sections
import torch
import transformers

from remat.bench._gpu_truth import build_config, load
from remat.integrations.transformers import RematCallback
from remat.profiling._format import human_bytes
from remat.zoo import build

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _device import SimulatedDevice  # noqa: E402  (the fit tests' device: real storages, fake tensors not counted)

#: ``--simulate``'s Llama: small enough for seconds per step on the CPU.
SMALL = {"layers": 4, "hidden": 128, "intermediate": 344, "heads": 4, "kv_heads": 2, "vocab": 2048, "seq": 128}


class _Clock(transformers.TrainerCallback):
    """Each step's wall time (synchronised on CUDA) and the logged losses."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.losses: list[float] = []
        self._start = 0.0

    def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
        _sync()
        self._start = time.perf_counter()

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        _sync()
        self.seconds.append(time.perf_counter() - self._start)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _model(args: argparse.Namespace) -> Any:
    """The model and one batch, the same weights every call."""
    if args.simulate:
        return build("llama", batch=args.batch, **SMALL)
    return build_config(load("h100.json"), args.config, "cuda")


def _rows(batch: dict[str, torch.Tensor], steps: int) -> list[dict[str, torch.Tensor]]:
    """``steps`` batches' worth of examples: the batch's rows again and again (the Trainer collates them)."""
    rows = [{k: v[i].cpu() for k, v in batch.items()} for i in range(len(batch["input_ids"]))]
    return rows * steps


def _train(args: argparse.Namespace, out: str, *callbacks: Any) -> tuple[Any, _Clock]:
    zoo = _model(args)
    clock = _Clock()
    arguments = transformers.TrainingArguments(
        output_dir=out,
        max_steps=args.steps,
        per_device_train_batch_size=len(zoo.inputs["input_ids"]),
        learning_rate=1e-4,
        optim="sgd" if args.simulate else "adamw_torch",  # see the module's docstring
        report_to=[],
        use_cpu=args.simulate,
        save_strategy="no",
        logging_steps=1,
        seed=0,
        data_seed=0,
    )
    trainer = transformers.Trainer(
        model=zoo.model, args=arguments, train_dataset=_rows(zoo.inputs, args.steps), callbacks=[clock, *callbacks]
    )
    trainer.train()
    return zoo.model, clock


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _device(args: argparse.Namespace, capacity: int) -> contextlib.AbstractContextManager:
    return SimulatedDevice(capacity) if args.simulate else contextlib.nullcontext()


def run(args: argparse.Namespace, out: str) -> list[str]:
    if args.simulate:
        with SimulatedDevice(1 << 50) as roomy:
            _train(args, out)
        capacity = int(0.7 * roomy.peak)
        budget: Any = capacity
    else:
        torch.cuda.set_per_process_memory_fraction(args.fraction)
        capacity = int(args.fraction * torch.cuda.get_device_properties(0).total_memory)
        budget = None
    _release()
    try:
        with _device(args, capacity):
            _train(args, out)
        refused = "no: it fits, so this run proves nothing"
    except torch.OutOfMemoryError as exc:
        refused = "yes (" + str(exc).strip().splitlines()[0][:90] + ")"
    _release()
    callback = RematCallback(budget)
    with _device(args, capacity) as device:
        _, clock = _train(args, out, callback)
    plan = callback.plan
    if plan is None:
        raise SystemExit("RematCallback made no plan")
    if args.simulate:
        allocated, reserved = device.peak, None
    else:
        allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    later = statistics.median(clock.seconds[1:]) if len(clock.seconds) > 1 else float("nan")
    return [
        "| | |",
        "|---|---|",
        f"| model | {args.config + ', AdamW' if not args.simulate else 'llama (small), SGD'} |",
        f"| capacity | {human_bytes(capacity)} ({'simulated' if args.simulate else f'{args.fraction} of the GPU'}) |",
        f"| the Trainer alone runs out of memory | {refused} |",
        f"| plan | {plan.summary().split('. ')[0]} |",
        f"| predicted / verified peak of its step | {human_bytes(plan.predicted_peak_bytes)} / "
        f"{human_bytes(plan.measured_peak_bytes or 0)} |",
        f"| most allocated over the run (planning included) | {human_bytes(allocated)} |",
        f"| most reserved over the run | {human_bytes(reserved) if reserved is not None else 'n/a'} |",
        f"| within the capacity | {'yes' if max(allocated, reserved or 0) <= capacity else 'NO'} |",
        f"| step times | {', '.join(f'{s:.2f} s' for s in clock.seconds)} |",
        f"| the first step over the later ones (auto's cost, in steps of the plan) | "
        f"{(clock.seconds[0] - later) / later:.1f} |",
        f"| losses | {', '.join(f'{x:.4f}' for x in clock.losses)} |",
        *(f"| note | {n} |" for n in plan.notes),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="llama-1b-2048", help="a configuration of gpu-truth/h100.json")
    parser.add_argument("--fraction", type=float, default=0.5, help="share of the GPU this process may use")
    parser.add_argument("--steps", type=int, default=3, help="training steps of each run")
    parser.add_argument("--batch", type=int, default=4, help="--simulate's batch")
    parser.add_argument("--simulate", action="store_true", help="on the CPU, inside a simulated device")
    parser.add_argument("--write", action="store_true", help="write the table into BENCHMARKS.md")
    args = parser.parse_args()
    if not args.simulate and not torch.cuda.is_available():
        print("gpu_fit.py needs CUDA (or --simulate for the same run on the CPU); nothing was run.")
        return
    with tempfile.TemporaryDirectory() as out:
        lines = run(args, out)
    print("\n".join(lines))
    if args.write:
        title = "A model that does not fit, trained through the Trainer callback"
        _sections.write(__file__, [*_sections.header(title, cuda=not args.simulate), *lines])


if __name__ == "__main__":
    main()

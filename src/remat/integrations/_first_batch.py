"""What the callbacks share: plan on the first real training batch, log it, write it beside the run.

NOTE [Plan on the first real batch]
A plan is only as good as the batch it was profiled on: its shapes (sequence length, padding)
set the activations. The callbacks therefore wait for the first batch the loop really trains on
and call ``remat.auto`` with it before that batch's own forward runs, so the plan is on the model
before the first backward and the first optimizer step. ``remat.auto`` profiles and verifies with
real steps but restores parameters, gradients, buffers and the RNG streams afterwards
(``remat.core._state``), so the run trains exactly as it would have without the callback, only
with the chosen blocks recomputed.
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any

from torch import nn

import remat
from remat.profiling._format import human_bytes

log = logging.getLogger("remat")

#: The file the callbacks write the applied plan to, in the run's output folder.
PLAN_FILE = "remat_plan.json"


def check_budget(budget: Any, api: str) -> None:
    """Fail at construction, not after the first batch, on a budget ``parse_budget`` refuses."""
    if budget is None:
        raise remat.RematError(
            f"{api}: give budget= (a fraction of the peak without checkpointing such as 0.5, or bytes such as '20GiB')."
        )
    remat.parse_budget(budget, 1)


def with_loop(options: dict[str, Any], optimizer: Any, accumulation_steps: int) -> dict[str, Any]:
    """``remat.auto``'s options with the training loop's optimizer and gradient accumulation (NOTE [The step a
    loop repeats]), unless the caller gave them (``optimizer=None``: plan for the bare step)."""
    return {"optimizer": optimizer, "accumulation_steps": accumulation_steps, **options}


def plan_on_batch(
    model: nn.Module, inputs: Any, budget: Any, options: dict[str, Any], out_dir: Any, api: str
) -> remat.Plan:
    """``remat.auto`` on the real batch; logs the plan and its measured peak and writes it to ``out_dir``."""
    plan = remat.auto(model, inputs, budget, **options)
    measured = "not measured" if plan.measured_peak_bytes is None else human_bytes(plan.measured_peak_bytes)
    log.info("%s: %s", api, plan.summary())
    log.info("%s: checkpointed %s; measured peak of one step %s", api, plan.checkpointed or "nothing", measured)
    if out_dir:
        folder = pathlib.Path(out_dir)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / PLAN_FILE).write_text(plan.to_json())
        log.info("%s: wrote the plan to %s", api, folder / PLAN_FILE)
    return plan

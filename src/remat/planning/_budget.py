"""Budgets in every form users write them, read by one rule (NOTE [One budget rule])."""

from __future__ import annotations

import math
import numbers
import re
from typing import Any

from remat.errors import RematError

__all__ = ["ACCEPTED_BUDGETS", "Unreachable", "parse_budget"]


class Unreachable(RematError):
    """No plan on this profile reaches the budget (predicted by ``remat.plan``, or measured by auto's verification)."""


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
ACCEPTED_BUDGETS = (
    "a fraction 0 < f <= 1 of the peak without checkpointing (0.5, '0.5', '50%'), bytes with a unit "
    "('6GiB', '500MB', '4096B'), or whole bytes of at least 1024 without one (6000000000)"
)
_BUDGET_TEXT = re.compile(r"\s*([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[+-]?[0-9]+)?)\s*(%|[a-zA-Z]*)\s*", re.IGNORECASE)

#: Unitless numbers from here up are bytes; below, only fractions 0 < f <= 1 are read (NOTE [One budget rule]).
_MIN_UNITLESS_BYTES = 1024


def _budget_error(budget: Any, why: str) -> RematError:
    return RematError(f"remat.plan: budget={budget!r} {why}; give {ACCEPTED_BUDGETS}.")


def _split_budget(budget: Any) -> tuple[float, str]:
    """(number, unit) of ``budget``: unit is ``""`` for a bare number, ``"%"`` or a byte unit."""
    if isinstance(budget, str):
        match = _BUDGET_TEXT.fullmatch(budget)
        if not match or match.group(2).lower() not in {*_UNITS, "%"}:
            raise _budget_error(budget, "cannot be read")
        number, unit = float(match.group(1)), match.group(2).lower()
        return number, unit
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real):
        raise _budget_error(budget, f"is a {type(budget).__name__}, not a budget")
    return float(budget), ""


def parse_budget(budget: Any, baseline_bytes: int) -> int:
    """Bytes for ``budget``, by one rule whatever its form (NOTE [One budget rule]).

    NOTE [One budget rule]
    The same number means the same in every form: ``0.5``, ``"0.5"`` and ``"50%"`` are
    half of ``baseline_bytes``; ``1``, ``1.0``, ``"1"`` and ``"100%"`` are all of it.

    * a number without a unit (int, float or string): a fraction ``0 < f <= 1`` of the
      baseline peak, or bytes when it is a whole number of at least 1024
      (``6_000_000_000``, ``"6e9"``);
    * a percentage ``"80%"``: ``0 < p <= 100`` of the baseline peak;
    * a number with a byte unit (``"20GiB"``, ``"1.5GB"``, ``"500MB"``, ``"4096B"``): bytes.

    Anything else is refused with the accepted forms: a unitless number between 1
    and 1024 or with a fraction part above 1 (``1.5``: 150% or 1 byte?), zero,
    negatives, NaN, infinities, typos.
    """
    number, unit = _split_budget(budget)
    if not math.isfinite(number) or number <= 0:
        raise _budget_error(budget, "must be a positive finite number")
    if unit == "%":
        if number > 100:
            raise _budget_error(budget, "is above 100% of the peak without checkpointing, which needs no plan")
        return int(number / 100 * baseline_bytes)
    if unit:
        value = int(number * _UNITS[unit])
        if value < 1:
            raise _budget_error(budget, "is less than one byte")
        return value
    if number <= 1:
        return int(number * baseline_bytes)
    if number >= _MIN_UNITLESS_BYTES and number == int(number):
        return int(number)
    raise _budget_error(
        budget,
        f"is ambiguous: a unitless number above 1 is bytes only when whole and at least "
        f"{_MIN_UNITLESS_BYTES} (is {number:g} a fraction or bytes?); say which with a unit, e.g. '{number:g}GiB'",
    )

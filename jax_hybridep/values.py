"""Validation of user-given scalar settings (configs, layer arguments): each failure a ValueError
that names the setting, the value given and what is expected. Bools are never taken as numbers."""

from __future__ import annotations

import math

import numpy as np


def is_real(value) -> bool:
    """Whether value is an int or float (Python or numpy), not a bool."""
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(
        value, bool | np.bool_
    )


def check_int(name: str, value, lo: int, hi: int | None = None, what: str | None = None) -> int:
    """value as an int in [lo, hi]."""
    integral = isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)
    if not integral or value < lo or (hi is not None and value > hi):
        bounds = f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {what or bounds}, got {value!r}")
    return int(value)


def check_real(name: str, value, lo: float = -math.inf, *, positive: bool = False) -> float:
    """value as a finite float >= lo (> 0 with positive=True)."""
    ok = is_real(value) and math.isfinite(value) and value >= lo and (value > 0 or not positive)
    if not ok:
        bound = "> 0" if positive else (f">= {lo:g}" if lo > -math.inf else "")
        raise ValueError(f"{name} must be a finite number {bound}".rstrip() + f", got {value!r}")
    return float(value)


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)

"""Errors the ops raise at run time, worded identically by every backend."""

from __future__ import annotations

from collections.abc import Sequence


class StrictModeError(RuntimeError):
    """A dispatch in strict mode dropped rows over capacity or saw invalid expert ids."""


def strict_mode_message(
    group: int, dropped_per_rank: Sequence[int], invalid_per_rank: Sequence[int]
) -> str:
    """The strict-mode error text; xla_ffi/cpu_handlers.cc writes the same words."""
    dropped = [int(v) for v in dropped_per_rank]
    invalid = [int(v) for v in invalid_per_rank]
    return (
        f"jax_hybridep strict mode: {sum(dropped)} row(s) dropped over capacity and "
        f"{sum(invalid)} invalid expert id(s) in EP group {group}; dropped per EP rank "
        f"[{', '.join(map(str, dropped))}], invalid per EP rank [{', '.join(map(str, invalid))}]"
    )

"""Argument types shared by the benchmark CLIs: every bad flag fails at parse time (argparse's
usage error) naming the flag's value and what it takes, before any device or model is set up."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

from jax_hybridep.values import output_path_arg

# An output path flag: '' (skip) or a writable file path, checked at parse time.
output_path = output_path_arg


def _int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = lo - 1
        if value < lo:
            raise argparse.ArgumentTypeError(f"{text!r} is not an int >= {lo}")
        return value

    return parse


positive_int = _int_at_least(1)
nonnegative_int = _int_at_least(0)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number > 0") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number > 0")
    return value


def choice_list(choices: Sequence[str]):
    """A comma list of some of `choices` (at least one)."""

    def parse(text: str) -> list[str]:
        items = [s.strip() for s in text.split(",") if s.strip()]
        unknown = [s for s in items if s not in choices]
        if unknown or not items:
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected a comma list of {tuple(choices)}"
                + (f"; unknown {unknown}" if unknown else "")
            )
        return items

    return parse


def positive_int_list(text: str) -> list[int]:
    try:
        return [positive_int(s) for s in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of ints >= 1") from None


def capacity_list(text: str):
    """'dropless' (or 'none') -> None, 'budget=F' -> runner.Budget(F), f -> capacity factor f."""
    from jax_hybridep.bench import runner  # noqa: PLC0415  (imports jax)

    out = []
    for item in (s.strip() for s in text.split(",")):
        if item in ("none", "dropless"):
            out.append(None)
            continue
        factor = item.split("=", 1)[1] if item.startswith("budget=") else item
        try:
            value = positive_float(factor)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"{item!r} in {text!r}: expected 'dropless', a capacity factor f > 0 or "
                "'budget=F' with F > 0"
            ) from None
        out.append(runner.Budget(value) if item.startswith("budget=") else value)
    return out

"""Validation of user-given values (configs, layer and planner arguments, concrete numpy arrays,
CLI output paths): each failure a ValueError (a value out of range) or TypeError (a value of the
wrong kind) that names the argument, the value given and what is expected. Bools are never taken as
numbers, floats never as ints, strings never as numbers; nothing is truncated or coerced.

These run on Python values at trace time or on concrete (numpy) values, never inside a compiled
program.
docs/errors.md lists what each public function checks.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence

import numpy as np


def is_real(value) -> bool:
    """Whether value is an int or float (Python or numpy), not a bool."""
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(
        value, bool | np.bool_
    )


def is_int(value) -> bool:
    """Whether value is an int (Python or numpy), not a bool."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def short(value, limit: int = 120) -> str:
    """repr(value), cut to `limit` characters for messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_int(name: str, value, lo: int, hi: int | None = None, what: str | None = None) -> int:
    """value as an int in [lo, hi]."""
    if not is_int(value) or value < lo or (hi is not None and value > hi):
        bounds = f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {what or bounds}, got {short(value)}")
    return int(value)


def check_real(
    name: str,
    value,
    lo: float = -math.inf,
    hi: float = math.inf,
    *,
    positive: bool = False,
    below_hi: bool = False,
) -> float:
    """value as a finite float in [lo, hi] (> 0 with positive=True; < hi with below_hi=True)."""
    ok = (
        is_real(value)
        and math.isfinite(value)
        and lo <= value <= hi
        and (value > 0 or not positive)
        and (value < hi or not below_hi)
    )
    if not ok:
        if positive:
            bound = "> 0"
        elif hi < math.inf:
            bound = f"in [{lo:g}, {hi:g}{')' if below_hi else ']'}"
        else:
            bound = f">= {lo:g}" if lo > -math.inf else ""
        raise ValueError(
            f"{name} must be a finite number {bound}".rstrip() + f", got {short(value)}"
        )
    return float(value)


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be a bool, got {short(value)}")
    return bool(value)


def check_str(name: str, value, choices: Sequence[str] | None = None) -> str:
    """value as a str, one of `choices` when given."""
    if not isinstance(value, str):
        want = f"one of {tuple(choices)}" if choices is not None else "a str"
        raise TypeError(f"{name} must be {want}, got {short(value)}")
    if choices is not None and value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value


def check_type(name: str, value, cls: type | tuple[type, ...], what: str):
    """value itself when it is an instance of cls; else a TypeError saying `what` it must be."""
    if not isinstance(value, cls):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {short(value)}")
    return value


def check_ints(name: str, values, lo: int, *, min_len: int = 1) -> tuple[int, ...]:
    """values (a sequence of ints, not a str) as a tuple of ints >= lo, at least min_len long."""
    if isinstance(values, str | bytes) or not isinstance(values, Sequence | np.ndarray):
        raise TypeError(f"{name} must be a sequence of ints, got {short(values)}")
    if len(values) < min_len or not all(is_int(v) and v >= lo for v in values):
        count = {0: "a sequence of", 1: "one or more"}.get(min_len, f"{min_len} or more")
        raise ValueError(f"{name} must be {count} ints >= {lo}, got {short(values)}")
    return tuple(int(v) for v in values)


def check_array(
    name: str,
    value,
    *,
    ndim: int | None = None,
    integer: bool = False,
    lo: float | None = None,
    nonempty: bool = True,
) -> np.ndarray:
    """A concrete (numpy) array of numbers as int64 (integer=True) or float64: every value finite
    and >= lo.

    TypeError for what is not an array of real numbers (bools, strings, objects, complex; floats
    where integers are expected); ValueError for a wrong ndim, an empty array (unless
    nonempty=False), NaN or infinity, or a value below lo.
    """
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError):  # ragged nesting, or a traced value
        raise TypeError(f"{name} must be an array of numbers, got {short(value)}") from None
    kinds = "iu" if integer else "iuf"
    if arr.dtype.kind not in kinds and arr.size:  # np.asarray([]) is float64
        want = "integers" if integer else "real numbers"
        raise TypeError(f"{name} must hold {want}, got dtype {arr.dtype}: {short(value)}")
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {arr.shape}")
    if nonempty and arr.size == 0:
        raise ValueError(f"{name} must not be empty, got shape {arr.shape}")
    arr = arr.astype(np.int64 if integer else np.float64)
    if not integer and not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite (no NaN or infinity), got {short(value)}")
    if lo is not None and np.any(arr < lo):
        raise ValueError(f"{name} must be >= {lo:g} everywhere, got {short(value)}")
    return arr


def check_output_path(name: str, path) -> str:
    """path as a str, when a file can be written there: its nearest existing ancestor is a
    writable directory and the path is not a directory. Missing parent directories are allowed
    (the writers create them). Checked before any work, so a bad path fails in a second, not
    after a sweep or a training run."""
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"{name} must be a file path, got {short(path)}")
    path = os.fspath(path)
    if not path:
        raise ValueError(f"{name} must be a file path, got ''")
    if os.path.isdir(path):
        raise ValueError(f"{name}={path!r} is a directory, not a file path")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"{name}={path!r} cannot be created: {parent!r} is a file")
    target = path if os.path.exists(path) else parent
    if not os.access(target, os.W_OK | (os.X_OK if target == parent else 0)):
        raise ValueError(f"{name}={path!r} is not writable (no write permission on {target!r})")
    return path


def output_path_arg(text: str) -> str:
    """argparse `type=` for an output path flag: '' (skip the output) or a path that
    check_output_path accepts, so a bad path fails at parse time with argparse's one-line usage
    error (exit 2) before anything is computed."""
    if text == "":
        return text
    try:
        return check_output_path("path", text)
    except (TypeError, ValueError) as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("path=")) from None


def make_parent_dirs(path: str) -> None:
    """Creates the directories above the file `path` (see check_output_path)."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)


def run_command(main: Callable[[], object], prog: str) -> None:
    """Runs a command line's `main()`; a bad value (a ValueError, which names it) ends the command
    with one line, `<prog>: error: <message>`, and exit status 1, without a traceback."""
    try:
        main()
    except ValueError as e:
        sys.exit(f"{prog}: error: {e}")

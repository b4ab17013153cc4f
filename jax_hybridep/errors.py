"""Errors the ops raise at run time, worded identically by every backend."""

from __future__ import annotations

from collections.abc import Sequence


class StrictModeError(RuntimeError):
    """A dispatch in strict mode dropped rows over capacity or saw invalid expert ids."""


def strict_mode_message(
    group: int, dropped_per_rank: Sequence[int], invalid_per_rank: Sequence[int]
) -> str:
    """The strict-mode error text; xla_ffi/ffi_support.h (StrictCheck) writes the same words."""
    dropped = [int(v) for v in dropped_per_rank]
    invalid = [int(v) for v in invalid_per_rank]
    return (
        f"jax_hybridep strict mode: {sum(dropped)} row(s) dropped over capacity and "
        f"{sum(invalid)} invalid expert id(s) in EP group {group}; dropped per EP rank "
        f"[{', '.join(map(str, dropped))}], invalid per EP rank [{', '.join(map(str, invalid))}]"
    )


class TransportError(RuntimeError):
    """A GPU exchange failed on the device (a wait for a peer timed out)."""


def check_errors() -> None:
    """Raises TransportError if a GPU exchange of this process recorded an error.

    The CUDA transport never blocks the host: a kernel whose wait for a peer times out records the
    failure in mapped host memory and exits. The next exchange on that window fails with the
    message; this reports it without running one (e.g. after `block_until_ready`). No-op without
    CUDA.
    """
    from jax_hybridep import _native  # noqa: PLC0415

    native = _native._hybridep
    if native is None or not native.with_cuda:
        return
    message = native.cuda_window_error()
    if message:
        raise TransportError(message)

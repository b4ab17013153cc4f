"""Errors the ops raise at run time, worded identically by every backend, and where they are kept.

JAX does not carry an exception's type out of a compiled call: a handler's or callback's failure
surfaces as `jax.errors.JaxRuntimeError`. So every such failure is also recorded (host handlers in
the native module's log, xla_ffi/common/error_log.h; the xla backend's strict check here), and
`check_errors()` raises it with its own type and message. `typed_errors()` does that for a block
of code: a JaxRuntimeError inside it that the library recorded comes out as StrictModeError or
TransportError.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence


class StrictModeError(RuntimeError):
    """A dispatch in strict mode dropped rows over capacity or saw invalid expert ids."""


class TransportError(RuntimeError):
    """An exchange failed at run time: a GPU wait for a peer timed out, or the ranks of a CPU
    exchange (the host handlers' rendezvous) did not all arrive within the timeout (the message
    names the missing ranks)."""


def strict_mode_message(
    group: int, dropped_per_rank: Sequence[int], invalid_per_rank: Sequence[int]
) -> str:
    """The strict-mode error text; StrictCheck (xla_ffi/common/ffi_support.h) writes the same
    words."""
    dropped = [int(v) for v in dropped_per_rank]
    invalid = [int(v) for v in invalid_per_rank]
    return (
        f"jax_hybridep strict mode: {sum(dropped)} row(s) dropped over capacity and "
        f"{sum(invalid)} invalid expert id(s) in EP group {group}; dropped per EP rank "
        f"[{', '.join(map(str, dropped))}], invalid per EP rank [{', '.join(map(str, invalid))}]"
    )


# Failures recorded on the Python side (the xla backend's strict check runs in a Python callback,
# once per device), kept once per message and bounded like the native log.
_MAX_RECORDED = 16
_lock = threading.Lock()
_recorded: list[RuntimeError] = []


def record(error: RuntimeError) -> None:
    """Keeps `error` for check_errors() (once per type and message)."""
    with _lock:
        seen = any(type(e) is type(error) and str(e) == str(error) for e in _recorded)
        if not seen and len(_recorded) < _MAX_RECORDED:
            _recorded.append(error)


def _take_recorded() -> list[RuntimeError]:
    """Every recorded failure, Python-side first, then the native log's; both are emptied."""
    from jax_hybridep import _native  # noqa: PLC0415  (errors is imported before the module)

    with _lock:
        errors = list(_recorded)
        _recorded.clear()
    native = _native._hybridep
    if native is not None:
        kinds = {"strict_mode": StrictModeError, "transport": TransportError}
        for kind, message in native.take_recorded_errors():
            error = kinds[kind](message)
            if not any(type(e) is type(error) and str(e) == message for e in errors):
                errors.append(error)
        if native.with_cuda:
            message = native.cuda_window_error()
            if message:
                errors.append(TransportError(message))
    return errors


def check_errors() -> None:
    """Raises the first failure the ops recorded since the last call (StrictModeError or
    TransportError, with the message the failing call returned); then nothing is recorded.

    The CUDA transport never blocks a CPU thread: a kernel whose wait for a peer times out
    records the failure in pinned CPU memory mapped into the GPU's address space and exits, and
    the next exchange on that window fails with the message; this reports it without running
    one (e.g. after `block_until_ready`).
    """
    errors = _take_recorded()
    if errors:
        raise errors[0]


@contextlib.contextmanager
def typed_errors():
    """Re-raises a `jax.errors.JaxRuntimeError` from inside the block as the library's own error
    (StrictModeError, TransportError) when the library recorded one, chained to the original.

        with hep.typed_errors():
            out = jax.block_until_ready(step(x))
    """
    import jax  # noqa: PLC0415

    try:
        yield
    except jax.errors.JaxRuntimeError as err:
        errors = _take_recorded()
        if errors:
            raise errors[0] from err
        raise

"""Loads the native module `_hybridep` and registers its XLA FFI targets once, at import.

`_hybridep` is the production module: handler registrations and the few runtime services the
package needs. The native test hooks are the laboratory's (`lab/native_module.py`), never
imported from here.
"""

from __future__ import annotations

import atexit
import functools

import jax

from jax_hybridep import compat

try:
    from jax_hybridep import _hybridep
except ImportError as err:  # a source checkout that was never built
    _hybridep = None
    IMPORT_ERROR: ImportError | None = err
else:
    IMPORT_ERROR = None
    for _name, _capsule in _hybridep.cpu_registrations().items():
        jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")
    if _hybridep.with_cuda:
        # Registered whether or not a GPU is present: XLA keeps them until a CUDA backend starts.
        # The handlers' per-site state (owned by each executable) has its type registered first.
        for _name, _registration in _hybridep.cuda_state_type_registrations().items():
            compat.register_ffi_state_type(_name, _registration, platform="CUDA")
        for _name, _stages in _hybridep.cuda_registrations().items():
            jax.ffi.register_ffi_target(_name, _stages, platform="CUDA")
        # Window handles of EP groups that span processes travel through jax.distributed.
        _hybridep.set_kv_exchange(compat.kv_exchange)
        # Registered windows are freed before the interpreter (and the CUDA runtime) goes away.
        atexit.register(_hybridep.release_cuda_windows)

_BUILD_HINT = "Build it with `pip install -e .` (see README)"


def available() -> bool:
    """Whether the native module is built and its host handlers are registered."""
    return _hybridep is not None


def platforms() -> tuple[str, ...]:
    """JAX platforms the built module has ffi handlers for."""
    if _hybridep is None:
        return ()
    return ("cpu", "gpu") if _hybridep.with_cuda else ("cpu",)


def module():
    """The native module; raises ImportError with the build hint when it is missing."""
    if _hybridep is None:
        raise ImportError(
            "jax_hybridep was installed without its native module (_hybridep); the 'ffi' backend "
            f"needs it. {_BUILD_HINT}, or use backend='xla'. Import error: {IMPORT_ERROR}"
        )
    return _hybridep


@functools.cache
def limits() -> dict:
    """The kernels' limits as the native module states them (xla_ffi/common/limits.h,
    kernels/send_plan.h): max_send_blocks, max_top_k, max_window_ranks, send_chunk (items per
    send chunk; the slot maps are padded to it), shared_budget (the send kernel's dynamic shared
    memory). Python asks for them rather than copying them."""
    return dict(module().limits())

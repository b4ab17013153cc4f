"""Loads the native module `_hybridep` and registers its XLA FFI targets once, at import."""

from __future__ import annotations

import atexit

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
        for _name, _capsule in _hybridep.cuda_registrations().items():
            jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")
        # Window handles of EP groups that span processes travel through jax.distributed.
        _hybridep.set_kv_exchange(compat.kv_exchange)
        # Registered windows are freed before the interpreter (and the CUDA runtime) goes away.
        atexit.register(_hybridep.release_cuda_windows)


def available() -> bool:
    """Whether the native module is built and its host handlers are registered."""
    return _hybridep is not None


def platforms() -> tuple[str, ...]:
    """JAX platforms the built module has ffi handlers for."""
    if _hybridep is None:
        return ()
    return ("cpu", "gpu") if _hybridep.with_cuda else ("cpu",)


def has_cuda_v2() -> bool:
    """Whether the built module has CUDA transport v2 (CMake JAX_HYBRIDEP_CUDA_V2)."""
    return _hybridep is not None and bool(getattr(_hybridep, "with_cuda_v2", False))


def module():
    """The native module; raises ImportError with the build hint when it is missing."""
    if _hybridep is None:
        raise ImportError(
            "jax_hybridep was installed without its native module (_hybridep); the 'ffi' backend "
            "needs it. Build it with `pip install -e .` (see README), or use backend='xla'. "
            f"Import error: {IMPORT_ERROR}"
        )
    return _hybridep

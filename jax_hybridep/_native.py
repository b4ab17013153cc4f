"""Loads the native module `_hybridep` and registers its XLA FFI targets once, at import."""

from __future__ import annotations

import jax

try:
    from jax_hybridep import _hybridep
except ImportError as err:  # a source checkout that was never built
    _hybridep = None
    IMPORT_ERROR: ImportError | None = err
else:
    IMPORT_ERROR = None
    for _name, _capsule in _hybridep.cpu_registrations().items():
        jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")


def available() -> bool:
    """Whether the native module is built and its host handlers are registered."""
    return _hybridep is not None


def module():
    """The native module; raises ImportError with the build hint when it is missing."""
    if _hybridep is None:
        raise ImportError(
            "jax_hybridep was installed without its native module (_hybridep); the 'ffi' backend "
            "needs it. Build it with `pip install -e .` (see README), or use backend='xla'. "
            f"Import error: {IMPORT_ERROR}"
        )
    return _hybridep

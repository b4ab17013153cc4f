"""The laboratory's native test module, `_hybridep_testing` (lab/native/): self-tests, references,
the virtual-rank harness, benchmark hooks and the introspection the tests read.

Built only by the developer install (`scripts/setup.sh`, CMake option `JAX_HYBRIDEP_TESTING=ON`)
and installed outside the package, at the top of site-packages, on the package's own runtime
library (so it sees the handlers' process-wide state). Tests, scripts and benchmarks take it from
`testing_module()`; the package never does.
"""

from __future__ import annotations

import functools

import jax

from jax_hybridep import _native, compat

_SETUP_HINT = (
    "It is built by the developer install only: `bash scripts/setup.sh` (pip install -e . with "
    "JAX_HYBRIDEP_TESTING=ON)"
)


@functools.cache
def testing_module():
    """The test module, its CPU probe handlers registered on first use; ImportError when missing."""
    _native.module()  # the package's build hint when nothing native was built
    try:
        import _hybridep_testing  # noqa: PLC0415  (built only by the developer install)
    except ImportError as err:
        raise ImportError(
            f"jax_hybridep's test module (_hybridep_testing) is missing. {_SETUP_HINT}. "
            f"Import error: {err}"
        ) from err
    for name, registration in _hybridep_testing.cpu_state_type_registrations().items():
        compat.register_ffi_state_type(name, registration, platform="cpu")
    for name, handler in _hybridep_testing.cpu_registrations().items():
        jax.ffi.register_ffi_target(name, handler, platform="cpu")
    return _hybridep_testing

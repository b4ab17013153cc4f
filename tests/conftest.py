"""Test setup: 16 fake CPU devices (set before jax initialises its backends).

The suite compiles hundreds of small programs, and LLVM's optimisation of the generated code is
about a third of the CPU time; nothing the tests check depends on it (values, bits, HLO), so it
is off here (`--xla_backend_optimization_level=0`; benchmarks and the examples keep the default).
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=16 --xla_backend_optimization_level=0"
).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 16)

import pytest  # noqa: E402
from harness import BACKENDS  # noqa: E402

from jax_hybridep import _native  # noqa: E402
from lab import native_module  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_error_log():
    """Each test starts with no recorded failures (hep.check_errors() raises recorded ones)."""
    import jax_hybridep as hep

    try:
        hep.check_errors()  # takes every recorded failure at once
    except (hep.StrictModeError, hep.TransportError):
        pass


@pytest.fixture(scope="module", autouse=True)
def _fresh_compilation_caches():
    """Each test file's compiled programs dropped after it: every XLA:CPU executable holds a few
    memory mappings, and one process running the whole suite must stay below the kernel's
    vm.max_map_count (65530), past which LLVM cannot map the next program's code and aborts."""
    yield
    jax.clear_caches()


@pytest.fixture(autouse=True)
def _release_host_executor():
    """After a test that ran the host executor, its run's threads, stacks and memory freed."""
    yield
    helpers = sys.modules.get("host_executor_helpers")
    if helpers is not None:
        helpers.release()


@pytest.fixture
def no_backend_override(monkeypatch):
    """JAX_HYBRIDEP_BACKEND unset: the env var would override the examples' --backend (and make
    a comparison of backends vacuous)."""
    monkeypatch.delenv("JAX_HYBRIDEP_BACKEND", raising=False)


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Each dispatch/combine backend in turn."""
    return request.param


def pytest_collection_modifyitems(config, items):
    # An installed package without its native module must fail loudly, not skip the ffi tests.
    if not _native.available():
        raise pytest.UsageError(f"jax_hybridep native module not built: {_native.IMPORT_ERROR}")


REQUIRE_GPU = os.environ.get("JAX_HYBRIDEP_REQUIRE_GPU") == "1"


def no_gpu_reason() -> str | None:
    """Why the CUDA kernels cannot run here, or None."""
    if not _native.module().with_cuda:
        return "jax_hybridep was built without CUDA (with_cuda is False)"
    if native_module.testing_module().cuda_device_count() == 0:
        return "no CUDA device visible (no GPU or no driver)"
    return None


def _skip_or_fail(reason: str):
    if REQUIRE_GPU:
        pytest.fail(f"JAX_HYBRIDEP_REQUIRE_GPU=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture
def gpu():
    """Skips (or, with JAX_HYBRIDEP_REQUIRE_GPU=1, fails) unless the CUDA kernels can run."""
    reason = no_gpu_reason()
    if reason is not None:
        _skip_or_fail(reason)


@pytest.fixture
def cuda_build():
    """Skips unless the self-test hooks exist (the references need no GPU)."""
    if not _native.module().with_cuda:
        _skip_or_fail("jax_hybridep was built without CUDA (with_cuda is False)")

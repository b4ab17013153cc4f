"""Test setup: 16 fake CPU devices (set before jax initialises its backends)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=16"
).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 16)

import pytest  # noqa: E402

from jax_hybridep import _native  # noqa: E402

BACKENDS = ("xla", "ffi")


def pytest_collection_modifyitems(config, items):
    # An installed package without its native module must fail loudly, not skip the ffi tests.
    if not _native.available():
        raise pytest.UsageError(f"jax_hybridep native module not built: {_native.IMPORT_ERROR}")

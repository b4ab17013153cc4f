"""The CUDA handlers' per-site state is owned by the executable (xla_ffi/cuda/site_state.h).

XLA's stateful FFI makes one SiteState per CUDA custom call of an executable (the instantiate
stage) and deletes it with the executable, so retracing a model never accumulates state (the
process-wide map keyed by a trace-time counter it replaces grew with every trace). Without a GPU
the same SiteState type runs through XLA:CPU: the test module's probe handler instantiates it as
the CUDA handlers do and reports how many are alive. The real handlers' states are counted the
same way on a GPU (tests/gpu_worker.py, `site_states`).
"""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lab import native_module

PROBE = "jax_hybridep_testing_site_state"


@pytest.fixture
def testing(cuda_build):
    return native_module.testing_module()


def _probe(tag: int):
    """One stateful call site: [states alive, executions of this site's state so far]."""
    out = jax.ShapeDtypeStruct((2,), jnp.int32)
    return jax.ffi.ffi_call(PROBE, out, has_side_effect=True)(tag=np.int64(tag))


def _program(x):
    return x * 2, _probe(0), _probe(1)


def test_one_state_per_call_site_kept_by_the_executable(testing):
    """Compiling instantiates one state per call site; every execution of that executable finds
    the same state; deleting the executable deletes them. (A fresh function: JAX's caches keep an
    executable as long as the function it was traced from.)"""
    base = testing.live_site_states()
    x = np.zeros(3, np.float32)
    fn = jax.jit(lambda x: _program(x))  # noqa: PLW0108
    compiled = fn.lower(x).compile()
    assert testing.live_site_states() == base + 2
    first, second = compiled(x), compiled(x)
    assert np.asarray(first[1]).tolist() == [base + 2, 1]
    assert np.asarray(second[1]).tolist() == [base + 2, 2]  # the same state, executed again
    assert np.asarray(second[2]).tolist() == [base + 2, 2]
    del fn, compiled, first, second
    gc.collect()
    assert testing.live_site_states() == base


def test_retracing_does_not_grow_live_state(testing):
    """Re-jitting every step (a new trace and new call sites each time, as a model retraced for a
    new shape or config): the states of the programs that are gone are gone."""
    base = testing.live_site_states()
    alive = []
    for step in range(5):
        fn = jax.jit(lambda x: _program(x))  # noqa: PLW0108  (a new function: a new trace)
        jax.block_until_ready(fn(np.zeros(step + 1, np.float32)))
        alive.append(testing.live_site_states() - base)
        del fn
        gc.collect(0)  # the program's objects die by reference counting; a cheap sweep of strays
    assert alive == [2] * 5  # only the current program's two call sites, never more
    assert testing.live_site_states() == base

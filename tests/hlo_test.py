"""The compiled program proves which backend ran: FFI custom calls or XLA collectives only."""

import re

import jax
import numpy as np
import pytest
from harness import make_mesh, moe_fn

import jax_hybridep as hep

FFI_TARGETS = {"jax_hybridep_layout", "jax_hybridep_dispatch", "jax_hybridep_combine"}
# Weighted combine's VJP writes the rows' gradient and the routing weights' in one call.
BACKWARD_TARGETS = {"jax_hybridep_return_row_values", "jax_hybridep_combine_vjp"}


def _compiled_targets(backend, *, grad=False):
    mesh = make_mesh((4,), ("ep",))
    topo = hep.Topology.from_mesh(mesh, ("ep",))
    step = moe_fn(mesh, topo, hep.DispatchConfig(num_experts=8, backend=backend))
    args = (
        np.ones((16, 4), np.float32),
        np.zeros((16, 2), np.int32),
        np.ones((16, 2), np.float32),
        np.ones((8, 4, 4), np.float32),
    )
    fn = step
    if grad:
        fn = jax.jit(jax.grad(lambda x, i, w, e: step(x, i, w, e)[0].sum(), argnums=(0, 2)))
    text = fn.lower(*args).compile().as_text()
    return set(re.findall(r'custom_call_target="(jax_hybridep_\w+)"', text)), text


def test_ffi_backend_runs_custom_calls():
    targets, _ = _compiled_targets("ffi")
    assert targets == FFI_TARGETS
    targets, _ = _compiled_targets("ffi", grad=True)
    assert targets == FFI_TARGETS | BACKWARD_TARGETS


def test_xla_backend_runs_collectives_only():
    targets, text = _compiled_targets("xla", grad=True)
    assert targets == set()
    assert "all-to-all" in text and "all-gather" in text


def test_auto_picks_ffi_on_cpu_and_the_env_var_overrides(monkeypatch):
    assert _compiled_targets("auto")[0] == FFI_TARGETS
    monkeypatch.setenv("JAX_HYBRIDEP_BACKEND", "xla")
    assert _compiled_targets("auto")[0] == set()
    assert _compiled_targets("ffi")[0] == set()
    monkeypatch.setenv("JAX_HYBRIDEP_BACKEND", "bogus")
    with pytest.raises(ValueError, match="JAX_HYBRIDEP_BACKEND='bogus'"):
        _compiled_targets("auto")

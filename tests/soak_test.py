"""Soak tests: long runs leave nothing behind (process memory, the host rendezvous's state).

* A few hundred training-like steps (dispatch -> experts -> combine and its VJP) of fresh random
  routings at fixed shapes through each backend: the process's resident memory must not grow
  with the step count once warm.
* A retrace loop (new shapes each time, so new call sites; a scan inside, so several generations
  per call site): the host rendezvous keeps per-call-site state only while an exchange is in
  flight, so its state count is back where it started, however many programs ran.
* An exchange that times out (a rank never arrives) leaves no per-call-site state either.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import BACKENDS, all_axes_spec, local_experts, make_mesh, moe_fn, random_routing
from jax.sharding import PartitionSpec as P

import jax_hybridep as hep
from jax_hybridep import compat
from lab import native_module

WARMUP, STEPS = 50, 400
# Resident memory may move a little while allocator arenas settle (~3 MiB over 500 steps on the
# xla backend, measured); the bound catches any leak of >= 28 KiB per step over the 300 steps
# between the first and last quarter, e.g. one step's receive buffers (8 x 256 rows x 32 x 4 B).
GROWTH_BOUND = 8 << 20


def _rss() -> int:
    """Resident set size of this process in bytes (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
@pytest.mark.parametrize("backend", BACKENDS)
def test_random_routings_at_fixed_shapes_do_not_grow_memory(backend):
    R, T, H, K, num_experts = 8, 16, 32, 2, 16
    mesh = make_mesh((2, 4), ("node", "local"))
    topo = hep.Topology.from_mesh(mesh, ("node", "local"))
    fn = moe_fn(mesh, topo, hep.DispatchConfig(num_experts=num_experts, backend=backend))

    def loss(x, idx, w, experts):
        return jnp.sum(fn(x, idx, w, experts)[0] ** 2)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 2, 3)))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(R * T, H)).astype(np.float32)
    experts = (rng.normal(size=(num_experts, H, H)) / np.sqrt(H)).astype(np.float32)
    rss = []
    for i in range(WARMUP + STEPS):
        idx, w = random_routing(rng, R * T, K, num_experts, invalid_fraction=0.05)
        value, grads = step(x, idx, w, experts)
        jax.block_until_ready(grads)
        assert np.isfinite(float(value))
        if i >= WARMUP:
            rss.append(_rss())
    quarter = STEPS // 4
    early, late = np.median(rss[:quarter]), np.median(rss[-quarter:])
    assert late - early < GROWTH_BOUND, (
        f"{backend}: resident memory grew by {(late - early) / 2**20:.1f} MiB over "
        f"{STEPS - quarter} steps ({early / 2**20:.1f} -> {late / 2**20:.1f} MiB)"
    )
    assert native_module.testing_module().open_exchange_count() == 0


@pytest.mark.slow
def test_retracing_leaves_no_per_call_site_state():
    R, H, num_experts, layers = 4, 8, 8, 2
    mesh = make_mesh((R,), ("ep",))
    topo = hep.Topology.from_mesh(mesh, ("ep",))
    cfg = hep.DispatchConfig(num_experts=num_experts, backend="ffi")
    spec = all_axes_spec(mesh)
    native = native_module.testing_module()
    before = native.call_site_state_count()
    rng = np.random.default_rng(1)
    for tokens in range(1, 13):  # a new shape, so a new trace and new call sites, each time

        def layer(h, per_layer):
            idx, w, experts = per_layer
            d = hep.dispatch(h, idx, w, topology=topo, config=cfg)
            y = local_experts(d.tokens, d.group_sizes, experts)
            return h + hep.combine(y, d.handle, weights=d.weights), None

        def body(x, idx, w, experts):
            return jax.lax.scan(layer, x, (idx, w, experts))[0]

        fn = jax.jit(
            jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(spec, P(None, "ep"), P(None, "ep"), P(None, "ep")),
                out_specs=spec,
            )
        )
        n = R * tokens
        routings = [random_routing(rng, n, 2, num_experts) for _ in range(layers)]
        idx = np.stack([r[0] for r in routings])
        w = np.stack([r[1] for r in routings])
        x = rng.normal(size=(n, H)).astype(np.float32)
        experts = rng.normal(size=(layers, num_experts, H, H)).astype(np.float32) / np.sqrt(H)
        for _ in range(2):  # two executions of each program: the state of each goes too
            out = jax.block_until_ready(fn(x, idx, w, experts))
            assert np.all(np.isfinite(out))
        assert native.open_exchange_count() == 0
        assert native.call_site_state_count() <= before, (
            f"after {tokens} programs the host rendezvous holds "
            f"{native.call_site_state_count()} per-call-site counters (started with {before})"
        )


def test_a_timed_out_exchange_leaves_no_per_call_site_state():
    """The ranks that arrived at an exchange that timed out keep no counters for its call site."""
    R = 4
    mesh = make_mesh((R,), ("ep",))
    topo = hep.Topology.from_mesh(mesh, ("ep",))
    cfg = hep.DispatchConfig(num_experts=8, backend="ffi", timeout_s=1.0)
    native = native_module.testing_module()
    before = native.call_site_state_count()

    def rank0_skips(x, idx, w):  # rank 0 never reaches the exchange; the others wait for it
        tokens = lambda: hep.dispatch(x, idx, w, topology=topo, config=cfg).tokens  # noqa: E731
        shape = jax.eval_shape(tokens)
        skipped = lambda: compat.mark_varying(jnp.zeros(shape.shape, shape.dtype), ("ep",))  # noqa: E731
        return jax.lax.cond(jax.lax.axis_index("ep") == 0, skipped, tokens)

    spec = all_axes_spec(mesh)
    fn = jax.jit(jax.shard_map(rank0_skips, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
    x, idx, w = np.ones((R * 8, 4), np.float32), np.zeros((R * 8, 2), np.int32), np.ones((R * 8, 2))
    with pytest.raises(Exception, match=r"EP ranks \[0\] of 4 did not arrive"):
        jax.block_until_ready(fn(x, idx, w.astype(np.float32)))
    assert native.open_exchange_count() == 0
    assert native.call_site_state_count() <= before

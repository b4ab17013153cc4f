"""dispatch -> experts -> combine beyond the contract suite (tests/contract_test.py, which runs
every §2.1 case on every route kind): the VJP against finite differences, and several dispatches
per execution (scan) with rematerialisation, values and gradients against the dense MoE."""

import jax
import jax.numpy as jnp
import numpy as np
from harness import all_axes_spec, local_experts, make_mesh, moe_fn, random_routing
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jax_hybridep as hep
from jax_hybridep.reference import dense_moe

T, H, F, K = 6, 8, 4, 3


def _problem(seed, n, num_experts, k=K, hidden=H, invalid_fraction=0.1):
    rng = np.random.default_rng(seed)
    idx, w = random_routing(rng, n, k, num_experts, invalid_fraction)
    x = rng.normal(size=(n, hidden)).astype(np.float32)
    experts = (rng.normal(size=(num_experts, hidden, F)) / np.sqrt(hidden)).astype(np.float32)
    cot = rng.normal(size=(n, F)).astype(np.float32)
    return x, idx, w, experts, cot


def test_check_grads():
    """On the reference backend (the contract suite holds every other route to its bits)."""
    mesh = make_mesh((4,), ("ep",))
    topo = hep.Topology.from_mesh(mesh, ("ep",))
    fn = moe_fn(mesh, topo, hep.DispatchConfig(num_experts=8, backend="xla"))
    x, idx, w, experts, _ = _problem(3, 4 * T, 8)
    check_grads(
        lambda x, w, e: fn(x, idx, w, e)[0],
        (x, w, experts),
        order=1,
        modes=("rev",),
        atol=2e-2,
        rtol=2e-2,
        eps=1e-2,
    )


def test_inside_scan_and_checkpoint(backend):
    """Several dispatches per execution (scan) plus rematerialisation: values and gradients."""
    R, E, steps = 4, 8, 3
    mesh = make_mesh((R,), ("ep",))
    topo = hep.Topology.from_mesh(mesh, ("ep",))
    cfg = hep.DispatchConfig(num_experts=E, backend=backend)
    rng = np.random.default_rng(17)
    idx = np.stack([random_routing(rng, R * T, K, E)[0] for _ in range(steps)])
    x = rng.normal(size=(R * T, H)).astype(np.float32)
    w = rng.random((steps, R * T, K)).astype(np.float32)
    experts = (rng.normal(size=(steps, E, H, H)) / np.sqrt(H)).astype(np.float32)
    spec = all_axes_spec(mesh)
    sspec = P(None, "ep")

    @jax.checkpoint
    def layer(h, per_step):
        idx_s, w_s, experts_s = per_step
        d = hep.dispatch(h, idx_s, w_s, topology=topo, config=cfg)
        y = local_experts(d.tokens, d.group_sizes, experts_s)
        return jnp.tanh(hep.combine(y, d.handle, weights=d.weights)) + h, None

    def body(x, idx, w, experts):
        return jax.lax.scan(layer, x, (idx, w, experts))[0]

    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(spec, sspec, sspec, P(None, "ep")), out_specs=spec)
    )

    def dense(x, w, experts):
        for s in range(steps):
            x = jnp.tanh(dense_moe(x, idx[s], w[s], experts[s])) + x
        return x

    np.testing.assert_allclose(fn(x, idx, w, experts), dense(x, w, experts), rtol=1e-5, atol=1e-5)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(fn(a[0], idx, a[1], a[2]) ** 2), (0, 1, 2)))(
        x, w, experts
    )
    dense_grads = jax.jit(jax.grad(lambda *a: jnp.sum(dense(*a) ** 2), (0, 1, 2)))(x, w, experts)
    for g, ref in zip(grads, dense_grads, strict=True):
        np.testing.assert_allclose(g, ref, rtol=1e-4, atol=1e-4)

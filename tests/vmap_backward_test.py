"""The ops' backward mapped by `jax.vmap`: Jacobians (`jax.jacrev`, which maps the VJP over the
output's cotangents) and a VJP mapped over several cotangents work on both backends, equal a
dense MoE's and each other bit for bit; per-example gradients (`jax.vmap` of `jax.grad`, which
maps the forward) are refused on both with a ValueError that says what to do instead."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import BACKENDS, local_experts, make_mesh, random_routing
from jax.sharding import PartitionSpec as P

import jax_hybridep as hep

E, T, H, F, K = 8, 4, 4, 3, 2  # experts, tokens per rank, hidden, expert output, top-k
RANKS = 4


@pytest.fixture(scope="module")
def setup():
    mesh = make_mesh((RANKS,), ("ep",))
    topo = hep.Topology.from_mesh(mesh, ("ep",))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(RANKS * T, H)).astype(np.float32)
    idx, w = random_routing(rng, RANKS * T, K, E)
    experts = rng.normal(size=(E, H, F)).astype(np.float32)
    return mesh, topo, x, idx, w, experts


def moe(mesh, topo, backend, weighted):
    """shard_map'd dispatch -> one linear expert each -> combine, as f(x, w) of global arrays;
    `weighted`: combine weights the rows (else the rows are weighted before combine)."""
    cfg = hep.DispatchConfig(num_experts=E, backend=backend)

    def step(x, idx, w, experts):
        d = hep.dispatch(x, idx, w, topology=topo, config=cfg)
        y = local_experts(d.tokens, d.group_sizes, experts)
        if weighted:
            return hep.combine(y, d.handle, weights=d.weights)
        return hep.combine(y * d.weights[:, None], d.handle)

    spec = P("ep")
    mapped = jax.shard_map(step, mesh=mesh, in_specs=(spec, spec, spec, spec), out_specs=spec)
    return lambda x, idx, w, experts: mapped(x, idx, w, experts)


def dense(x, idx, w, experts):
    """The same layer without an exchange: sum_k w[t, k] * x[t] @ experts[idx[t, k]]."""
    return jnp.einsum("tk,th,tkhf->tf", w, x, experts[idx])


@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "unweighted"])
def test_jacobians_work_on_both_backends_and_agree(setup, weighted):
    mesh, topo, x, idx, w, experts = setup
    want_x = jax.jacrev(dense, argnums=0)(x, idx, w, experts)
    want_w = jax.jacrev(dense, argnums=2)(x, idx, w, experts)
    got = {}
    for backend in BACKENDS:
        f = moe(mesh, topo, backend, weighted)
        jac = jax.jit(jax.jacrev(f, argnums=(0, 2)))
        got[backend] = [np.asarray(j) for j in jac(x, idx, w, experts)]
        np.testing.assert_allclose(got[backend][0], want_x, rtol=1e-5, atol=1e-6, err_msg=backend)
        np.testing.assert_allclose(got[backend][1], want_w, rtol=1e-5, atol=1e-6, err_msg=backend)
    for a, b in zip(got["xla"], got["ffi"], strict=True):
        np.testing.assert_array_equal(a, b)


def test_jacobians_through_fp8_wire_and_fp8_rows(setup):
    """FP8 on the wire, rows delivered dequantised or as FP8 payload + scales: the Jacobian in
    topk_weights (the FP8 rows carry no gradient to x) equal on both backends bit for bit, and
    the FP8 rows' equal to the dequantised rows'."""
    mesh, topo, x, idx, w, experts = setup
    jacobians = {}
    for fp8_rows in (False, True):
        for backend in BACKENDS:
            cfg = hep.DispatchConfig(
                num_experts=E, backend=backend, wire_dtype="float8_e4m3fn", fp8_rows=fp8_rows
            )

            def step(x, idx, w, experts, cfg=cfg, fp8_rows=fp8_rows):
                d = hep.dispatch(x, idx, w, topology=topo, config=cfg)
                rows = d.tokens
                if fp8_rows:  # payload x its block's scale (H <= 128: one block)
                    rows = d.tokens.astype(jnp.float32) * d.scales[:, :1]
                y = local_experts(rows, d.group_sizes, experts)
                return hep.combine(y, d.handle, weights=d.weights)

            f = jax.shard_map(step, mesh=mesh, in_specs=(P("ep"),) * 4, out_specs=P("ep"))
            jac = jax.jit(jax.jacrev(f, argnums=2))(x, idx, w, experts)
            jacobians[fp8_rows, backend] = np.asarray(jac)
        np.testing.assert_array_equal(jacobians[fp8_rows, "xla"], jacobians[fp8_rows, "ffi"])
    np.testing.assert_array_equal(jacobians[True, "ffi"], jacobians[False, "ffi"])
    assert np.any(jacobians[True, "ffi"] != 0)


def test_a_vjp_mapped_over_cotangents_is_one_vjp_per_cotangent(setup):
    mesh, topo, x, idx, w, experts = setup
    cotangents = np.random.default_rng(1).normal(size=(3, RANKS * T, F)).astype(np.float32)
    for backend in BACKENDS:
        f = moe(mesh, topo, backend, weighted=True)

        def pullback(ct, f=f):
            _, vjp = jax.vjp(lambda x, w: f(x, idx, w, experts), x, w)
            return vjp(ct)

        mapped = jax.jit(jax.vmap(pullback))(cotangents)
        one_by_one = [jax.jit(pullback)(ct) for ct in cotangents]
        for i, single in enumerate(one_by_one):
            for got, want in zip(mapped, single, strict=True):
                np.testing.assert_array_equal(np.asarray(got)[i], np.asarray(want), err_msg=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_example_gradients_are_refused_naming_what_to_do(setup, backend):
    mesh, topo, x, idx, w, experts = setup
    f = moe(mesh, topo, backend, weighted=True)

    def loss(x1, idx1, w1):  # one example: tokens over every rank
        return jnp.sum(f(x1, idx1, w1, experts))

    per_example = jax.vmap(jax.grad(loss))  # two examples of the same routing
    with pytest.raises(ValueError, match="does not support jax.vmap.*fold the batch into T"):
        jax.jit(per_example)(np.stack([x, 2 * x]), np.stack([idx, idx]), np.stack([w, w]))

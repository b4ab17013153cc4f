"""dispatch -> experts -> combine against the dense einsum MoE: values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import (
    PlanView,
    all_axes_spec,
    expected_rows,
    local_experts,
    make_mesh,
    moe_fn,
    random_routing,
    reference_layout,
)
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


def _losses(fn, idx, cot):
    def loss(x, w, experts):
        return jnp.sum(fn(x, idx, w, experts)[0] * cot)

    def dense_loss(x, w, experts):
        return jnp.sum(dense_moe(x, idx, w, experts) * cot)

    return loss, dense_loss


def _assert_matches_dense(fn, x, idx, w, experts, cot):
    out, _ = fn(x, idx, w, experts)
    np.testing.assert_allclose(out, dense_moe(x, idx, w, experts), rtol=1e-5, atol=1e-5)
    loss, dense_loss = _losses(fn, idx, cot)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, experts)
    dense_grads = jax.jit(jax.grad(dense_loss, argnums=(0, 1, 2)))(x, w, experts)
    for name, g, ref in zip(("x", "topk_weights", "experts"), grads, dense_grads, strict=True):
        np.testing.assert_allclose(g, ref, rtol=1e-4, atol=1e-5, err_msg=f"gradient of {name}")


@pytest.mark.parametrize("ep", [1, 2, 4, 8, 16])
def test_values_and_gradients_match_dense(ep, backend):
    num_experts = 2 * ep if ep > 1 else 4
    mesh = make_mesh((ep,), ("ep",))
    topo = hep.Topology.from_mesh(mesh, ("ep",))
    fn = moe_fn(mesh, topo, hep.DispatchConfig(num_experts=num_experts, backend=backend))
    _assert_matches_dense(fn, *_problem(ep, ep * T, num_experts))


def test_check_grads(backend):
    mesh = make_mesh((4,), ("ep",))
    topo = hep.Topology.from_mesh(mesh, ("ep",))
    fn = moe_fn(mesh, topo, hep.DispatchConfig(num_experts=8, backend=backend))
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


def test_unweighted_combine_of_weighted_rows(backend):
    mesh = make_mesh((4,), ("ep",))
    topo = hep.Topology.from_mesh(mesh, ("ep",))
    cfg = hep.DispatchConfig(num_experts=8, backend=backend)
    fn = moe_fn(mesh, topo, cfg, weighted_combine=False)
    _assert_matches_dense(fn, *_problem(5, 4 * T, 8))


def test_ep_group_over_two_mesh_axes(backend):
    mesh = make_mesh((2, 4), ("x", "y"))
    topo = hep.Topology.from_mesh(mesh, (("x", "y"),))
    assert topo.ep_size == 8
    fn = moe_fn(mesh, topo, hep.DispatchConfig(num_experts=16, backend=backend))
    _assert_matches_dense(fn, *_problem(7, 8 * T, 16))


def test_two_ep_groups_beside_a_data_axis(backend):
    mesh = make_mesh((2, 4), ("data", "ep"))
    topo = hep.Topology.from_mesh(mesh, ("ep",))
    cfg = hep.DispatchConfig(num_experts=8, capacity_factor=1.0, backend=backend)
    fn = moe_fn(mesh, topo, cfg)
    x, idx, w, experts, _ = _problem(11, 8 * T, 8, invalid_fraction=0.0)
    # Skew group 1 so the groups' layouts differ (drops happen in group 1 only).
    idx[4 * T :, 0] = 0
    out, (tokens, weights, sizes, kept, stats) = fn(x, idx, w, experts)
    for g in range(2):
        shard = slice(g * 4 * T, (g + 1) * 4 * T)
        view = PlanView(8, 4, T, K, capacity_factor=1.0)
        ref = reference_layout(idx[shard].reshape(4, T, K), 4, view)
        ranks = slice(g * 4, (g + 1) * 4)
        np.testing.assert_array_equal(np.asarray(kept[ranks]), ref["row_pos"] >= 0)
        np.testing.assert_array_equal(stats.tokens_per_expert[g * 4], ref["tokens_per_expert"])
        np.testing.assert_array_equal(stats.dropped[ranks], ref["dropped"])
        np.testing.assert_array_equal(sizes[ranks], ref["group_sizes"])
        kept_g = ref["row_pos"].reshape(-1, K) >= 0
        np.testing.assert_allclose(
            out[shard],
            dense_moe(x[shard], idx[shard], w[shard], experts, kept=kept_g),
            rtol=1e-5,
            atol=1e-5,
        )
    assert int(np.sum(stats.dropped[4:])) > int(np.sum(stats.dropped[:4]))


@pytest.mark.parametrize(
    "capacity_factor,pad,placement",
    [
        (None, 1, None),
        (None, 4, None),
        (1.0, 1, None),
        (0.5, 2, None),
        (1.0, 1, "reversed"),
    ],
)
def test_rows_follow_the_contract(backend, capacity_factor, pad, placement):
    """tokens, weights, group_sizes, kept and stats equal an independent model of §2.1."""
    R, E = 4, 8
    if placement == "reversed":  # expert e on rank (E-1-e) % R, slot e // R: non-default
        placement = tuple(((E - 1 - e) % R, e // R) for e in range(E))
    mesh = make_mesh((R,), ("ep",))
    topo = hep.Topology.from_mesh(mesh, ("ep",))
    cfg = hep.DispatchConfig(
        num_experts=E,
        capacity_factor=capacity_factor,
        pad_multiple=pad,
        expert_placement=placement,
        backend=backend,
    )
    x, idx, w, experts, _ = _problem(13, R * T, E)
    idx[: T // 2, :] = 1  # duplicates and a hot expert
    fn = moe_fn(mesh, topo, cfg)
    out, (tokens, weights, sizes, kept, stats) = fn(x, idx, w, experts)
    view = PlanView(E, R, T, K, capacity_factor, pad, placement)
    ref = reference_layout(idx.reshape(R, T, K), R, view)
    exp_tokens, exp_weights = expected_rows(
        x.reshape(R, T, H), w.reshape(R, T, K), idx.reshape(R, T, K), ref, R, view.rows, np.float32
    )
    np.testing.assert_array_equal(np.asarray(tokens).reshape(exp_tokens.shape), exp_tokens)
    np.testing.assert_array_equal(np.asarray(weights).reshape(exp_weights.shape), exp_weights)
    np.testing.assert_array_equal(sizes, ref["group_sizes"])
    assert np.all(np.asarray(sizes) % pad == 0)
    np.testing.assert_array_equal(np.asarray(kept).reshape(R, T, K), ref["row_pos"] >= 0)
    np.testing.assert_array_equal(stats.dropped, ref["dropped"])
    np.testing.assert_array_equal(stats.invalid, ref["invalid"])
    for r in range(R):
        np.testing.assert_array_equal(stats.tokens_per_expert[r], ref["tokens_per_expert"])
    if placement is not None:
        # The reference MoE must see experts where the placement puts them.
        order = np.argsort(np.asarray(view.expert_rank) * view.num_slots + view.expert_slot)
        out, _ = moe_fn(mesh, topo, cfg)(x, idx, w, experts[order])
    kept_flat = ref["row_pos"].reshape(-1, K) >= 0
    np.testing.assert_allclose(
        out, dense_moe(x, idx, w, experts, kept=kept_flat), rtol=1e-5, atol=1e-5
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

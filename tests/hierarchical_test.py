"""Multi-level topologies: the same contract as flat EP, one copy per (token, destination group).

Rows, drops and group sizes must equal the flat case's exactly (intermediate levels are
dropless); outputs equal the dense MoE, and flat vs hierarchical combine agree to tolerance (the
partial sums are grouped differently, docs/design.md §2.1.4).
"""

import dataclasses
import functools

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import BACKENDS, make_mesh, moe_fn, random_routing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_hybridep as hep
from jax_hybridep import traffic
from jax_hybridep.reference import dense_moe

MESHES = {
    "node2_local4": ((2, 4), ("node", "local")),
    "node4_local2": ((4, 2), ("node", "local")),
    "dc2_node2_local2": ((2, 2, 2), ("dc", "node", "local")),
    "dc2_node2_local4": ((2, 2, 4), ("dc", "node", "local")),
}
T, H, F = 5, 8, 8


@functools.cache
def _fns(mesh_name, backend, num_experts, capacity_factor=None):
    """(hierarchical, flat) jitted MoE steps on the same mesh."""
    shape, names = MESHES[mesh_name]
    mesh = make_mesh(shape, names)
    cfg = hep.DispatchConfig(
        num_experts=num_experts, capacity_factor=capacity_factor, backend=backend
    )
    hier = hep.Topology.from_mesh(mesh, names)
    flat = hep.Topology.from_mesh(mesh, (names,))
    return moe_fn(mesh, hier, cfg), moe_fn(mesh, flat, cfg)


def _problem(seed, n, num_experts, k):
    rng = np.random.default_rng(seed)
    idx, w = random_routing(rng, n, k, num_experts, invalid_fraction=0.1)
    x = rng.normal(size=(n, H)).astype(np.float32)
    experts = (rng.normal(size=(num_experts, H, F)) / np.sqrt(H)).astype(np.float32)
    return x, idx, w, experts


def _check(mesh_name, backend, x, idx, w, experts, capacity_factor=None, grads=True):
    num_experts = experts.shape[0]
    hier, flat = _fns(mesh_name, backend, num_experts, capacity_factor)
    out, rows = hier(x, idx, w, experts)
    flat_out, flat_rows = flat(x, idx, w, experts)

    # Same rows, weights, group sizes, kept and counts as flat EP, exactly (only the per-level
    # traffic differs: that is the point).
    def contract(r):
        tokens, weights, sizes, kept, stats = r
        return tokens, weights, sizes, kept, stats.dropped, stats.invalid, stats.tokens_per_expert

    for a, b in zip(contract(rows), contract(flat_rows), strict=True):
        np.testing.assert_array_equal(a, b)
    kept = np.asarray(rows[3]).reshape(idx.shape)
    dense = dense_moe(x, idx, w, experts, kept=kept)
    np.testing.assert_allclose(out, dense, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out, flat_out, rtol=1e-5, atol=1e-6)
    if not grads:
        return out
    cot = np.random.default_rng(0).normal(size=out.shape).astype(np.float32)

    def loss(fn):
        return lambda x, w, e: jnp.sum(fn(x, idx, w, e)[0] * cot)

    def dense_loss(x, w, e):
        return jnp.sum(dense_moe(x, idx, w, e, kept=kept) * cot)

    got = jax.jit(jax.grad(loss(hier), argnums=(0, 1, 2)))(x, w, experts)
    want = jax.jit(jax.grad(dense_loss, argnums=(0, 1, 2)))(x, w, experts)
    for name, g, r in zip(("x", "topk_weights", "experts"), got, want, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5, err_msg=name)
    return out


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_values_and_gradients(mesh_name, backend, capacity_factor):
    shape, _ = MESHES[mesh_name]
    ep = int(np.prod(shape))
    num_experts = 2 * ep
    _check(
        mesh_name, backend, *_problem(ep, ep * T, num_experts, 4), capacity_factor=capacity_factor
    )


ADVERSARIAL = {
    "all_to_one_expert": lambda rng, n, k, e: np.full((n, k), e - 1, np.int32),
    "all_minus_one": lambda rng, n, k, e: np.full((n, k), -1, np.int32),
    "duplicates": lambda rng, n, k, e: np.repeat(rng.integers(0, e, (n, 1)), k, 1),
    "one_remote_node": lambda rng, n, k, e: rng.integers(e // 2, e, (n, k)).astype(np.int32),
}


@pytest.mark.parametrize("case", sorted(ADVERSARIAL))
def test_adversarial_routings(case):
    rng = np.random.default_rng(5)
    n, num_experts, k = 8 * T, 16, 3
    x, _, w, experts = _problem(5, n, num_experts, k)
    idx = ADVERSARIAL[case](rng, n, k, num_experts).astype(np.int32)
    outs = [_check("node2_local4", b, x, idx, w, experts) for b in BACKENDS]
    np.testing.assert_array_equal(_bits(outs[0]), _bits(outs[1]))


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), mesh_name=st.sampled_from(["node2_local4", "dc2_node2_local2"]))
def test_random_routings(data, mesh_name):
    n, num_experts, k = 8 * T, 16, 3
    idx = data.draw(hnp.arrays(np.int32, (n, k), elements=st.integers(-2, num_experts + 1)))
    x, _, w, experts = _problem(9, n, num_experts, k)
    outs = [_check(mesh_name, b, x, idx, w, experts, grads=False) for b in BACKENDS]
    np.testing.assert_array_equal(_bits(outs[0]), _bits(outs[1]))


@pytest.mark.parametrize("mesh_name", ["node2_local4", "dc2_node2_local4"])
def test_traffic_counts_one_copy_per_destination_group(mesh_name, backend):
    """Run-time level rows equal an independent count of (token, destination group) pairs and
    never exceed flat per-(token, rank) sending; the program's all-to-alls move exactly the
    padded per-level buffers."""
    shape, names = MESHES[mesh_name]
    ep = int(np.prod(shape))
    num_experts, k = 2 * ep, 4
    x, idx, w, experts = _problem(21, ep * T, num_experts, k)
    hier, flat = _fns(mesh_name, backend, num_experts)
    _, (_, _, _, kept, stats) = hier(x, idx, w, experts)
    topo = hep.Topology.from_mesh(make_mesh(shape, names), names)
    per_expert = num_experts // ep
    dest = np.where(np.asarray(kept).reshape(ep, T, k), idx.reshape(ep, T, k) // per_expert, -1)
    rows = np.asarray(stats.level_rows).sum(axis=0)
    np.testing.assert_array_equal(rows, traffic.routed_pairs(dest, topo))
    np.testing.assert_array_equal(
        traffic.level_bytes(rows, H, np.float32), traffic.routed_pairs(dest, topo) * H * 4
    )
    assert rows[0] <= traffic.flat_pairs(dest)
    _, (_, _, _, _, flat_stats) = flat(x, idx, w, experts)
    assert int(np.asarray(flat_stats.level_rows).sum()) == traffic.flat_pairs(dest)

    if backend == "ffi":
        return  # in one process every ffi level exchanges by direct write: no all-to-all to read
    hlo = hier.lower(x, idx, w, experts).compile().as_text()
    moved = {
        (groups, size) for kind, size, groups in traffic.all_to_all_bytes(hlo) if kind == "f32"
    }
    for level, size in zip(names, traffic.padded_level_bytes(topo, T, H, np.float32), strict=True):
        assert any(level in groups and n == size for groups, n in moved), (level, size, moved)


def _bits(a):
    a = np.asarray(a)
    if not jnp.issubdtype(a.dtype, jnp.floating):
        return a
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize(
    "mesh_name,cross_process",
    [
        ("node2_local4", None),
        ("dc2_node2_local2", None),
        # As a 2-process run would see it: "node" crosses processes (pack + XLA all-to-all, counts
        # all-gathered by XLA), "local" stays in-process (direct write).
        ("node2_local4", (False, True)),
    ],
)
def test_backends_agree_bitwise(mesh_name, cross_process, dtype):
    shape, names = MESHES[mesh_name]
    mesh = make_mesh(shape, names)
    topo = hep.Topology.from_mesh(mesh, names)
    if cross_process is not None:
        topo = dataclasses.replace(topo, single_process=False, level_local=cross_process)
    ep, num_experts, k = int(np.prod(shape)), 16, 3
    x, idx, w, experts = _problem(31, ep * T, num_experts, k)
    x, experts = jnp.asarray(x, dtype), jnp.asarray(experts, dtype)
    results = {}
    for backend in ("xla", "ffi"):
        fn = moe_fn(
            mesh,
            topo,
            hep.DispatchConfig(num_experts=num_experts, capacity_factor=1.0, backend=backend),
        )
        out, rows = fn(x, idx, w, experts)

        def loss(x, w, e, fn=fn):
            return jnp.sum(fn(x, idx, w, e)[0].astype(jnp.float32) ** 2)

        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, experts)
        results[backend] = [out, *jax.tree.leaves(rows), *grads]
        hlo = fn.lower(x, idx, w, experts).compile().as_text()
        assert ("jax_hybridep_" in hlo) == (backend == "ffi")
    for a, b in zip(results["xla"], results["ffi"], strict=True):
        np.testing.assert_array_equal(_bits(a), _bits(b))


def test_a_level_spanning_two_mesh_axes(backend):
    """Levels are groups of mesh axes: ("node", ("x", "y")) is two levels over three axes."""
    mesh = make_mesh((2, 2, 2), ("node", "x", "y"))
    topo = hep.Topology.from_mesh(mesh, ("node", ("x", "y")))
    assert topo.level_sizes == (2, 4) and topo.level_strides == (4, 1)
    x, idx, w, experts = _problem(41, 8 * T, 16, 3)
    fn = moe_fn(mesh, topo, hep.DispatchConfig(num_experts=16, backend=backend))
    out, (_, _, _, kept, stats) = fn(x, idx, w, experts)
    kept = np.asarray(kept).reshape(idx.shape)
    np.testing.assert_allclose(out, dense_moe(x, idx, w, experts, kept=kept), rtol=1e-5, atol=1e-5)
    assert np.asarray(stats.level_rows).shape == (8, 2)

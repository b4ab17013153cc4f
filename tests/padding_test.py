"""DispatchConfig(zero_padding=False): rows past sum(group_sizes) are unspecified and the ffi
backend does not write them; with the test switch JAX_HYBRIDEP_POISON_PADDING=1 they (and
combine's row cotangents there) hold NaN, so anything that reads them fails. Values and
gradients through consumers that use group_sizes must equal the zero-padded default, bitwise,
on 1-, 2- and 3-level meshes and in MoEBlock."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from harness import make_mesh, random_routing
from jax.sharding import PartitionSpec as P

import jax_hybridep as hep
from jax_hybridep import nn as hnn

MESHES = [((8,), ("ep",)), ((2, 4), ("node", "local")), ((2, 2, 2), ("dc", "node", "local"))]


def _grouped_experts(tokens, group_sizes, w_local):
    """Each row through its local expert, rows outside every group masked by a select first
    (NaN-safe forward and backward, as ragged_dot is)."""
    ends = jnp.cumsum(group_sizes)
    expert = jnp.searchsorted(ends, jnp.arange(tokens.shape[0]), side="right")
    in_group = (expert < w_local.shape[0])[:, None]
    rows = jnp.where(in_group, tokens, 0).astype(jnp.float32)
    expert = jnp.minimum(expert, w_local.shape[0] - 1)
    y = jnp.einsum("ch,chf->cf", rows, w_local[expert].astype(jnp.float32))
    return jnp.where(in_group, y, 0).astype(tokens.dtype)


def _run(shape, names, backend, zero_padding, capacity, pad):
    mesh = make_mesh(shape, names)
    topo = hep.Topology.from_mesh(mesh, names)
    n, T, H, K, E = mesh.size, 6, 8, 3, 2 * mesh.size
    rng = np.random.default_rng(11)
    idx, w = random_routing(rng, n * T, K, E, invalid_fraction=0.1)
    x = rng.standard_normal((n * T, H)).astype(np.float32)
    experts = (rng.standard_normal((E, H, H)) * 0.3).astype(np.float32)
    cfg = hep.DispatchConfig(num_experts=E, capacity_factor=capacity, pad_multiple=pad,
                             backend=backend, zero_padding=zero_padding)  # fmt: skip
    spec = P(tuple(mesh.axis_names))

    def layer(x, idx, w, experts):
        d = hep.dispatch(x, idx, w, topology=topo, config=cfg)
        y = _grouped_experts(d.tokens, d.group_sizes, experts)
        return hep.combine(y, d.handle, weights=d.weights)

    fn = jax.shard_map(layer, mesh=mesh, in_specs=(spec, spec, spec, P(topo.ep_axes)),
                       out_specs=spec)  # fmt: skip

    def loss(x, w, experts):
        out = fn(x, idx, w, experts)
        return jnp.sum(out**2), out

    # One program for values and gradients.
    (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(x, w, experts)
    return [np.asarray(a) for a in (out, *grads)]


@pytest.mark.parametrize("shape,names", MESHES)
@pytest.mark.parametrize("capacity,pad", [(None, 1), (None, 4), (1.0, 2)])
def test_poisoned_padding_changes_no_value_or_gradient(monkeypatch, backend, shape, names,
                                                       capacity, pad):  # fmt: skip
    want = _run(shape, names, backend, True, capacity, pad)
    monkeypatch.setenv("JAX_HYBRIDEP_POISON_PADDING", "1")
    got = _run(shape, names, backend, False, capacity, pad)
    for name, a, b in zip(("out", "grad x", "grad w", "grad experts"), got, want, strict=True):
        assert np.isfinite(a).all(), name
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32), err_msg=name)


def test_poison_reaches_the_rows_and_stays_out_of_the_groups(monkeypatch, backend):
    """The switch really puts NaN past the groups (and nowhere inside them)."""
    monkeypatch.setenv("JAX_HYBRIDEP_POISON_PADDING", "1")
    mesh = make_mesh((4,), ("ep",))
    topo = hep.Topology.from_mesh(mesh, ("ep",))
    cfg = hep.DispatchConfig(num_experts=8, pad_multiple=4, backend=backend, zero_padding=False)
    spec = P("ep")

    def fn(x, idx, w):
        d = hep.dispatch(x, idx, w, topology=topo, config=cfg)
        return d.tokens[None], d.group_sizes[None], d.weights[None]

    idx = np.tile(np.array([[0, 3]], np.int32), (16, 1))
    tokens, sizes, weights = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 3,
                                                   out_specs=spec))(
        np.ones((16, 4), np.float32), idx, np.ones((16, 2), np.float32))  # fmt: skip
    for r in range(4):
        end = int(sizes[r].sum())
        assert np.isfinite(tokens[r, :end]).all()
        assert np.isnan(tokens[r, end:]).all() and tokens.shape[1] > end
        assert np.all(weights[r, end:] == 0)


def test_poison_switch_is_validated(monkeypatch):
    monkeypatch.setenv("JAX_HYBRIDEP_POISON_PADDING", "yes")
    with pytest.raises(ValueError, match="JAX_HYBRIDEP_POISON_PADDING='yes'"):
        _ = hep.DispatchConfig(num_experts=8, zero_padding=False).poison_padding


@pytest.mark.parametrize("capacity", [None, 1.5])
def test_moe_block_ignores_poisoned_padding(monkeypatch, backend, capacity):
    """MoEBlock dispatches with zero_padding=False; its experts (ragged_dot, or the CPU capacity
    windows) never read the padding, so poisoning it changes no output or gradient bit."""
    mesh = make_mesh((2, 4), ("node", "local"))
    topo = hep.Topology.from_mesh(mesh, ("node", "local"))
    router = hnn.RouterConfig(num_experts=16, top_k=2)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((8, 8, 16)), jnp.float32)

    def run():
        block = hnn.MoEBlock(16, router=router, experts=hnn.ExpertConfig(d_ff=32), mesh=mesh,
                             topology=topo, rngs=nnx.Rngs(0),
                             dispatch=hep.DispatchConfig(num_experts=16, backend=backend,
                                                         capacity_factor=capacity))  # fmt: skip
        assert block.dispatch_config.zero_padding is False
        graph, params = nnx.split(block)

        def loss(params, x):
            y, aux = nnx.merge(graph, params)(x)
            return jnp.sum(y**2) + aux.loss

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)

    want = run()
    monkeypatch.setenv("JAX_HYBRIDEP_POISON_PADDING", "1")
    got = run()
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

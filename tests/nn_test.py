"""Flax layers: the router's rules, and the MoE block against a dense MoE (values, gradients)."""

import copy
import itertools
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from harness import make_mesh
from moe_helpers import block_params, dense_block

import jax_hybridep as hep
from jax_hybridep import nn as hnn
from jax_hybridep.nn.linen import MoEBlockLinen

D, F = 16, 24


# ----------------------------------------------------------------------------- router


def test_group_limited_topk_matches_brute_force():
    cfg = hnn.RouterConfig(num_experts=16, top_k=4, score_fn="sigmoid", num_groups=4, topk_groups=2)
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, 16)).astype(np.float32)
    bias = rng.normal(size=16).astype(np.float32) * 0.1
    out = hnn.route(jnp.asarray(logits), jnp.asarray(bias), cfg)
    scores = 1 / (1 + np.exp(-logits))
    sel = scores + bias
    for n in range(64):
        groups = sel[n].reshape(4, 4)
        group_score = np.sort(groups, axis=1)[:, -2:].sum(1)
        best = max(itertools.combinations(range(4), 2), key=lambda g: group_score[list(g)].sum())
        allowed = np.concatenate([np.arange(g * 4, g * 4 + 4) for g in best])
        want = allowed[np.argsort(-sel[n, allowed])[:4]]
        assert set(np.asarray(out.topk_idx[n])) == set(want)
        w = scores[n, np.asarray(out.topk_idx[n])]  # weights: raw scores, not bias-adjusted
        np.testing.assert_allclose(out.topk_weights[n], w / w.sum(), rtol=1e-6)


def test_plain_softmax_topk_and_losses():
    cfg = hnn.RouterConfig(num_experts=8, top_k=2, normalize=False, routed_scale=2.0)
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(32, 8)).astype(np.float32)
    out = hnn.route(jnp.asarray(logits), jnp.zeros(8), cfg)
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    idx = np.argsort(-probs, axis=1)[:, :2]
    np.testing.assert_array_equal(np.sort(out.topk_idx, 1), np.sort(idx, 1))
    np.testing.assert_allclose(
        out.topk_weights, 2.0 * np.take_along_axis(probs, np.asarray(out.topk_idx), 1), rtol=1e-6
    )
    load = np.bincount(idx.reshape(-1), minlength=8)
    np.testing.assert_array_equal(out.load, load)
    np.testing.assert_allclose(out.aux_loss, 8 * np.sum(load / 64 * probs.mean(0)), rtol=1e-5)
    lse = np.log(np.exp(logits).sum(1))
    np.testing.assert_allclose(out.z_loss, np.mean(lse**2), rtol=1e-5)


def test_bias_update_raises_underloaded_experts():
    router = hnn.Router(
        4, hnn.RouterConfig(num_experts=4, top_k=1, bias_update_rate=0.1), rngs=nnx.Rngs(0)
    )
    router.update_bias(jnp.array([10, 0, 5, 5]))
    np.testing.assert_allclose(router.bias[...], [-0.1, 0.1, 0.0, 0.0])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_experts=4, top_k=5), "top_k=5"),
        (dict(num_experts=8, top_k=2, num_groups=3, topk_groups=1), "not divisible"),
        (dict(num_experts=8, top_k=2, num_groups=4), "go together"),
        (dict(num_experts=8, top_k=4, num_groups=4, topk_groups=1), "cannot hold"),
        (dict(num_experts=8, top_k=2, score_fn="relu"), "score_fn"),
    ],
)
def test_router_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        hnn.RouterConfig(**kwargs)


# ----------------------------------------------------------------------------- MoE block


def _block(mesh_shape, names, levels, backend, capacity_factor, shared, top_k=2, experts=8):
    mesh = make_mesh(mesh_shape, names)
    topo = hep.Topology.from_mesh(mesh, levels)
    router = hnn.RouterConfig(
        num_experts=experts, top_k=top_k, aux_loss_coef=0.01, z_loss_coef=0.001
    )
    dispatch = hep.DispatchConfig(
        num_experts=experts, capacity_factor=capacity_factor, backend=backend
    )
    return hnn.MoEBlock(
        D,
        router=router,
        experts=hnn.ExpertConfig(d_ff=F, shared_ff=8 if shared else None),
        topology=topo,  # holds its mesh
        dispatch=dispatch,
        rngs=nnx.Rngs(0),
    )


def test_block_takes_its_mesh_from_the_topology():
    """The topology alone is enough; a mesh beside it is accepted when it is the topology's, or
    needed when the topology holds none; another mesh of the same shape is refused, naming both."""
    mesh = make_mesh((4,), ("ep",))
    topo = hep.Topology.from_mesh(mesh, ("ep",))
    router, experts = hnn.RouterConfig(num_experts=8, top_k=2), hnn.ExpertConfig(d_ff=F)

    def block(**kwargs):
        return hnn.MoEBlock(D, router=router, experts=experts, rngs=nnx.Rngs(0), **kwargs)

    alone = block(topology=topo)
    assert alone.mesh is mesh and alone.w_up.sharding.mesh == mesh
    np.testing.assert_array_equal(block(topology=topo, mesh=mesh).w_up[...], alone.w_up[...])
    reversed_mesh = jax.sharding.Mesh(mesh.devices[::-1], ("ep",), axis_types=mesh.axis_types)
    with pytest.raises(
        ValueError, match=r"another mesh .* devices \[0, 1, 2, 3\].* \[3, 2, 1, 0\]"
    ):
        block(topology=topo, mesh=reversed_mesh)
    bare = hep.Topology(("ep",), ("ep",), (4,))
    assert bare.mesh is None and bare == topo  # the mesh is not part of a topology's identity
    assert pickle.loads(pickle.dumps(topo)) == bare and copy.deepcopy(topo).mesh is mesh
    with pytest.raises(TypeError, match="the block needs a mesh"):
        block(topology=bare)
    assert block(topology=bare, mesh=reversed_mesh).mesh is reversed_mesh


@pytest.mark.parametrize(
    "mesh_shape,names,levels,capacity_factor,shared",
    [
        ((1,), ("ep",), ("ep",), None, False),
        ((8,), ("ep",), ("ep",), None, True),
        # CPU window path, two EP groups; with ffi this once deadlocked against the gradient
        # all-reduce over "data" (fixed by the non-blocking host exchange, rendezvous.h).
        ((2, 4), ("data", "ep"), ("ep",), 4.0, False),
        ((2, 2), ("x", "y"), (("x", "y"),), None, False),
        ((2, 2), ("node", "local"), ("node", "local"), 2.0, False),  # hierarchical topology
    ],
)
def test_block_matches_dense_moe(backend, mesh_shape, names, levels, capacity_factor, shared):
    block = _block(mesh_shape, names, levels, backend, capacity_factor, shared)
    x = jax.random.normal(jax.random.key(1), (4, 8, D))
    shared_w = None
    if shared:
        shared_w = (block.shared.gate[...], block.shared.up[...], block.shared.down[...])

    y, aux = nnx.jit(lambda b, x: b(x))(block, x)
    dense = jax.jit(lambda p, x: dense_block(p, x, block.router.config, shared_w))
    np.testing.assert_allclose(y, dense(block_params(block), x), rtol=1e-5, atol=1e-5)
    assert int(aux.dropped) == 0
    assert int(aux.tokens_per_expert.sum()) == 4 * 8 * 2
    cot = jax.random.normal(jax.random.key(2), x.shape)

    def loss(block, x):
        y, aux = block(x)
        return jnp.sum(y * cot) + aux.loss

    grads, grad_x = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(block, x)

    def dense_loss(params, x):
        # The block's router losses are means over shards of per-shard losses (each device's
        # tokens, as GShard/Switch compute them per group).
        shards = x.reshape(block.mesh.devices.size, -1, D)
        r = jax.vmap(lambda t: hnn.route(t @ params["gate"], params["bias"], block.router.config))(
            shards
        )
        aux = 0.01 * jnp.mean(r.aux_loss) + 0.001 * jnp.mean(r.z_loss)
        return jnp.sum(dense_block(params, x, block.router.config, shared_w) * cot) + aux

    ref, ref_x = jax.jit(jax.grad(dense_loss, argnums=(0, 1)))(block_params(block), x)
    np.testing.assert_allclose(grad_x, ref_x, rtol=1e-4, atol=1e-5)
    for name, got in [
        ("gate", grads.router.gate),
        ("w_gate", grads.w_gate),
        ("w_up", grads.w_up),
        ("w_down", grads.w_down),
    ]:
        np.testing.assert_allclose(got[...], ref[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_block_reports_drops_under_capacity():
    block = _block((8,), ("ep",), ("ep",), "ffi", 0.5, False)
    _, aux = nnx.jit(lambda b, x: b(x))(block, jax.random.normal(jax.random.key(3), (8, 8, D)))
    assert int(aux.dropped) > 0


@pytest.mark.parametrize("policy", ["dispatch", "combine"])
def test_remat_policy_by_checkpoint_name(policy):
    block = _block((4,), ("ep",), ("ep",), "ffi", None, False)
    name = hnn.DISPATCH_NAME if policy == "dispatch" else hnn.COMBINE_NAME
    x = jax.random.normal(jax.random.key(4), (4, 4, D))

    def loss(block, x, remat):
        call = lambda b, x: b(x)[0]  # noqa: E731
        if remat:
            call = nnx.remat(call, policy=jax.checkpoint_policies.save_only_these_names(name))
        return jnp.sum(call(block, x) ** 2)

    plain = nnx.jit(nnx.grad(lambda b, x: loss(b, x, False)))(block, x)
    remat = nnx.jit(nnx.grad(lambda b, x: loss(b, x, True)))(block, x)
    np.testing.assert_allclose(remat.w_up[...], plain.w_up[...], rtol=1e-6, atol=1e-7)


def test_linen_wrapper():
    mesh = make_mesh((4,), ("ep",))
    topo = hep.Topology.from_mesh(mesh, ("ep",))
    router = hnn.RouterConfig(num_experts=8, top_k=2)
    module = MoEBlockLinen(
        d_model=D, router=router, experts=hnn.ExpertConfig(d_ff=F), mesh=mesh, topology=topo
    )
    x = jax.random.normal(jax.random.key(5), (4, 4, D))
    variables = module.init(jax.random.key(0), x)
    y, aux = jax.jit(module.apply)(variables, x)
    p = variables["params"]
    unbox = lambda v: getattr(v, "value", v)  # noqa: E731
    params = dict(
        gate=unbox(p["router"]["gate"]),
        bias=unbox(variables["RouterBias"]["router"]["bias"]),
        w_gate=unbox(p["w_gate"]),
        w_up=unbox(p["w_up"]),
        w_down=unbox(p["w_down"]),
    )
    np.testing.assert_allclose(y, dense_block(params, x, router), rtol=1e-5, atol=1e-5)
    assert int(aux.tokens_per_expert.sum()) == 16 * 2

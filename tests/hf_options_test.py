"""Router and expert options the HF families need: group ranking by max, the Switch/GShard group
capacity (k-major fill, drops, renormalisation) against a plain numpy loop, every expert rule on
the CPU capacity-window path against the ragged one (values and gradients), and their checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from harness import make_mesh

import jax_hybridep as hep
from jax_hybridep import nn as hnn
from jax_hybridep import xdc


def test_groups_ranked_by_their_max_score():
    cfg = hnn.RouterConfig(
        num_experts=8, top_k=2, num_groups=8, topk_groups=3, group_score="max", normalize=False
    )
    logits = np.random.default_rng(0).normal(size=(32, 8)).astype(np.float32)
    out = hnn.route(jnp.asarray(logits), jnp.zeros(8), cfg)
    p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    # One expert per group: the best 3 groups hold the best 3 experts, and top-2 of those.
    np.testing.assert_array_equal(out.topk_idx, np.argsort(-p, axis=1)[:, :2])
    cfg = hnn.RouterConfig(num_experts=8, top_k=2, num_groups=4, topk_groups=2, group_score="max")
    out = hnn.route(jnp.asarray(logits), jnp.zeros(8), cfg)
    ranked_by_sum = 0
    for n in range(32):
        groups = np.argsort(-p[n].reshape(4, 2).max(1))[:2]  # the 2 groups with the best max
        by_sum = np.argsort(-p[n].reshape(4, 2).sum(1))[:2]
        ranked_by_sum += set(groups) != set(by_sum)
        allowed = np.concatenate([np.arange(2 * g, 2 * g + 2) for g in groups])
        want = allowed[np.argsort(-p[n, allowed])[:2]]
        np.testing.assert_array_equal(out.topk_idx[n], want)
    assert ranked_by_sum > 0  # the data tells the two rankings apart


def numpy_group_capacity(ids, weights, cap, group, renormalize):
    """Per group, k-major: (t, k) keeps its place if fewer than cap earlier entries (all of
    k' < k, then t' < t at k) chose the same expert."""
    ids, weights = ids.copy(), weights.copy()
    n, k = ids.shape
    for g0 in range(0, n, group):
        taken = {}
        for kk in range(k):
            for t in range(g0, g0 + group):
                e = ids[t, kk]
                taken[e] = taken.get(e, 0) + 1
                if taken[e] > cap:
                    ids[t, kk], weights[t, kk] = -1, 0.0
    if renormalize:
        weights = weights / (weights.sum(1, keepdims=True) + 1e-20)
    return ids, weights


@pytest.mark.parametrize("renormalize", [False, True])
def test_group_capacity_fills_k_major_and_drops_the_rest(renormalize):
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(48, 6)).astype(np.float32)
    logits[:, 0] += 1.5  # a hot expert, so drops happen at every k
    cfg = hnn.RouterConfig(
        num_experts=6, top_k=3, group_capacity=5, renormalize_after_drops=renormalize
    )
    out = hnn.route(jnp.asarray(logits), jnp.zeros(6), cfg, group_size=16)
    plain = hnn.route(
        jnp.asarray(logits),
        jnp.zeros(6),
        hnn.RouterConfig(num_experts=6, top_k=3, normalize=not renormalize),
    )
    ids, w = numpy_group_capacity(
        np.asarray(plain.topk_idx), np.asarray(plain.topk_weights), 5, 16, renormalize
    )
    np.testing.assert_array_equal(out.topk_idx, ids)
    np.testing.assert_allclose(out.topk_weights, w, rtol=1e-6)
    assert int(out.dropped) == int((ids == -1).sum()) > 0
    np.testing.assert_array_equal(out.load, plain.load)  # counted before the drops
    # The factor form: top_k * ceil(f * 16 / 6) = 3 * ceil(0.5 * 16 / 6) = 6 rows per group.
    by_factor = hnn.route(
        jnp.asarray(logits),
        jnp.zeros(6),
        hnn.RouterConfig(
            num_experts=6, top_k=3, group_capacity_factor=0.5, renormalize_after_drops=renormalize
        ),
        group_size=16,
    )
    ids6, _ = numpy_group_capacity(
        np.asarray(plain.topk_idx), np.asarray(plain.topk_weights), 6, 16, renormalize
    )
    np.testing.assert_array_equal(by_factor.topk_idx, ids6)


def test_group_capacity_needs_whole_groups():
    cfg = hnn.RouterConfig(num_experts=4, top_k=1, group_capacity=2)
    with pytest.raises(ValueError, match="groups of 5 tokens"):
        hnn.route(jnp.zeros((12, 4)), jnp.zeros(4), cfg, group_size=5)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(group_score="mean"), "group_score"),
        (dict(num_groups=8, topk_groups=2), "group_score='max'"),
        (dict(group_capacity=2, group_capacity_factor=1.0), "at most one"),
        (dict(group_capacity=0), "group_capacity"),
        (dict(group_capacity_factor=-1.0), "group_capacity_factor"),
        (dict(token_group="batch"), "token_group"),
        (dict(renormalize_after_drops=True), "renormalize_after_drops"),
        (dict(group_capacity=2, normalize=False, renormalize_after_drops=True), "normalize=True"),
    ],
)
def test_router_option_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        hnn.RouterConfig(num_experts=8, top_k=2, **kwargs)
    with pytest.raises(TypeError, match="logit_bias"):
        hnn.RouterConfig(num_experts=8, top_k=2, logit_bias=1)


RULES = [hnn.FFN(a, limit=0.5, bias=True) for a in hnn.ACTIVATIONS] + [hnn.FFN()]  # + default


def test_every_expert_rule_windowed_equals_ragged():
    """The CPU window path (a capacity) and the ragged path give the same rows and gradients for
    every activation with biases (and the default SwiGLU without); rows past the groups stay 0."""
    rng = np.random.default_rng(4)
    group_sizes = jnp.asarray([3, 0, 4], jnp.int32)  # 7 rows of 10; capacity 4 per expert
    rows = jnp.asarray(rng.normal(size=(10, 6)), jnp.float32)
    params = [
        tuple(jnp.asarray(rng.normal(size=(3, *s)), jnp.float32) for s in f.shapes(6, 5).values())
        for f in RULES
    ]

    def both(params, rows):
        out = []
        for ffn, p in zip(RULES, params, strict=True):
            for capacity in (4, None):
                out.append(hnn.expert_ffn(rows, group_sizes, p, ffn=ffn, capacity=capacity))
        return out

    def loss(params, rows, path):  # path 0: the windows, 1: ragged
        return sum(jnp.sum(jnp.sin(y)) for y in both(params, rows)[path::2])

    @jax.jit
    def run(params, rows):  # one program: values and both paths' gradients
        grads = [jax.grad(loss, argnums=(0, 1))(params, rows, path) for path in (0, 1)]
        return both(params, rows), grads

    values, grads = run(params, rows)
    for i, ffn in enumerate(RULES):
        windowed, ragged = values[2 * i], values[2 * i + 1]
        np.testing.assert_allclose(windowed, ragged, rtol=1e-5, atol=1e-6, err_msg=str(ffn))
        np.testing.assert_array_equal(ragged[7:], 0)
        dense = ffn(rows[:3], *(p[0] for p in params[i]))  # expert 0 by the one-expert rule
        np.testing.assert_allclose(ragged[:3], dense, rtol=1e-5, atol=1e-6, err_msg=str(ffn))
    leaves = [jax.tree.leaves(g) for g in grads]
    for windowed, ragged in zip(*leaves, strict=True):  # summed in other orders: 1e-4
        np.testing.assert_allclose(windowed, ragged, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(activation="tanh"), ValueError, "ExpertConfig.activation"),
        (dict(glu_limit=0.0), ValueError, "ExpertConfig.glu_limit"),
        (dict(glu_alpha=float("nan")), ValueError, "ExpertConfig.glu_alpha"),
        (dict(expert_bias=1), TypeError, "ExpertConfig.expert_bias"),
        (dict(weight_input="yes"), TypeError, "ExpertConfig.weight_input"),
        (dict(shared_gate=True), ValueError, "set shared_ff"),
    ],
)
def test_expert_option_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        hnn.ExpertConfig(d_ff=8, **kwargs)


def test_domains_need_the_three_matrix_experts():
    mesh = make_mesh((2, 2), ("dc", "ep"))
    topology = hep.Topology.from_mesh(mesh, ("dc", "ep"))
    with pytest.raises(ValueError, match="expert domains"):
        hnn.MoEBlock(
            8,
            router=hnn.RouterConfig(num_experts=4, top_k=1),
            experts=hnn.ExpertConfig(d_ff=8, activation="relu"),
            mesh=mesh,
            topology=topology,
            migration=xdc.Migration(domains={"ep": 2}),
            rngs=nnx.Rngs(0),
        )

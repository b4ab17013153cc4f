"""Cross-DC training features of the runtime (`xdc.migrate`, `nn.migration_state`):

* SR variants against plain EP: every variant decodes a replica exactly when its residual from
  the variant's reference has at most k nonzeros per matrix, and then the MoE block's values and
  gradients equal plain EP's (checked for the default variant); with dense residuals they do
  not (SR is lossy).
* Gradient compression's error feedback: over steps, what the owner receives plus what the
  senders still hold is exactly the sum of the true gradients, so the accumulated update is
  unbiased (its error stays bounded), while top-k without feedback stays biased.
* Prefetch: two blocks' experts gathered at step start in one collective per level, which reads
  only parameters and comes before either block's routing and token exchange in the compiled
  step; values and gradients as without prefetch.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from harness import make_mesh
from jax.sharding import PartitionSpec as P

import jax_hybridep as hep
from jax_hybridep import nn as hnn
from jax_hybridep import traffic, xdc
from jax_hybridep.xdc import expert_wire
from jax_hybridep.xdc.migration import SHARED_VARIANTS
from jax_hybridep.xdc.runtime import migrate

SHAPE, NAMES = (2, 2), ("dc", "local")
H, F, E, K, TOKENS, RATIO = 8, 16, 8, 2, 32, 4.0


def _block(**kw):
    mesh = make_mesh(SHAPE, NAMES)
    topo = hep.Topology.from_mesh(mesh, levels=NAMES)
    return hnn.MoEBlock(
        H,
        router=hnn.RouterConfig(num_experts=E, top_k=K),
        experts=hnn.ExpertConfig(d_ff=F),
        mesh=mesh,
        topology=topo,
        dispatch=hep.DispatchConfig(num_experts=E, backend="xla"),
        rngs=nnx.Rngs(0),
        **kw,
    )


@functools.partial(jax.jit, static_argnums=0)
def _jitted(graphdef, params, rest, x):
    def loss(params):
        y, _ = nnx.merge(graphdef, params, rest)(x)
        return jnp.sum(y * jnp.cos(y)), y

    (_, y), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return y, grads


def _value_and_grad(block, x):
    """(y, parameter gradients); one compile per block structure, whatever its values."""
    graphdef, params, rest = nnx.split(block, nnx.Param, ...)
    return _jitted(graphdef, params, rest, x)


def _sparse(rng, shape, nonzeros):
    """[E, ...] with `nonzeros` entries per expert matrix, the rest 0."""
    out = np.zeros((shape[0], int(np.prod(shape[1:]))), np.float32)
    for row in out:
        row[rng.choice(row.size, nonzeros, replace=False)] = rng.normal(size=nonzeros) + 2.0
    return out.reshape(shape)


def _experts(shared, rng, sparse: bool):
    """Per matrix [E, ...] weights whose residual from the variant's reference is k-sparse
    (`sparse`) or dense. "mean": each domain (the pair of ranks with equal local coordinate)
    holds base + s, base - s, base + t, base - t, so its mean is the base."""
    out, refs = [], []
    for shape in ((E, H, F), (E, H, F), (E, F, H)):
        base = rng.normal(size=shape[1:]).astype(np.float32) if shared != "none" else 0 * 1.0
        if sparse:
            res = _sparse(rng, shape, 4)  # k = H F / 8 = 16 entries kept per matrix
        else:
            res = rng.normal(size=shape).astype(np.float32)
        if shared == "mean":
            for local in range(2):
                a, b = 2 * local, 4 + 2 * local  # this domain's experts on dc 0 and dc 1
                res[a + 1], res[b + 1] = -res[a], -res[b]
        out.append(jnp.asarray(base + res))
        refs.append(jnp.asarray(base, jnp.float32))
    return out, refs


X = jax.random.normal(jax.random.key(1), (TOKENS, H))


def _set(block, weights, refs):
    """New values in the variables' shardings (so the compiled step is reused)."""
    for param, w in zip(block.expert_weights(), weights, strict=True):
        param[...] = jax.device_put(w, param[...].sharding)
    if hasattr(block, "sr_reference"):  # the persistent shared expert is state: the base
        for ref, r in zip(block.sr_reference, refs, strict=True):
            ref[...] = jax.device_put(r, ref[...].sharding)


@pytest.mark.parametrize("shared", SHARED_VARIANTS)
def test_sr_gather_decodes_sparse_residuals_exactly(shared):
    """Every replica a rank holds equals its owner's expert when the residual is k-sparse."""
    assert expert_wire.kept_entries(H * F, np.float32, RATIO) == 16
    mesh = make_mesh(SHAPE, NAMES)
    doms = xdc.ExpertDomains.from_mesh(
        mesh, hep.Topology.from_mesh(mesh, levels=NAMES), xdc.Migration({"dc": 2}, RATIO, shared)
    )
    persistent = shared == "persistent"
    spec, every = P(doms.expert_axes), P(tuple(doms.mesh.axis_names))
    fn = jax.jit(
        jax.shard_map(
            lambda w, r: doms.gather_experts(w, r if persistent else ())[0][None],
            mesh=doms.mesh,
            in_specs=((spec,) * 3, (P(),) * 3),
            out_specs=every,
        )
    )
    plain = jax.jit(
        jax.shard_map(
            lambda w: xdc.migrate.gather(w, doms.inner_axes, xdc.Migration())[0][None],
            mesh=doms.mesh,
            in_specs=((spec,) * 3,),
            out_specs=every,
        )
    )
    rng = np.random.default_rng(3)
    for sparse in (True, False):
        weights, refs = _experts(shared, rng, sparse)
        got, want = fn(tuple(weights), tuple(refs)), plain(tuple(weights))
        if sparse:
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=2e-6)
        else:
            assert float(jnp.max(jnp.abs(got - want))) > 0.5


def test_sr_block_values_and_gradients_equal_plain_ep_on_sparse_residuals():
    """The default SR (persistent shared expert): exact where its residuals are k-sparse, the
    gradients straight through to the owners; lossy otherwise."""
    rng = np.random.default_rng(7)
    plain = _block()
    sr = _block(migration=xdc.Migration({"dc": 2}, RATIO))
    for sparse in (True, False):
        weights, refs = _experts("persistent", rng, sparse)
        _set(plain, weights, refs)
        _set(sr, weights, refs)
        y0, g0 = _value_and_grad(plain, X)
        y, g = _value_and_grad(sr, X)
        if sparse:
            np.testing.assert_allclose(y, y0, rtol=1e-5, atol=1e-5)
            # The two programs sum the gradients in different orders; with entries up to ~7e3
            # and cancelling terms, float32 leaves up to ~2e-5 of the largest entry (jax 0.11.2).
            for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g0), strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(b))))
        else:
            assert float(jnp.max(jnp.abs(y - y0))) > 1e-2


def _compressed_scatter(ratio):
    """(grad, next residuals) of the replicas' gradients G through a gather over a dc pair with
    gradient compression (each rank owns one expert of n = 64 entries; full-expert forward)."""
    mesh = make_mesh((2,), ("dc",))
    topo = hep.Topology.from_mesh(mesh, levels=("dc",))
    doms = xdc.ExpertDomains.from_mesh(mesh, topo, xdc.Migration({"dc": 2}, grad_compression=ratio))

    def loss(w, g, fb):
        def body(w, g, fb):
            held = doms.gather_experts((w,), (), ((fb,),))[0]  # [2, 64]: both experts
            return jnp.sum(held * g)[None]

        spec = P(doms.expert_axes)  # the split mesh (dc=1, dc_domain=2): every device its own
        return jnp.sum(
            jax.shard_map(body, mesh=doms.mesh, in_specs=(spec,) * 3, out_specs=spec)(w, g, fb)
        )

    return jax.jit(jax.grad(loss, argnums=(0, 2)))


def test_error_feedback_delivers_every_gradient_over_steps():
    ratio, n, steps = 8.0, 64, 100
    k = expert_wire.kept_entries(n, np.float32, ratio)
    assert k == 4  # 4 of 64 entries a step
    rng = np.random.default_rng(0)
    g = jnp.asarray(rng.normal(size=(4, n)), jnp.float32)  # rank r holds rows 2r, 2r + 1
    true = g[0:2] + g[2:4]  # expert e's gradient: rank 0's slot e plus rank 1's slot e
    w = jnp.zeros((2, n))
    step = _compressed_scatter(ratio)
    fb = jnp.zeros((4, n))
    delivered = np.zeros((2, n))
    biased = np.zeros((2, n))
    for t in range(steps):
        grad, fb = step(w, g, fb)
        delivered += np.asarray(grad)
        if t == 0:
            one_step = np.asarray(grad)
        biased += np.asarray(step(w, g, jnp.zeros((4, n)))[0])  # top-k, feedback dropped
    # Expert 0 lives on rank 0: rank 1 holds what it has not yet sent of it (its row 2), and
    # rank 0 that of expert 1 (its row 1). Nothing is lost:
    held = np.stack([np.asarray(fb)[2], np.asarray(fb)[1]])
    np.testing.assert_allclose(delivered + held, steps * np.asarray(true), rtol=1e-4, atol=1e-3)
    assert np.abs(np.asarray(fb)[[0, 3]]).max() == 0  # own blocks are never residuals
    # One step is not exact (declared so); the mean over steps converges, without feedback not.
    assert np.abs(one_step - np.asarray(true)).max() > 0.1
    err = np.abs(delivered / steps - np.asarray(true)).max()
    err_biased = np.abs(biased / steps - np.asarray(true)).max()
    assert err < 0.1 * err_biased and err_biased > 0.5


class _TwoLayers(nnx.Module):
    def __init__(self, prefetch):
        self.prefetch = prefetch
        self.blocks = nnx.List([_block(migration=xdc.Migration({"dc": 2})) for _ in range(2)])

    def __call__(self, x):
        gathered = hnn.prefetch_experts(list(self.blocks)) if self.prefetch else [None, None]
        for block, experts in zip(self.blocks, gathered, strict=True):
            y, _ = block(x, experts)
            x = x + y
        return jnp.sum(x * jnp.cos(x))


def _entry(hlo: str) -> list[str]:
    return hlo[hlo.index("\nENTRY") :].splitlines()[1:]


def _upstream(lines, index) -> set[int]:
    """Indices of every instruction the instruction at `index` reads, transitively."""
    names = {}
    for i, line in enumerate(lines):
        m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+) = ", line)
        if m:
            names[m.group(1)] = i
    seen, todo = set(), [index]
    while todo:
        i = todo.pop()
        args = lines[i].split(" = ", 1)[1].split("(", 1)[1].split("metadata=")[0]
        for ref in re.findall(r"%([\w.\-]+)", args):
            j = names.get(ref)
            if j is not None and j not in seen:
                seen.add(j)
                todo.append(j)
    return seen


def test_prefetch_gathers_every_layer_at_step_start_in_one_collective():
    hlos, results = {}, {}
    for prefetch in (False, True):
        graphdef, params, rest = nnx.split(_TwoLayers(prefetch), nnx.Param, ...)

        def loss(p, r, x, graphdef=graphdef):
            return nnx.merge(graphdef, p, r)(x)

        compiled = jax.jit(jax.value_and_grad(loss)).lower(params, rest, X).compile()
        hlos[prefetch], results[prefetch] = compiled.as_text(), compiled(params, rest, X)
    (v0, g0), (v1, g1) = results[False], results[True]
    np.testing.assert_allclose(v1, v0, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    expert = 3 * H * F * 4  # one expert's three float32 matrices
    for prefetch, hlo in hlos.items():
        lines = _entry(hlo)
        gathers = [
            i
            for i, line in enumerate(lines)
            if " all-gather(" in line and migrate.GATHER_SCOPE in line
        ]
        # Each rank holds E / 4 = 2 experts; the result holds both DCs' blocks.
        per_layer = 2 * 2 * expert
        sizes = [traffic.collectives(lines[i], "all-gather")[0].bytes for i in gathers]
        assert sizes == ([2 * per_layer] if prefetch else [per_layer, per_layer])
        if not prefetch:
            continue
        (gather,) = gathers
        reads = _upstream(lines, gather)
        assert all(
            " parameter(" in lines[j]
            or "fusion(" in lines[j]
            or " copy(" in lines[j]
            or "bitcast" in lines[j]
            or "reshape" in lines[j]
            or "concatenate" in lines[j]
            for j in reads
        ), [lines[j] for j in reads]
        assert not any(op in lines[j] for j in reads for op in ("all-to-all", "custom-call"))
        first_exchange = min(i for i, line in enumerate(lines) if " all-to-all(" in line)
        first_route = min(
            i
            for i, line in enumerate(lines)
            if 'custom_call_target="TopK"' in line or "top_k" in line
        )
        assert gather < first_exchange and gather < first_route

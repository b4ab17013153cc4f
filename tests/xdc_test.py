"""Cross-datacenter runtime (`jax_hybridep.xdc`): domains, expert gather, SR compression.

The contract (docs/design.md §4): values and gradients equal plain EP's; the placement sends every
token to a replica inside the sender's domain; the bytes on each level are the model's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from harness import local_experts, make_mesh
from jax.sharding import PartitionSpec as P

import jax_hybridep as hep
from jax_hybridep import nn as hnn
from jax_hybridep import traffic, xdc
from jax_hybridep.xdc import expert_wire

SHAPE, NAMES = (2, 2, 2), ("dc", "node", "local")
DOMAINS = [{"dc": 2}, {"dc": 2, "local": 2}, {"node": 2}, {"dc": 2, "node": 2, "local": 2}]
H, F, E, K, TOKENS = 16, 32, 16, 4, 64


def _domains(sizes, compression=None, shape=SHAPE, names=NAMES):
    mesh = make_mesh(shape, names)
    topo = hep.Topology.from_mesh(mesh, levels=names)
    return mesh, topo, xdc.ExpertDomains.from_mesh(mesh, topo, xdc.Migration(sizes, compression))


def _gathered(domains, weights):
    """Each rank's gathered experts [R, S * E_local, ...] (R in mesh device order)."""
    spec = P(domains.expert_axes)
    fn = jax.shard_map(
        lambda w: domains.gather_experts((w,))[0][None],
        mesh=domains.mesh,
        in_specs=spec,
        out_specs=P(tuple(domains.mesh.axis_names)),
    )
    return np.asarray(jax.jit(fn)(weights))


@pytest.mark.parametrize("sizes", DOMAINS, ids=str)
def test_placement_names_the_replica_in_the_senders_domain(sizes):
    """Gather experts labelled by id; every sender's replica of e sits where `placement` says."""
    _, topo, domains = _domains(sizes)
    held = _gathered(domains, jnp.arange(E, dtype=jnp.float32))  # [8, S * E_local]
    placement = domains.placement(E)
    token_topo = domains.token_topology
    group_size = token_topo.ep_size
    assert held.shape == (8, domains.domain_size * E // 8)
    # Device d of the split mesh: its token group (inner coordinates) and rank within the group.
    coords = np.stack(np.unravel_index(np.arange(8), domains.mesh.devices.shape))
    names = domains.mesh.axis_names
    group_axes = [names.index(a) for a in token_topo.group_axes]
    ep_axes = [names.index(a) for a in token_topo.ep_axes]
    shape = domains.mesh.devices.shape
    groups = np.ravel_multi_index(coords[group_axes], [shape[a] for a in group_axes])
    ranks = np.ravel_multi_index(coords[ep_axes], [shape[a] for a in ep_axes])
    for device in range(8):
        members = {int(r): d for d, r in enumerate(ranks) if groups[d] == groups[device]}
        assert len(members) == group_size
        for e, (rank, slot) in enumerate(placement):
            assert held[members[rank], slot] == e
    # Tokens cross a level only where it still has several domains.
    outer = domains.outer_sizes
    assert all(n > 1 for n in token_topo.level_sizes) or token_topo.ep_size == 1
    assert token_topo.ep_size == int(np.prod(outer))
    assert domains.domain_size * token_topo.ep_size == topo.ep_size


def test_domain_errors_name_the_offending_values():
    mesh = make_mesh(SHAPE, NAMES)
    topo = hep.Topology.from_mesh(mesh, levels=NAMES)
    with pytest.raises(ValueError, match="domain size 3 at level .*'node'.* divide .* 2"):
        xdc.ExpertDomains.from_mesh(mesh, topo, xdc.Migration({"node": 3}))
    with pytest.raises(ValueError, match="'rack'.* not levels"):
        xdc.ExpertDomains.from_mesh(mesh, topo, xdc.Migration({"rack": 2}))
    two_axis = hep.Topology.from_mesh(mesh, levels=(("dc", "node"), "local"))
    with pytest.raises(ValueError, match="spans several mesh axes"):
        xdc.ExpertDomains.from_mesh(mesh, two_axis, xdc.Migration({"dc": 4}))
    with pytest.raises(TypeError, match="migration must be a jax_hybridep.xdc.Migration"):
        xdc.ExpertDomains.from_mesh(mesh, topo, {"dc": 2})
    with pytest.raises(
        ValueError, match="compression must be None or a finite number > 0, got nan"
    ):
        xdc.Migration({"dc": 2}, float("nan"))
    with pytest.raises(ValueError, match="compression must be None or a ratio > 1 .*, got 1.0"):
        xdc.Migration({"dc": 2}, 1.0)
    with pytest.raises(ValueError, match=r"Migration.domains\['dc'\] must be an int >= 1, got 0"):
        xdc.Migration({"dc": 0})


def _block(sizes, backend, compression=None, capacity_factor=None):
    mesh = make_mesh(SHAPE, NAMES)
    topo = hep.Topology.from_mesh(mesh, levels=NAMES)
    return hnn.MoEBlock(
        H,
        router=hnn.RouterConfig(num_experts=E, top_k=K),
        mesh=mesh,
        topology=topo,
        dispatch=hep.DispatchConfig(
            num_experts=E, backend=backend, capacity_factor=capacity_factor
        ),
        experts=hnn.ExpertConfig(d_ff=F),
        migration=xdc.Migration(sizes, compression) if sizes is not None else None,
        rngs=nnx.Rngs(0),
    )


@nnx.jit
def _value_and_grad(block, x):
    def loss(block, x):
        y, aux = block(x)
        return jnp.sum(y * jnp.cos(y)), (y, aux)

    (_, (y, aux)), grads = nnx.value_and_grad(loss, has_aux=True)(block, x)
    return y, aux, grads


X = jax.random.normal(jax.random.key(1), (TOKENS, H))


@pytest.mark.parametrize("sizes", DOMAINS, ids=str)
def test_moe_block_values_and_gradients_equal_plain_ep(sizes, backend):
    y0, aux0, g0 = _value_and_grad(_block(None, "xla"), X)
    y, aux, g = _value_and_grad(_block(sizes, backend), X)
    np.testing.assert_allclose(y, y0, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(aux.tokens_per_expert, aux0.tokens_per_expert)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g0), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def _numpy_gather(domains, w, ratio, shared, reference=None):
    """Reference SR gather on the host: per rank, its replicas decoded against the variant's
    reference (the domain's mean, the given persistent one, or none), its own block exact."""
    e_local = w.shape[0] // 8
    labels = jnp.asarray(np.arange(E, dtype=np.float32))
    held = _gathered(dataclasses.replace(domains, migration=xdc.Migration()), labels)  # per slot
    n = int(np.prod(w.shape[1:]))
    k = expert_wire.kept_entries(n, w.dtype, ratio)
    out = np.zeros((8, held.shape[1], *w.shape[1:]), w.dtype)
    for device in range(8):
        experts = held[device].astype(int)
        if shared == "mean":
            base = w[experts].astype(np.float32).mean(axis=0).astype(w.dtype).reshape(n)
        elif shared == "persistent":
            base = np.asarray(reference, w.dtype).reshape(n)
        else:
            base = np.zeros(n, w.dtype)
        own = set(range(device * e_local, (device + 1) * e_local))
        for slot, e in enumerate(experts):
            if e in own:
                out[device, slot] = w[e]
                continue
            residual = w[e].reshape(n) - base
            top = np.argsort(-np.abs(residual), kind="stable")[:k]
            decoded = base.copy()
            decoded[top] += residual[top]
            out[device, slot] = decoded.reshape(w.shape[1:])
    return out


def _sr_gathered(domains, w, reference=()):
    """Each rank's SR-gathered experts, the persistent reference passed replicated."""
    spec = P(domains.expert_axes)
    fn = jax.shard_map(
        lambda w, *ref: domains.gather_experts((w,), ref)[0][None],
        mesh=domains.mesh,
        in_specs=(spec, *(P(),) * len(reference)),
        out_specs=P(tuple(domains.mesh.axis_names)),
    )
    return np.asarray(jax.jit(fn)(w, *reference))


@pytest.mark.parametrize(
    "sizes,shared",
    [({"dc": 2}, "persistent"), ({"dc": 2, "local": 2}, "mean"), ({"dc": 2}, "none")],
    ids=str,
)
def test_compressed_gather_decodes_top_k_residuals_and_passes_gradients_straight_through(
    sizes, shared
):
    ratio = 4.0
    mesh = make_mesh(SHAPE, NAMES)
    topo = hep.Topology.from_mesh(mesh, levels=NAMES)
    domains = xdc.ExpertDomains.from_mesh(mesh, topo, xdc.Migration(sizes, ratio, shared=shared))
    plain = xdc.ExpertDomains.from_mesh(mesh, topo, xdc.Migration(sizes))
    rng = np.random.default_rng(0)
    w = rng.normal(size=(E, 4, 6)).astype(np.float32)
    ref = (
        (jnp.asarray(rng.normal(size=(4, 6)).astype(np.float32)),) if shared == "persistent" else ()
    )
    np.testing.assert_allclose(
        _sr_gathered(domains, jnp.asarray(w), ref),
        _numpy_gather(domains, w, ratio, shared, ref[0] if ref else None),
        rtol=1e-6,
        atol=1e-6,
    )

    def vjp(d, ref):
        spec = P(d.expert_axes)
        fn = jax.shard_map(
            lambda w, *r: d.gather_experts((w,), r)[0],
            mesh=d.mesh,
            in_specs=(spec, *(P(),) * len(ref)),
            out_specs=spec,
        )
        out, pullback = jax.vjp(jax.jit(lambda w: fn(w, *ref)), jnp.asarray(w))
        ct = jnp.sin(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
        return pullback(ct)[0]

    np.testing.assert_array_equal(vjp(domains, ref), vjp(plain, ()))


def test_sent_bytes_follow_the_ratio():
    assert expert_wire.sent_bytes((64, 128), np.float32, None) == 64 * 128 * 4
    # k = floor(8192 * 4 / (10 * 8)) = 409 values of 4 bytes + 409 int32 indices.
    assert expert_wire.kept_entries(64 * 128, np.float32, 10.0) == 409
    assert expert_wire.sent_bytes((64, 128), np.float32, 10.0) == 409 * 8
    assert expert_wire.sent_bytes((64, 128), jnp.bfloat16, 50.0) == 54 * 6
    _, _, domains = _domains({"dc": 2, "local": 2}, compression=10.0)
    w = [jax.ShapeDtypeStruct((2, 64, 128), np.float32)]
    assert domains.gather_bytes(w) == {
        "dc_domain": 1 * 2 * 409 * 8,
        "local_domain": 1 * 4 * 409 * 8,
    }


def _on_dc(groups: str) -> bool:
    """Whether HLO replica groups printed as "mesh[...] {axes}" run over the dc axis."""
    return "'dc'" in groups.rsplit("]", 1)[-1]


def test_compiled_collectives_move_the_gathered_bytes_and_no_tokens_cross_a_replicated_level():
    """Domain dc=2: the DC level carries the experts' all-gather (forward) and reduce-scatter
    (backward) and no token all-to-all."""
    block = _block({"dc": 2}, "xla")
    hlo = _value_and_grad.lower(block, X).compile().as_text()
    assert not any(_on_dc(g) for _, _, g in traffic.collective_bytes(hlo, "all-to-all"))
    expert_bytes = 2 * (H * F * 4) * 3  # E_local = 2 experts, three matrices, f32
    gathers = [n for kind, n, g in traffic.collective_bytes(hlo, "all-gather") if _on_dc(g)]
    scatters = [n for kind, n, g in traffic.collective_bytes(hlo, "reduce-scatter") if _on_dc(g)]
    # All-gather results hold S = 2 blocks (one received); reduce-scatter results one block.
    assert sum(gathers) == 2 * expert_bytes
    assert sum(scatters) == expert_bytes
    w = [jax.ShapeDtypeStruct((2, H, F), np.float32)] * 3
    assert block.domains.gather_bytes(w) == {"dc_domain": expert_bytes}


MEASURED = [
    ((2, 2, 2), NAMES, {"dc": 2}),
    ((2, 2, 2), NAMES, {"dc": 2, "local": 2}),
    ((4, 2), ("dc", "local"), {"dc": 2}),  # a level split into 2 domains of 2
]


@pytest.mark.parametrize("shape,names,sizes", MEASURED, ids=str)
def test_measured_bytes_per_level_equal_the_planners_prediction(shape, names, sizes):
    """Forward + backward of dispatch -> gathered experts -> combine: the compiled program's
    expert all-gathers and reduce-scatters and the run-time token copies, per level, equal what
    `xdc.planner` predicts when fed the same routing."""
    mesh, topo, domains = _domains(sizes, shape=shape, names=names)
    ranks, tokens, e = topo.ep_size, 8, 16
    cfg = domains.dispatch_config(hep.DispatchConfig(num_experts=e, backend="xla"))
    token_topo = domains.token_topology
    spec = P(tuple(domains.mesh.axis_names))

    def step(x, idx, w, experts):
        experts = domains.gather_experts((experts,))[0]
        d = hep.dispatch(x, idx, w, topology=token_topo, config=cfg)
        y = local_experts(d.tokens, d.group_sizes, experts)
        return hep.combine(y, d.handle, weights=d.weights), d.stats.level_rows[None]

    fn = jax.shard_map(
        step,
        mesh=domains.mesh,
        in_specs=(spec, spec, spec, P(domains.expert_axes)),
        out_specs=(spec, spec),
    )

    def loss(x, idx, w, experts):
        out, rows = fn(x, idx, w, experts)
        return jnp.sum(out * out), rows

    grad = jax.jit(jax.grad(loss, argnums=(0, 3), has_aux=True))
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(ranks * tokens, H)), jnp.float32)
    idx = np.stack([rng.permutation(e)[:K] for _ in range(ranks * tokens)]).astype(np.int32)
    w = jnp.asarray(rng.random((ranks * tokens, K)), jnp.float32)
    experts = jnp.asarray(rng.normal(size=(e, H, H)), jnp.float32)
    hlo = grad.lower(x, idx, w, experts).compile().as_text()
    _, level_rows = grad(x, idx, w, experts)

    cluster = xdc.cost.Cluster(topo.level_sizes, (xdc.cost.Link(1e9),) * len(names), names)
    workload = xdc.planner.Workload(
        tokens=tokens,
        top_k=K,
        num_experts=e,
        hidden=H,
        act_bytes=4,
        expert_matrices=((H, H),),
        value_bytes=4,
    )
    plan = xdc.planner.plan(
        cluster, workload, idx.reshape(ranks, tokens, K), candidates=[domains.sizes]
    )
    predicted = next(c for c in plan.candidates if c.domains == domains.sizes)
    rows = dict(
        zip((lvl[0] for lvl in token_topo.levels), np.asarray(level_rows).sum(0), strict=True)
    )
    for level, name in enumerate(names):
        axes = {name, name + xdc.domains.INNER_SUFFIX}
        moved = traffic.crossing_bytes(hlo, axes, dtype="f32")
        vols = predicted.volumes.levels[level]
        assert moved["all-gather"] == vols.gather_bytes, (name, moved, vols)
        assert moved["reduce-scatter"] == vols.reduce_scatter_bytes, (name, moved, vols)
        copies = int(rows.get(name, 0))
        assert copies == round(vols.token_copies * ranks), (name, copies, vols)
        measured = 4 * copies * H * 4 / ranks + moved["all-gather"] + moved["reduce-scatter"]
        assert predicted.bytes_per_level[level] == pytest.approx(measured, rel=1e-12)
        if name not in rows:  # a level without tokens carries no token all-to-all at all
            assert moved["all-to-all"] == 0


def test_capacity_is_per_replica_and_drops_are_counted():
    """With a capacity factor each replica keeps ceil(f T (G/S) K / E) rows: generous capacity
    gives plain EP's values; a tight one drops rows and counts them."""
    y0, _, _ = _value_and_grad(_block(None, "xla"), X)
    y, aux, _ = _value_and_grad(_block({"dc": 2}, "ffi", capacity_factor=8.0), X)
    assert int(aux.dropped) == 0
    np.testing.assert_allclose(y, y0, rtol=1e-5, atol=1e-6)
    _, tight, _ = _value_and_grad(_block({"dc": 2}, "ffi", capacity_factor=0.5), X)
    # Per replica cap = ceil(0.5 * 8 tokens * 4 ranks * 4 / 16) = 4 rows; the block routes 256.
    kept = TOKENS * K - int(tight.dropped)
    assert 0 < int(tight.dropped) and kept <= 8 * (2 * 2) * 4


def test_moe_block_rejects_compression_it_would_ignore():
    mesh = make_mesh(SHAPE, NAMES)
    topo = hep.Topology.from_mesh(mesh, levels=NAMES)
    kw = dict(
        router=hnn.RouterConfig(num_experts=E, top_k=K),
        experts=hnn.ExpertConfig(d_ff=F),
        mesh=mesh,
        topology=topo,
        rngs=nnx.Rngs(0),
    )
    with pytest.raises(ValueError, match=r"compression=10.0, .*\) needs domains"):
        hnn.MoEBlock(H, migration=xdc.Migration(compression=10.0), **kw)
    with pytest.raises(ValueError, match=r"grad_compression=4.0\) needs domains"):
        hnn.MoEBlock(H, migration=xdc.Migration(grad_compression=4.0), **kw)
    domains = xdc.ExpertDomains.from_mesh(mesh, topo, xdc.Migration({"dc": 2}))
    with pytest.raises(TypeError, match="migration must be a jax_hybridep.xdc.Migration"):
        hnn.MoEBlock(H, migration=domains, **kw)
    with pytest.raises(ValueError, match="Migration.shared must be one of"):
        xdc.Migration({"dc": 2}, shared="median")
    with pytest.raises(ValueError, match="Migration.sync_every must be an int >= 1, got 0"):
        xdc.Migration({"dc": 2}, 10.0, sync_every=0)
    # No domains and nothing compressed: plain EP.
    assert hnn.MoEBlock(H, migration=xdc.Migration(), **kw).domains is None

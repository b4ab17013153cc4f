"""Property tests of the public API: hypothesis draws routings and configs, §2.1 must hold.

Each drawn case is one entry of a fixed grid of (mesh, topology, DispatchConfig) at fixed shapes,
so every entry compiles once per route kind; hypothesis draws the entry and the routing (in-range
ids, -1, ids out of range on both sides, duplicates and hot experts) and the data. Every case is
checked against the independent numpy model of §2.1 (tests/harness.py: rows, weights, group
sizes, kept, dropped, invalid and tokens per expert, exactly; the combined output to tolerance
against the dense MoE), and the `xla` and `ffi` route kinds (tests/route_kinds.py) must agree
bit for bit. Strict-mode entries must fail exactly when the model says a row is dropped or an id
is invalid (balanced routings, drawn too, fill every expert exactly to capacity, so both outcomes
occur).
"""

from __future__ import annotations

import contextlib
import functools

import hypothesis.extra.numpy as hnp
import jax
import numpy as np
import pytest
from harness import PlanView, expected_rows, make_mesh, moe_fn, reference_layout
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from route_kinds import ROUTES, bits

import jax_hybridep as hep
from jax_hybridep.reference import dense_moe

# The reference and the host route (the contract suite runs every route kind on fixed routings).
KINDS = ("xla", "ffi")
T, K, H, F = 4, 3, 8, 4  # per shard: tokens, top-k, hidden, expert output width
E = 8
# Expert e on rank (e * 3) % 4, slot e // 4: injective, far from the default placement.
SCATTERED = tuple(((e * 3) % 4, e // 4) for e in range(E))

# name -> (mesh shape, mesh axes, EP levels, DispatchConfig fields)
GRID = {
    "flat_dropless": ((4,), ("ep",), ("ep",), {}),
    "flat_capacity_pad2": ((4,), ("ep",), ("ep",), dict(capacity_factor=1.0, pad_multiple=2)),
    "flat_low_capacity_scattered": (
        (4,),
        ("ep",),
        ("ep",),
        dict(capacity_factor=0.5, expert_placement=SCATTERED),
    ),
    "flat_row_budget_pad2": ((4,), ("ep",), ("ep",), dict(row_budget=12, pad_multiple=2)),
    "flat_strict": ((4,), ("ep",), ("ep",), dict(capacity_factor=1.0, strict=True)),
    "two_level_dropless_pad4": ((2, 2), ("node", "local"), ("node", "local"), dict(pad_multiple=4)),
    "two_level_capacity": ((2, 2), ("node", "local"), ("node", "local"), dict(capacity_factor=1.0)),
    "data_groups_capacity": ((2, 2), ("data", "ep"), ("ep",), dict(capacity_factor=1.5)),
    "three_level_capacity": (
        (2, 2, 2),
        ("dc", "node", "local"),
        ("dc", "node", "local"),
        dict(capacity_factor=1.0),
    ),
}


@functools.cache
def _compiled(name, kind):
    """The jitted dispatch -> experts -> combine step of a grid entry on a route kind (compiled
    on first use)."""
    shape, axes, levels, fields = GRID[name]
    mesh = make_mesh(shape, axes)
    cfg = hep.DispatchConfig(num_experts=E, **fields)
    topo, cfg, route = ROUTES[kind].prepare(hep.Topology.from_mesh(mesh, levels), cfg)
    return moe_fn(mesh, topo, cfg, route=route)


def _views(name):
    """(groups, EP size, PlanView) of a grid entry, from the formulas of §2.1.3."""
    shape, axes, levels, fields = GRID[name]
    ep = int(np.prod([s for s, a in zip(shape, axes, strict=True) if a in levels]))
    view = PlanView(
        E,
        ep,
        T,
        K,
        fields.get("capacity_factor"),
        fields.get("pad_multiple", 1),
        fields.get("expert_placement"),
    )
    if fields.get("row_budget") is not None:
        view.rows = fields["row_budget"]
    return int(np.prod(shape)) // ep, ep, view


ids = st.one_of(
    st.integers(-3, E + 2),  # in range, -1 (none), and invalid on both sides
    st.sampled_from([-1, 0, 1, E - 1]),  # duplicates, hot experts, many empty slots
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    name=st.sampled_from(sorted(GRID)),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_dispatch_and_combine_follow_the_contract(name, data, seed):
    groups, ep, view = _views(name)
    n = groups * ep * T
    # Balanced routings fill every expert exactly to its capacity at f = 1: none dropped.
    balanced = st.permutations(range(n * K)).map(
        lambda p: (np.asarray(p, np.int32) % E).reshape(n, K)
    )
    idx = data.draw(
        st.one_of(hnp.arrays(np.int32, (n, K), elements=ids), balanced), label="topk_idx"
    )
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, H)).astype(np.float32)
    w = rng.random((n, K)).astype(np.float32)
    experts = (rng.normal(size=(E, H, F)) / np.sqrt(H)).astype(np.float32)
    placement = GRID[name][3].get("expert_placement")
    if placement is not None:  # weights stacked in (rank, slot) order, as the experts sit
        order = np.argsort(np.asarray(view.expert_rank) * view.num_slots + view.expert_slot)
        stacked = experts[order]
    else:
        stacked = experts

    refs = [
        reference_layout(idx[g * ep * T : (g + 1) * ep * T].reshape(ep, T, K), ep, view)
        for g in range(groups)
    ]
    if GRID[name][3].get("strict"):
        failing = any(r["dropped"].sum() + r["invalid"].sum() for r in refs)
        event(f"strict, {'failing' if failing else 'passing'}")
        for kind in KINDS:
            if failing:
                with pytest.raises(Exception, match="jax_hybridep strict mode"):
                    jax.block_until_ready(_compiled(name, kind)(x, idx, w, stacked))
                # JAX keeps the failure for its next effects barrier (at exit, it would print it
                # again): take it now.
                with contextlib.suppress(Exception):
                    jax.effects_barrier()
            else:
                jax.block_until_ready(_compiled(name, kind)(x, idx, w, stacked))
        return

    results = {k: jax.device_get(_compiled(name, k)(x, idx, w, stacked)) for k in KINDS}
    out, (tokens, weights, sizes, kept, stats) = results["xla"]
    for g, ref in enumerate(refs):
        shard, ranks = slice(g * ep * T, (g + 1) * ep * T), slice(g * ep, (g + 1) * ep)
        want_tokens, want_weights = expected_rows(
            x[shard].reshape(ep, T, H),
            w[shard].reshape(ep, T, K),
            idx[shard].reshape(ep, T, K),
            ref,
            ep,
            view.rows,
            np.float32,
        )
        np.testing.assert_array_equal(tokens[ranks], want_tokens)
        np.testing.assert_array_equal(weights[ranks], want_weights)
        np.testing.assert_array_equal(sizes[ranks], ref["group_sizes"])
        assert np.all(sizes[ranks] % view.pad == 0)
        np.testing.assert_array_equal(kept[ranks].reshape(ep, T, K), ref["row_pos"] >= 0)
        np.testing.assert_array_equal(stats.dropped[ranks], ref["dropped"])
        np.testing.assert_array_equal(stats.invalid[ranks], ref["invalid"])
        for r in range(g * ep, (g + 1) * ep):
            np.testing.assert_array_equal(stats.tokens_per_expert[r], ref["tokens_per_expert"])
        kept_rows = ref["row_pos"].reshape(-1, K) >= 0
        np.testing.assert_allclose(
            out[shard],
            dense_moe(x[shard], idx[shard], w[shard], experts, kept=kept_rows),
            rtol=1e-5,
            atol=1e-5,
        )
    for a, b in zip(jax.tree.leaves(results["xla"]), jax.tree.leaves(results["ffi"]), strict=True):
        np.testing.assert_array_equal(bits(a), bits(b))

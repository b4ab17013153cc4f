"""The contract suite: every case of docs/design.md §2.1 on every route kind (tests/route_kinds.py).

A case is a mesh, its EP levels and a `DispatchConfig` at fixed small shapes; it runs
dispatch -> local experts -> combine and its gradients (x, routing weights, experts) as one
compiled program per route kind, on several routings (random ids with -1 and invalid ids, and
adversarial ones). On the reference kind (`xla`) each routing is checked against the independent
numpy model of §2.1 (tests/harness.py): the rows and their order, row weights, group sizes
(padded), kept, dropped and invalid counts, tokens per expert and the copies sent at each level
exactly; the output (and, in float32, the gradients) against the dense MoE. Every other kind
must give the reference's bits on every output, count and gradient (§2.1.4: the summation order
is fixed).
Adding a route kind adds a column; adding a case adds a row (tests/contract_cases.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from contract_cases import (
    CASES,
    FLAT8,
    NODE2_LOCAL4,
    ROUTINGS,
    H,
    inputs,
    mesh_topology,
    plan_view,
    poisoned,
    stored_experts,
)
from harness import (
    expected_rows,
    flat_pairs,
    make_mesh,
    moe_fn,
    reference_layout,
    routed_pairs,
)
from route_kinds import ROUTES, bits, on_mesh

import jax_hybridep as hep
from jax_hybridep import fp8
from jax_hybridep.exchange import routes
from jax_hybridep.ops import dispatch_with_route
from jax_hybridep.reference import dense_moe


@functools.cache
def _program(kind, case_name):
    """The case's jitted values-and-gradients program on one route kind."""
    case = CASES[case_name]
    mesh, topo = mesh_topology(case)
    cfg = hep.DispatchConfig(num_experts=case.num_experts, **case.fields)
    topo, cfg, route = ROUTES[kind].prepare(topo, cfg)
    fn = moe_fn(mesh, topo, cfg, weighted_combine=case.weighted, route=route)

    def loss(x, w, experts, idx, cot):
        out, stacked = fn(x, idx, w, experts)
        return jnp.sum(out.astype(jnp.float32) * cot), (out, stacked)

    return jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))


@functools.cache
def _results(kind, case_name):
    """Per routing of the case: (out, (tokens, weights, group_sizes, kept, stats), grads)."""
    case = CASES[case_name]
    program = _program(kind, case_name)
    out = {}
    with poisoned(case.poison):
        for routing in case.routings:
            x, idx, w, experts, cot = inputs(case, routing)
            (_, (y, stacked)), grads = program(x, w, stored_experts(case, experts)[0], idx, cot)
            out[routing] = jax.device_get((y, stacked, grads))
    return out


@jax.jit
def _dense(x, idx, w, experts, kept, cot):
    def loss(x, w, experts):
        y = dense_moe(x, idx, w, experts, kept=kept)
        return jnp.sum(y * cot), y

    (_, y), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(x, w, experts)
    return y, grads


def _check_model(case, routing, result):
    """The reference kind's results against the numpy model of §2.1 and the dense MoE."""
    _, topo = mesh_topology(case)
    x, idx, w, experts, cot = inputs(case, routing)
    out, (tokens, weights, sizes, kept, stats), (gx, gw, g_stored) = result
    fields, view = case.fields, plan_view(case)
    if fields.get("wire_dtype") is not None:  # the tokens travel as dequantize(quantize(x))
        x = jax.jit(lambda x: fp8.dequantize(*fp8.quantize(x), x.dtype))(x)
    x_np, ep, T, K = np.asarray(x), case.ep, case.tokens, case.k
    kept_all = np.zeros(idx.shape, bool)
    for g in range(idx.shape[0] // (ep * T)):
        items, ranks = slice(g * ep * T, (g + 1) * ep * T), slice(g * ep, (g + 1) * ep)
        ref = reference_layout(idx[items].reshape(ep, T, K), ep, view)
        kept_all[items] = ref["row_pos"].reshape(-1, K) >= 0
        want_tokens, want_weights = expected_rows(
            x_np[items].reshape(ep, T, H),
            w[items].reshape(ep, T, K),
            idx[items].reshape(ep, T, K),
            ref,
            ep,
            view.rows,
            x_np.dtype,
        )
        got_tokens = np.asarray(tokens[ranks]).reshape(want_tokens.shape)
        live = np.arange(view.rows)[None, :] < ref["group_sizes"].sum(axis=1)[:, None]
        if case.poison:  # the padding rows really hold NaN, and only they
            assert np.isnan(np.asarray(got_tokens, np.float32)[~live]).all() and (~live).any()
            got_tokens, want_tokens = got_tokens[live], want_tokens[live]
        np.testing.assert_array_equal(bits(got_tokens), bits(want_tokens), err_msg="tokens")
        np.testing.assert_array_equal(weights[ranks].reshape(ep, -1), want_weights)
        np.testing.assert_array_equal(sizes[ranks], ref["group_sizes"])
        assert np.all(sizes[ranks] % view.pad == 0)
        assert np.all(sizes[ranks].sum(axis=1) <= view.rows)
        np.testing.assert_array_equal(kept[ranks].reshape(ep, T, K), ref["row_pos"] >= 0)
        np.testing.assert_array_equal(stats.dropped[ranks], ref["dropped"])
        np.testing.assert_array_equal(stats.invalid[ranks], ref["invalid"])
        for r in range(g * ep, (g + 1) * ep):
            np.testing.assert_array_equal(stats.tokens_per_expert[r], ref["tokens_per_expert"])
        # One copy per (token, destination group) at each level, never more than flat EP sends.
        level_rows = np.asarray(stats.level_rows[ranks]).sum(axis=0)
        np.testing.assert_array_equal(level_rows, routed_pairs(ref["dest"], topo))
        assert level_rows.sum() == 0 or level_rows[0] <= flat_pairs(ref["dest"])
    stored, order = stored_experts(case, experts)
    want, (want_gx, want_gw, want_ge) = _dense(x, idx, w, experts, kept_all, cot)
    if case.dtype != "float32":  # to the dtype's rounding; gradients checked bitwise only
        np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=5e-2, atol=5e-2)
        return
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5, err_msg="output")
    for name, got, ref in (
        ("x", gx, want_gx),
        ("topk_weights", gw, want_gw),
        ("experts", g_stored, np.asarray(want_ge)[order]),
    ):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5, err_msg=f"gradient of {name}")


@pytest.mark.parametrize("case_name", sorted(CASES))
@pytest.mark.parametrize("kind", sorted(ROUTES))
def test_contract(kind, case_name):
    case, reference = CASES[case_name], ROUTES[kind].reference
    got = _results(kind, case_name)
    if reference is not None:
        want = _results(reference, case_name)
        for routing in case.routings:
            leaves = jax.tree_util.tree_leaves_with_path(got[routing])
            for (path, a), b in zip(leaves, jax.tree.leaves(want[routing]), strict=True):
                where = f"routing {routing!r}, {jax.tree_util.keystr(path)}"
                np.testing.assert_array_equal(bits(a), bits(b), err_msg=where)
        return
    for routing, result in got.items():
        try:
            _check_model(case, routing, result)
        except AssertionError as err:
            raise AssertionError(f"routing {routing!r}: {err}") from None
    if case.same_as is not None:  # only the output and the gradients are the contract
        twin = _results(kind, case.same_as)
        for routing in got:
            ours, theirs = ((r[routing][0], r[routing][2]) for r in (got, twin))
            for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
                assert np.isfinite(np.asarray(a, np.float32)).all()
                np.testing.assert_array_equal(bits(a), bits(b), err_msg=routing)


def test_every_routing_and_implementation_is_used():
    """Every routing runs in some case, and every implementation of the routes table
    (routes.IMPLEMENTATIONS), with each level step and bottom it builds on any platform and
    process layout, runs in some route kind."""
    assert {r for case in CASES.values() for r in case.routings} == set(ROUTINGS)
    meshes = [hep.Topology.from_mesh(make_mesh(*m), m[1]) for m in (FLAT8, NODE2_LOCAL4)]
    views = [
        dataclasses.replace(t, platform=platform, single_process=single, level_local=None)
        for t in meshes
        for platform in ("cpu", "gpu")
        for single in (True, False)
    ]
    buildable = {
        (impl.name, type(step))
        for impl in routes.IMPLEMENTATIONS
        for t in views
        if impl.serves(t)
        for step in (*impl.build(t).levels, impl.build(t).bottom)
    }
    assert {name for name, _ in buildable} == {impl.name for impl in routes.IMPLEMENTATIONS}
    run = {
        (route.name, type(step))
        for kind in ROUTES.values()
        for t in meshes
        for route in [kind.route(t)]
        for step in (*route.levels, route.bottom)
    }
    assert buildable <= run, buildable - run


def test_all_rows_to_one_expert_drop_in_order_over_the_dropless_buffer():
    """The model's answer by hand: with L = 2 slots < K = 3 a token's K rows to one expert exceed
    the dropless C = T * R * min(K, L); the excess is dropped in (source, t, k) order, counted."""
    _, (_, _, sizes, kept, stats), _ = _results("ffi", "flat4_dropless")["all_to_one_expert"]
    n, k = 4 * 6, 3
    capacity = n * 2  # C = T * R * min(K, L)
    assert int(np.sum(stats.dropped)) == n * k - capacity
    assert int(np.asarray(sizes)[3, 1]) == capacity  # expert 7 lives on rank 3, slot 1
    flat_kept = np.asarray(kept).reshape(-1)  # (source, t, k) order
    assert flat_kept[:capacity].all() and not flat_kept[capacity:].any()


def test_the_cases_bind():
    """The cases exercise what they name: row budgets and a hot second EP group drop rows."""
    for name in ("flat4_row_budget", "node2_local2_row_budget_pad4"):
        _, (tokens, _, sizes, _, stats), _ = _results("xla", name)["hot"]
        assert tokens.shape[1] == CASES[name].fields["row_budget"] and np.sum(stats.dropped) > 0
    _, (_, _, _, _, stats), _ = _results("xla", "data_groups_capacity")["second_half_hot"]
    assert int(np.sum(stats.dropped[4:])) > int(np.sum(stats.dropped[:4]))


# ----------------------------------------------------------------------------- strict mode


@functools.cache
def _strict_message(kind):
    """The error of one strict dispatch whose row budget overflows and that has invalid ids."""
    mesh, topo = mesh_topology(CASES["flat4_row_budget"])
    cfg = hep.DispatchConfig(num_experts=8, row_budget=20, strict=True)
    topo, cfg, route = ROUTES[kind].prepare(topo, cfg)

    def rows(x, idx, w):
        return dispatch_with_route(route, x, idx, w, topology=topo, config=cfg).tokens

    x, idx, w, _, _ = inputs(CASES["flat4_row_budget"], "hot")
    idx[::7, 2] = 99
    with pytest.raises(Exception, match="jax_hybridep strict mode") as info:
        jax.block_until_ready(on_mesh(mesh, rows)(x, idx, w))
    # JAX keeps the failure for its next effects barrier (at exit it would print it again).
    with contextlib.suppress(Exception):
        jax.effects_barrier()
    with contextlib.suppress(hep.StrictModeError, hep.TransportError):
        hep.check_errors()
    found = re.search(
        r"jax_hybridep strict mode: [^\n]*?invalid per EP rank \[[^\]]*\]", str(info.value)
    )
    assert found, str(info.value)
    return found.group(0)


@pytest.mark.parametrize("kind", sorted(ROUTES))
def test_strict_mode_fails_alike(kind):
    """Rows over the budget and invalid ids fail the step on every kind, with the same error."""
    message = _strict_message(kind)
    assert "row(s) dropped" in message and "invalid" in message
    assert message == _strict_message(ROUTES[kind].reference or kind)

"""The contract suite: every case of docs/design.md §2.1 on every route kind (tests/route_kinds.py).

A case is a mesh, its EP levels and a `DispatchConfig` at fixed small shapes; it runs
dispatch -> local experts -> combine and its gradients (x, routing weights, experts) as one
compiled program per route kind, on several routings (random ids with -1 and invalid ids, and
adversarial ones). On the reference kind (`xla`) each routing is checked against the independent
numpy model of §2.1 (tests/harness.py): the rows and their order, row weights, group sizes
(padded), kept, dropped and invalid counts, tokens per expert and the copies sent at each level
exactly; the output and gradients against the dense MoE. Every other kind must give the
reference's bits on every output, count and gradient (§2.1.4: the summation order is fixed).
Adding a route kind adds a column; adding a case adds a row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import PlanView, expected_rows, make_mesh, moe_fn, random_routing, reference_layout
from route_kinds import ROUTES, bits, on_mesh

import jax_hybridep as hep
from jax_hybridep import fp8, traffic
from jax_hybridep.config import GPU_TRANSPORTS
from jax_hybridep.exchange import routes
from jax_hybridep.ops import dispatch_with_route
from jax_hybridep.reference import dense_moe

H, F = 8, 8
FP8 = "float8_e4m3fn"
# Expert e on rank (E - 1 - e) % R, slot e // R: far from the default placement.
REVERSED = tuple(((7 - e) % 4, e // 4) for e in range(8))


def _uniform(rng, n, k, e):
    return np.stack([rng.permutation(e)[:k] for _ in range(n)]).astype(np.int32)


# name -> idx [n, k] from (rng, n, k, num_experts); every one mixes what §2.1 must keep in order.
ROUTINGS = {
    "random": lambda rng, n, k, e: random_routing(rng, n, k, e, invalid_fraction=0.1)[0],
    "hot": lambda rng, n, k, e: np.where(np.arange(n)[:, None] < n // 4, 1, _uniform(rng, n, k, e)),
    "all_to_one_expert": lambda rng, n, k, e: np.full((n, k), e - 1),
    "all_minus_one": lambda rng, n, k, e: np.full((n, k), -1),
    "duplicates_in_a_row": lambda rng, n, k, e: np.repeat(rng.integers(0, e, (n, 1)), k, 1),
    "ranks_receive_nothing": lambda rng, n, k, e: rng.integers(0, 2, (n, k)),
    "invalid_ids": lambda rng, n, k, e: rng.choice([-3, -2, -1, 0, 5, e, e + 7], (n, k)),
    "one_hot_rank_of_sources": lambda rng, n, k, e: np.where(
        np.arange(n)[:, None] < n // 4, _uniform(rng, n, k, e), -1
    ),
    "one_remote_half": lambda rng, n, k, e: rng.integers(e // 2, e, (n, k)),
    # Every expert exactly at capacity factor 1 (none dropped), in a scrambled order.
    "balanced": lambda rng, n, k, e: (rng.permutation(n * k) % e).reshape(n, k),
    # The second half of the tokens (a second EP group beside a data axis) all to expert 0.
    "second_half_hot": lambda rng, n, k, e: np.where(
        (np.arange(n) >= n // 2)[:, None] & (np.arange(k) == 0), 0, _uniform(rng, n, k, e)
    ),
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One row of the suite.

    Attributes:
      shape, axes: the mesh. levels: the EP levels (mesh axes outside them index EP groups).
      config: DispatchConfig fields beyond num_experts (= experts_per_rank x EP size).
      routings: ROUTINGS names run through the case's one compiled program.
      dtype: of x and the expert weights. weighted: combine with the row weights (else rows
        are scaled by them before an unweighted combine).
      poison: run with JAX_HYBRIDEP_POISON_PADDING=1 (needs zero_padding=False).
      same_as: a case with the same inputs whose output and gradients these must equal bitwise.
    """

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    levels: tuple | None = None
    config: tuple = ()
    routings: tuple[str, ...] = ("random",)
    experts_per_rank: int = 2
    tokens: int = 6
    k: int = 3
    dtype: str = "float32"
    weighted: bool = True
    poison: bool = False
    same_as: str | None = None

    @property
    def fields(self) -> dict:
        return dict(self.config)

    @property
    def ep(self) -> int:
        levels = self.levels or self.axes
        named = {a for level in levels for a in ((level,) if isinstance(level, str) else level)}
        return int(np.prod([s for s, a in zip(self.shape, self.axes, strict=True) if a in named]))

    @property
    def num_experts(self) -> int:
        return self.experts_per_rank * self.ep


def _case(shape, axes, levels=None, routings=("random",), **kw):
    config = {k: kw.pop(k) for k in list(kw) if k not in {f.name for f in dataclasses.fields(Case)}}
    return Case(shape, axes, levels, tuple(sorted(config.items())), tuple(routings), **kw)


FLAT4, FLAT8 = ((4,), ("ep",)), ((8,), ("ep",))
NODE2_LOCAL4, NODE4_LOCAL2 = ((2, 4), ("node", "local")), ((4, 2), ("node", "local"))
DC2_NODE2_LOCAL2 = ((2, 2, 2), ("dc", "node", "local"))

CASES = {
    # One level: dropless, padding, capacity with drops, a non-default placement, the extremes.
    "flat4_dropless": _case(*FLAT4, routings=("random", "all_minus_one", "invalid_ids",
                                              "ranks_receive_nothing", "all_to_one_expert")),
    "flat4_pad4": _case(*FLAT4, pad_multiple=4, routings=("random", "duplicates_in_a_row")),
    "flat4_capacity_placed": _case(*FLAT4, capacity_factor=1.0, expert_placement=REVERSED,
                                   routings=("random", "hot", "all_to_one_expert",
                                             "one_hot_rank_of_sources", "balanced")),
    "flat4_low_capacity_pad2_unweighted": _case(*FLAT4, capacity_factor=0.5, pad_multiple=2,
                                                weighted=False, routings=("random", "hot")),
    "flat4_k_equals_e_one_token": _case(*FLAT4, experts_per_rank=1, tokens=1, k=4,
                                        routings=("random", "duplicates_in_a_row")),
    "ep1": _case((1,), ("ep",), experts_per_rank=4, routings=("random", "hot")),
    "ep16_capacity": _case((16,), ("ep",), capacity_factor=1.0),
    "flat8_bf16_capacity_pad4": _case(*FLAT8, capacity_factor=0.75, pad_multiple=4, k=4,
                                      dtype="bfloat16", routings=("random", "invalid_ids")),
    "flat8_f16": _case(*FLAT8, dtype="float16", routings=("random", "all_to_one_expert")),
    # The opt-in row budget: a dropless buffer smaller than the worst case, overflow dropped.
    "flat4_row_budget": _case(*FLAT4, tokens=8, row_budget=20, routings=("hot", "random")),
    # Groups of mesh axes: one level over two axes, two EP groups beside a data axis.
    "one_level_two_axes": _case((2, 4), ("x", "y"), (("x", "y"),)),
    "data_groups_capacity": _case((2, 4), ("data", "ep"), ("ep",), capacity_factor=1.0,
                                  routings=("second_half_hot", "random")),
    # Several levels: rows, drops and order as flat EP; one copy per destination group.
    "node2_local4": _case(*NODE2_LOCAL4, routings=("random", "all_to_one_expert",
                                                   "one_remote_half", "duplicates_in_a_row")),
    "node2_local4_capacity_unweighted": _case(*NODE2_LOCAL4, capacity_factor=1.0, k=4,
                                              weighted=False, routings=("random", "hot")),
    "node4_local2_capacity": _case(*NODE4_LOCAL2, capacity_factor=1.0,
                                   routings=("random", "all_minus_one")),
    "node2_local2_row_budget_pad4": _case((2, 2), ("node", "local"), tokens=8, row_budget=24,
                                          pad_multiple=4, routings=("hot",)),
    "dc2_node2_local2_bf16": _case(*DC2_NODE2_LOCAL2, dtype="bfloat16",
                                   routings=("random", "one_remote_half")),
    "dc2_node2_local2_capacity_pad2": _case(*DC2_NODE2_LOCAL2, capacity_factor=1.0, pad_multiple=2),
    "dc2_node2_local4_capacity": _case((2, 2, 4), ("dc", "node", "local"), capacity_factor=1.0,
                                       k=4),
    "level_over_two_axes": _case((2, 2, 2), ("node", "x", "y"), ("node", ("x", "y"))),
    # zero_padding=False: rows past the groups poisoned with NaN change no value or gradient.
    "flat4_pad4_poisoned": _case(*FLAT4, pad_multiple=4, zero_padding=False, poison=True,
                                 same_as="flat4_pad4", routings=("random", "duplicates_in_a_row")),
    "node2_local4_capacity_unweighted_poisoned": _case(
        *NODE2_LOCAL4, capacity_factor=1.0, k=4, weighted=False, zero_padding=False, poison=True,
        same_as="node2_local4_capacity_unweighted"),
    "dc2_node2_local2_capacity_pad2_poisoned": _case(
        *DC2_NODE2_LOCAL2, capacity_factor=1.0, pad_multiple=2, zero_padding=False, poison=True,
        same_as="dc2_node2_local2_capacity_pad2"),
    # FP8 on the wire: rows are the 16-bit dispatch of the dequantised tokens; straight-through.
    "node2_local4_fp8": _case(*NODE2_LOCAL4, wire_dtype=FP8, dtype="bfloat16"),
    "flat8_fp8_capacity": _case(*FLAT8, wire_dtype=FP8, capacity_factor=1.0),
}  # fmt: skip


@contextlib.contextmanager
def _poisoned(on: bool):
    """JAX_HYBRIDEP_POISON_PADDING=1 while a poisoned case traces (read at trace time)."""
    if not on:
        yield
        return
    old = os.environ.get("JAX_HYBRIDEP_POISON_PADDING")
    os.environ["JAX_HYBRIDEP_POISON_PADDING"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["JAX_HYBRIDEP_POISON_PADDING"]
        else:
            os.environ["JAX_HYBRIDEP_POISON_PADDING"] = old


def _mesh_topology(case):
    mesh = make_mesh(case.shape, case.axes)
    return mesh, hep.Topology.from_mesh(mesh, case.levels or case.axes)


def _view(case):
    """The PlanView of §2.1.3 for one EP group of the case."""
    fields = case.fields
    view = PlanView(case.num_experts, case.ep, case.tokens, case.k, fields.get("capacity_factor"),
                    fields.get("pad_multiple", 1), fields.get("expert_placement"))  # fmt: skip
    if fields.get("row_budget") is not None:
        view.rows = fields["row_budget"]
    return view


def _inputs(case, routing):
    """(x, idx, w, experts [E, H, F] logical, cot); the same for cases of the same shapes."""
    n, e, k = int(np.prod(case.shape)) * case.tokens, case.num_experts, case.k
    rng = np.random.default_rng([zlib.crc32(routing.encode()), n, e, k])
    idx = np.asarray(ROUTINGS[routing](rng, n, k, e), np.int32)
    w = rng.random((n, k)).astype(np.float32)
    x = jnp.asarray(rng.normal(size=(n, H)), case.dtype)
    experts = jnp.asarray(rng.normal(size=(e, H, F)) / np.sqrt(H), case.dtype)
    cot = rng.normal(size=(n, F)).astype(np.float32)
    return x, idx, w, experts, cot


def _stored(case, experts):
    """Expert weights in (rank, slot) order, as the placement stores them."""
    view = _view(case)
    order = np.argsort(np.asarray(view.expert_rank) * view.num_slots + view.expert_slot)
    return experts[order], order


@functools.cache
def _program(kind, case_name):
    """The case's jitted values-and-gradients program on one route kind."""
    case = CASES[case_name]
    mesh, topo = _mesh_topology(case)
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
    with _poisoned(case.poison):
        for routing in case.routings:
            x, idx, w, experts, cot = _inputs(case, routing)
            (_, (y, stacked)), grads = program(x, w, _stored(case, experts)[0], idx, cot)
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
    _, topo = _mesh_topology(case)
    x, idx, w, experts, cot = _inputs(case, routing)
    out, (tokens, weights, sizes, kept, stats), (gx, gw, g_stored) = result
    fields, view = case.fields, _view(case)
    if fields.get("wire_dtype") is not None:  # the tokens travel as dequantize(quantize(x))
        x = jax.jit(lambda x: fp8.dequantize(*fp8.quantize(x), x.dtype))(x)
    x_np, ep, T, K = np.asarray(x), case.ep, case.tokens, case.k
    kept_all = np.zeros(idx.shape, bool)
    for g in range(idx.shape[0] // (ep * T)):
        items, ranks = slice(g * ep * T, (g + 1) * ep * T), slice(g * ep, (g + 1) * ep)
        ref = reference_layout(idx[items].reshape(ep, T, K), ep, view)
        kept_all[items] = ref["row_pos"].reshape(-1, K) >= 0
        want_tokens, want_weights = expected_rows(
            x_np[items].reshape(ep, T, H), w[items].reshape(ep, T, K),
            idx[items].reshape(ep, T, K), ref, ep, view.rows, x_np.dtype)  # fmt: skip
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
        np.testing.assert_array_equal(level_rows, traffic.routed_pairs(ref["dest"], topo))
        assert level_rows.sum() == 0 or level_rows[0] <= traffic.flat_pairs(ref["dest"])
    stored, order = _stored(case, experts)
    want, (want_gx, want_gw, want_ge) = _dense(x, idx, w, experts, kept_all, cot)
    if case.dtype != "float32":  # to the dtype's rounding; gradients checked bitwise only
        np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=5e-2, atol=5e-2)
        return
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5, err_msg="output")
    for name, got, ref in (("x", gx, want_gx), ("topk_weights", gw, want_gw),
                           ("experts", g_stored, np.asarray(want_ge)[order])):  # fmt: skip
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


def test_every_routing_and_step_kind_is_used():
    """Every routing runs in some case, and every level step and bottom that backend selection
    can return (any backend, platform, transport, processes) runs in some route kind."""
    assert {r for case in CASES.values() for r in case.routings} == set(ROUTINGS)
    meshes = [hep.Topology.from_mesh(make_mesh(*m), m[1]) for m in (FLAT8, NODE2_LOCAL4)]
    views = [
        dataclasses.replace(t, platform=platform, single_process=single, level_local=None)
        for t in meshes
        for platform in ("cpu", "gpu")
        for single in (True, False)
    ]
    selectable = {
        type(step)
        for t in views
        for backend in ("xla", "ffi")
        for transport in GPU_TRANSPORTS
        for route in [routes.route_for(backend, t, transport)]
        for step in (*route.levels, route.bottom)
    }
    run = {type(step) for kind in ROUTES.values() for t in meshes
           for step in (*kind.route(t).levels, kind.route(t).bottom)}  # fmt: skip
    assert selectable <= run, selectable - run


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
    mesh, topo = _mesh_topology(CASES["flat4_row_budget"])
    cfg = hep.DispatchConfig(num_experts=8, row_budget=20, strict=True)
    topo, cfg, route = ROUTES[kind].prepare(topo, cfg)

    def rows(x, idx, w):
        return dispatch_with_route(route, x, idx, w, topology=topo, config=cfg).tokens

    x, idx, w, _, _ = _inputs(CASES["flat4_row_budget"], "hot")
    idx[::7, 2] = 99
    with pytest.raises(Exception, match="jax_hybridep strict mode") as info:
        jax.block_until_ready(on_mesh(mesh, rows)(x, idx, w))
    # JAX keeps the failure for its next effects barrier (at exit it would print it again).
    with contextlib.suppress(Exception):
        jax.effects_barrier()
    with contextlib.suppress(hep.StrictModeError, hep.TransportError):
        hep.check_errors()
    found = re.search(r"jax_hybridep strict mode: [^\n]*?invalid per EP rank \[[^\]]*\]",
                      str(info.value))  # fmt: skip
    assert found, str(info.value)
    return found.group(0)


@pytest.mark.parametrize("kind", sorted(ROUTES))
def test_strict_mode_fails_alike(kind):
    """Rows over the budget and invalid ids fail the step on every kind, with the same error."""
    message = _strict_message(kind)
    assert "row(s) dropped" in message and "invalid" in message
    assert message == _strict_message(ROUTES[kind].reference or kind)

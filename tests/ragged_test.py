"""The CPU stand-in of `jax.lax.ragged_all_to_all` (tests/ragged_standin.py) against the op's
documented semantics, and the ragged level step's own geometry (jax_hybridep/exchange/
ragged_steps.py). The step's rows, drops, stats and bits over every contract case are the
contract suite's (route kind `xla_ragged`, tests/route_kinds.py); its StableHLO on GPUs and TPUs
is tests/ragged_export_test.py's.

The oracle is the docstring of `jax.lax.ragged_all_to_all` (jax 0.12): its worked example
restated by hand, and its SEND / RECEIVE loops written out in numpy for hand-made cases (empty
peers, full peers, zero rows, a peer sending to itself, offsets with internal padding, several
slices per peer).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import make_mesh, random_routing
from jax.sharding import PartitionSpec as P
from ragged_standin import ragged_all_to_all
from route_kinds import ROUTES, same_bits_on

import jax_hybridep as hep
from jax_hybridep.config import make_plan
from jax_hybridep.exchange import ragged_steps
from jax_hybridep.exchange.steps import Items


@dataclasses.dataclass(frozen=True)
class Caller:
    """One caller's arguments (numpy)."""

    operand: np.ndarray
    output: np.ndarray
    input_offsets: tuple[int, ...]
    send_sizes: tuple[int, ...]
    output_offsets: tuple[int, ...]
    recv_sizes: tuple[int, ...]


def documented(callers: list[Caller]) -> list[np.ndarray]:
    """The result on each caller by the docstring's SEND / RECEIVE loops."""
    size, slices = len(callers), len(callers[0].input_offsets)
    per = slices // size
    results = []
    for me, c in enumerate(callers):
        result = c.output.copy()
        for i in range(slices):
            src, j = divmod(i, per)
            sender = callers[src]
            sent = me * per + j  # the sender's slice addressed to me
            lo = sender.input_offsets[sent]
            data = sender.operand[lo : lo + sender.send_sizes[sent]]
            at = sender.output_offsets[sent]
            result[at : at + c.recv_sizes[i]] = data[: c.recv_sizes[i]]
        results.append(result)
    return results


def run_standin(callers: list[Caller], exchange=ragged_all_to_all) -> list[np.ndarray]:
    """`exchange` on one caller per fake CPU device of an axis "x"."""
    size = len(callers)
    mesh = make_mesh((size,), ("x",))

    def body(operand, output, *offsets):
        return exchange(operand, output, *offsets, axis_name="x")

    stacked = [np.concatenate([getattr(c, f.name) for c in callers]) for f in _FIELDS]
    stacked = [np.asarray(a, np.int32) if i >= 2 else a for i, a in enumerate(stacked)]
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    out = np.asarray(fn(*stacked))
    return list(out.reshape((size, -1) + out.shape[1:]))


_FIELDS = dataclasses.fields(Caller)


def test_the_docstrings_worked_example():
    """Restated from the docstring: an axis of 2, 1-D operands, one slice per peer."""
    callers = [
        Caller(
            np.array([1, 2, 2], np.float32), np.zeros(4, np.float32), (0, 1), (1, 2), (0, 0), (1, 1)
        ),
        Caller(
            np.array([3, 4, 0], np.float32), np.zeros(4, np.float32), (0, 1), (1, 1), (1, 2), (2, 1)
        ),
    ]
    got = run_standin(callers)
    np.testing.assert_array_equal(got[0], [1, 3, 0, 0])
    np.testing.assert_array_equal(got[1], [2, 2, 4, 0])
    for a, b in zip(got, documented(callers), strict=True):
        np.testing.assert_array_equal(a, b)


def _rows(rng, n, width=3, dtype=np.float32):
    return rng.normal(size=(n, width)).astype(dtype)


def _consistent(send_sizes: np.ndarray, in_offsets, out_offsets, operand, output) -> list[Caller]:
    """Callers from send_sizes [S, K] (caller s's slice i), recv_sizes the matching transpose."""
    size, slices = send_sizes.shape
    per = slices // size
    recv = np.zeros_like(send_sizes)
    for s in range(size):
        for i in range(slices):
            dst, j = divmod(i, per)
            recv[dst, s * per + j] = send_sizes[s, i]
    return [
        Caller(
            operand[s],
            output[s],
            tuple(in_offsets[s]),
            tuple(send_sizes[s]),
            tuple(out_offsets[s]),
            tuple(recv[s]),
        )
        for s in range(size)
    ]


def _packed(send_sizes, gap=0):
    """Input offsets packing each caller's slices in order, `gap` rows of padding between."""
    return np.cumsum(send_sizes + gap, axis=1) - send_sizes - gap


def _case(name, rng):
    """(callers) of one hand-made case on 4 callers (operands of 10 rows, outputs of 12)."""
    size, out_rows = 4, 12
    operand = np.stack([_rows(rng, 10) for _ in range(size)])
    output = np.full((size, out_rows, 3), -7.0, np.float32)  # what is not written stays
    if name == "empty_peers":  # callers 1 and 3 get nothing; caller 2 sends nothing
        sizes = np.array([[2, 0, 3, 0], [1, 0, 2, 0], [0, 0, 0, 0], [4, 0, 1, 0]])
    elif name == "full_peers":  # every caller's whole operand to one peer
        sizes = np.zeros((size, size), int)
        sizes[np.arange(size), (np.arange(size) + 1) % size] = 10
        out_offsets = np.zeros((size, size), int)
        return _consistent(sizes, np.zeros((size, size), int), out_offsets, operand, output)
    elif name == "zero_rows":
        sizes = np.zeros((size, size), int)
    elif name == "to_itself":  # each caller's only slice is its own
        sizes = np.diag([3, 1, 4, 2])
    elif name == "internal_padding":  # gaps of 2 rows between the sent slices and received ones
        sizes = np.array([[1, 2, 0, 1], [2, 1, 1, 0], [0, 1, 2, 1], [1, 0, 1, 2]])
        out_offsets = np.zeros_like(sizes)
        for dst in range(size):  # receiver dst's slices from sources in order, 1 row apart
            out_offsets[:, dst] = np.cumsum(sizes[:, dst] + 1) - sizes[:, dst] - 1
        return _consistent(sizes, _packed(sizes, gap=2), out_offsets, operand, output)
    else:
        raise KeyError(name)
    out_offsets = np.zeros_like(sizes)
    for dst in range(size):
        out_offsets[:, dst] = np.cumsum(sizes[:, dst]) - sizes[:, dst]
    return _consistent(sizes, _packed(sizes), out_offsets, operand, output)


@pytest.mark.parametrize(
    "name", ["empty_peers", "full_peers", "zero_rows", "to_itself", "internal_padding"]
)
def test_standin_follows_the_documented_loops(name):
    callers = _case(name, np.random.default_rng(sum(map(ord, name))))
    want = documented(callers)
    for a, b in zip(run_standin(callers), want, strict=True):
        np.testing.assert_array_equal(a, b)
    if name == "zero_rows":
        for a, c in zip(want, callers, strict=True):
            np.testing.assert_array_equal(a, c.output)


def test_several_slices_per_peer_and_integer_rows():
    """K = 2S slices (two per peer), uint16 rows: slice i goes to peer i // 2."""
    rng = np.random.default_rng(3)
    size, slices = 2, 4
    sizes = np.array([[1, 2, 0, 3], [2, 0, 1, 1]])
    operand = rng.integers(0, 2**16, (size, 10, 5)).astype(np.uint16)
    output = np.zeros((size, 9, 5), np.uint16)
    out_offsets = np.array([[0, 4, 0, 5], [1, 7, 1, 2]])
    callers = _consistent(sizes, _packed(sizes, gap=1), out_offsets, operand, output)
    assert len(callers[0].input_offsets) == slices
    for a, b in zip(run_standin(callers), documented(callers), strict=True):
        np.testing.assert_array_equal(a, b)


def test_an_operand_of_no_rows_leaves_the_output():
    callers = [
        Caller(
            np.zeros((0, 2), np.float32),
            np.ones((3, 2), np.float32),
            (0, 0),
            (0, 0),
            (0, 0),
            (0, 0),
        )
        for _ in range(2)
    ]
    for got in run_standin(callers):
        np.testing.assert_array_equal(got, np.ones((3, 2)))


def test_a_wrong_receive_size_shows():
    """recv_sizes larger than what was sent: the stand-in writes zeros there, as documented
    loops would read past the slice; the mismatch is not hidden."""
    callers = _case("empty_peers", np.random.default_rng(0))
    sizes = list(callers[0].recv_sizes)
    sizes[3] += 1  # from caller 3, the last block caller 0 receives: one row more
    bad = dataclasses.replace(callers[0], recv_sizes=tuple(sizes))
    got = run_standin([bad] + callers[1:])
    right = documented(callers)
    assert not np.array_equal(got[0], right[0])


# ----------------------------------------------------------------------------- the step's geometry


def _plan(shape, **config):
    axes = tuple(f"a{i}" for i in range(len(shape)))
    topo = hep.Topology(
        levels=tuple((a,) for a in axes), mesh_axes=axes, mesh_shape=shape, platform="gpu"
    )
    e = 2 * int(np.prod(shape))
    return make_plan(topo, hep.DispatchConfig(num_experts=e, **config), tokens=16, k=4, hidden=8)


def test_buffers_are_the_padded_bound_dropless_and_tighter_with_a_capacity():
    plan = _plan((8,))
    assert ragged_steps.buffer_slots(plan, 0, 16) == (16 * 4, 8 * 16)  # min(S, K) = 4; S * M
    capped = _plan((8,), capacity_factor=1.0)  # C = L * cap = 2 * ceil(16 * 8 * 4 / 16)
    assert capped.rows == 64
    assert ragged_steps.buffer_slots(capped, 0, 16) == (64, 64)
    budget = _plan((2, 4), row_budget=40)
    held0 = 16
    send0, recv0 = ragged_steps.buffer_slots(budget, 0, held0)
    assert (send0, recv0) == (16 * 2, min(2 * 16, 40 * 4))  # 4 ranks under each node peer
    assert ragged_steps.buffer_slots(budget, 1, recv0) == (recv0 * 4, min(4 * recv0, 40))


def test_ragged_platforms():
    topo = _plan((8,)).topology
    assert ragged_steps.compiles_ragged(topo)
    assert ragged_steps.compiles_ragged(dataclasses.replace(topo, platform="tpu"))
    assert not ragged_steps.compiles_ragged(dataclasses.replace(topo, platform="cpu"))


def test_wire_rows_round_trip_bit_for_bit():
    """Every field's bits survive the wire row, NaN payloads and -0 included."""
    rng = np.random.default_rng(1)
    rows = (
        jnp.asarray(rng.normal(size=(5, 6)), jnp.bfloat16).at[0, 0].set(jnp.nan).at[1, 1].set(-0.0)
    )
    scales = jnp.asarray(rng.random((5, 2)), jnp.float32)
    dest = jnp.asarray(rng.integers(-1, 8, (5, 3)), jnp.int32)
    pos = jnp.asarray(rng.integers(-1, 99, (5, 3)), jnp.int32)
    weights = jnp.asarray(rng.random((5, 3)), jnp.float32)
    for held in (
        Items(rows, dest, pos, weights, None),
        Items(
            jax.lax.bitcast_convert_type(rows, jnp.uint16).astype(jnp.uint8),
            dest,
            pos,
            weights,
            scales,
        ),
        Items(rows.astype(jnp.float32), dest, pos, weights, scales),
    ):
        wire = ragged_steps._WireRow.of(held)
        fields = [held.rows] + ([] if held.scales is None else [held.scales])
        fields += [held.dest, held.pos, held.weights]
        words = wire.encode(fields)
        assert words.dtype == wire.word
        for a, b in zip(wire.decode(words), fields, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(
                np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)
            )
        empty = wire.decode(wire.empty(2, words))
        assert (np.asarray(empty[-3]) == -1).all() and (np.asarray(empty[-2]) == -1).all()
        assert (np.asarray(empty[-1]) == 0).all() and (np.asarray(empty[0]) == 0).all()


# ----------------------------------------------------------------------------- under jax.vmap


@pytest.mark.parametrize(
    "shape,axes", [((4,), ("ep",)), ((2, 2), ("node", "local"))], ids=["flat4", "node2_local2"]
)
@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "unweighted"])
def test_jacobians_through_ragged_levels_are_the_padded_bits(shape, axes, weighted):
    """`jax.jacrev` maps combine's and dispatch's VJPs over cotangents: the ragged levels send
    the batch as wider rows (ragged_steps._batched_as_rows), bit for bit the padded route."""
    mesh = make_mesh(shape, axes)
    topo = hep.Topology.from_mesh(mesh, axes)
    ranks, tokens, k, experts = topo.ep_size, 3, 2, 2 * topo.ep_size
    rng = np.random.default_rng(5)
    idx, w = random_routing(rng, ranks * tokens, k, experts, invalid_fraction=0.1)
    x = rng.standard_normal((ranks * tokens, 4)).astype(np.float32)

    def build(kind):
        cfg = hep.DispatchConfig(num_experts=experts)

        def step(x, idx, w):
            d = ROUTES[kind].dispatch(x, idx, w, topology=topo, config=cfg)
            y = d.tokens * 2
            if weighted:
                return hep.combine(y, d.handle, weights=d.weights)
            return hep.combine(y * d.weights[:, None], d.handle)

        f = jax.shard_map(step, mesh=mesh, in_specs=P(axes), out_specs=P(axes))
        return jax.jit(jax.jacrev(f, argnums=(0, 2)))

    same_bits_on(("xla_ragged",), build, x, idx, w)

"""The ragged level step: a level crossed by `jax.lax.ragged_all_to_all`, sending real items only.

The `xla` route's levels on GPUs and TPUs and the CUDA route's slower levels (docs/design.md
§3.2). The padded `XlaLevel` (exchange/xla_steps.py) sends every peer a static block of M slots
whatever the routing; here each rank sends each peer only the copies with a destination under it
(§2.1.1). Per level of S peers, a rank holding M items with K routing slots, C = plan.rows and
`below` ranks under each peer (the product of the faster levels' sizes):

* **Counts.** Each rank counts its copies per peer ([S] int32, from the items' destinations) and
  one `all_gather` over the level gives every rank the matrix `counts[i, p]` (copies sender i
  sends peer p): the level's only extra collective, no host sync, recorded so that combine and
  the VJPs send back without another.
* **Send buffer** `[M * min(S, K), W]`: peer-major, peer p's copies from input offset
  `sum(counts[me, :p])` in ascending item order (the padded level's slot order); an item reaches
  at most min(S, K) peers.
* **Receive buffer** `[B, W]`, `B = min(S * M, C * below)`: source-major, sender i's copies from
  `sum(counts[:i, me])`; slots past the received ones read "no item" (rows 0, dest and pos -1,
  weight 0). A received item holds a kept row in this rank's subtree that no other item holds
  (items are distinct tokens), so a subtree of `below` ranks of at most C rows each receives at
  most `C * below` items: with a capacity or a row budget B is below the padded `S * M`. The next
  level holds B items.
* **Wire row** W: payload, FP8 scales, then per k the destination, row and weight, bit-cast to
  unsigned words of the payload's width (at most 4 bytes), so each direction is one exchange per
  level and no float travels as anything but its bits: `W = H + (nb + 3K) * 4 / word` for the
  payload's H words and nb scales.

Combine, its VJP and the routing-weight gradient go back with the counts transposed (receivers
send, senders receive into their send layout): forward carries [M, H] rows to [B, H], reduce
[B, H] partials to [M * min(S, K), H] summed per held item over the peers in ascending order in
float32 (§2.1.4), pick [B, K] values back likewise. The items the next step holds differ from
the padded level's only in their slots (the padded level's order with the empty slots removed),
so rows, drops, counts, stats and every sum are the padded level's bit for bit. Under
`jax.vmap` (the VJPs mapped over cotangents, `jax.jacrev`) a batch of values crosses as one
exchange of rows that many times wider, with the same offsets.

`RaggedLevel(exchange=...)` takes the collective (`jax.lax.ragged_all_to_all`'s signature): the
op itself where XLA compiles it, and on CPU, whose XLA cannot (jaxlib 0.12.0.1: "HLO opcode
ragged-all-to-all is not supported by XLA:CPU ThunkEmitter"), the tests' pure-JAX stand-in
(tests/ragged_standin.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jax_hybridep import compat
from jax_hybridep.config import DispatchPlan
from jax_hybridep.exchange.steps import Items, LevelRecord, Shard, level_peer
from jax_hybridep.pytree import pytree_record
from jax_hybridep.topology import Topology

# Platforms whose XLA compiles `ragged_all_to_all` (XLA:CPU does not).
RAGGED_PLATFORMS = ("gpu", "tpu")


def compiles_ragged(topology: Topology) -> bool:
    """Whether the topology's platform compiles `jax.lax.ragged_all_to_all`."""
    return topology.platform in RAGGED_PLATFORMS


def slots(size: int, below: int, held: int, k: int, rows: int) -> tuple[int, int]:
    """(send slots, receive slots) of a ragged level of `size` peers with `below` ranks under
    each, whose ranks hold `held` items of `k` routing slots, C = `rows` (the module docstring):
    (held * min(S, K), min(S * held, C * below))."""
    return held * min(size, k), min(size * held, rows * below)


def buffer_slots(plan: DispatchPlan, level: int, held: int) -> tuple[int, int]:
    """`slots` of one level of the plan."""
    size, below = plan.topology.level_sizes[level], plan.topology.level_strides[level]
    return slots(size, below, held, plan.k, plan.rows)


# ----------------------------------------------------------------------------- wire rows


def _word(rows_dtype) -> np.dtype:
    """The unsigned word the wire row is made of: the payload's width, at most 4 bytes (the
    metadata's), so every field is a whole number of words."""
    return np.dtype(f"uint{8 * min(np.dtype(rows_dtype).itemsize, 4)}")


def _to_words(x, word):
    """x [N, ...] as [N, n] words, bit for bit."""
    return jax.lax.bitcast_convert_type(x, word).reshape(x.shape[0], -1)


def _from_words(w, dtype, width: int):
    """Words [N, n] back to [N, width] of dtype."""
    ratio = np.dtype(dtype).itemsize // np.dtype(w.dtype).itemsize
    if ratio == 1:
        return jax.lax.bitcast_convert_type(w, dtype)
    return jax.lax.bitcast_convert_type(w.reshape(w.shape[0], width, ratio), dtype)


@dataclasses.dataclass(frozen=True)
class _WireRow:
    """The fields of one wire row: (dtype, width) each, in order."""

    fields: tuple[tuple[np.dtype, int], ...]

    @classmethod
    def of(cls, held: Items) -> _WireRow:
        k = held.dest.shape[1]
        fields = [(held.rows.dtype, held.rows.shape[1])]
        if held.scales is not None:
            fields.append((held.scales.dtype, held.scales.shape[1]))
        fields += [(np.dtype(np.int32), k), (np.dtype(np.int32), k), (np.dtype(np.float32), k)]
        return cls(tuple((np.dtype(d), w) for d, w in fields))

    @property
    def word(self) -> np.dtype:
        return _word(self.fields[0][0])

    def encode(self, arrays):
        return jnp.concatenate([_to_words(a, self.word) for a in arrays], axis=1)

    def decode(self, words):
        out, at = [], 0
        for dtype, width in self.fields:
            n = width * dtype.itemsize // self.word.itemsize
            out.append(_from_words(words[:, at : at + n], dtype, width))
            at += n
        return out

    def empty(self, slots: int, like):
        """[slots, W] wire rows reading "no item", typed varying like `like`."""
        k = self.fields[-1][1]
        fill = [jnp.zeros((1, w), d) for d, w in self.fields[:-3]]
        fill += [jnp.full((1, k), -1, jnp.int32)] * 2 + [jnp.zeros((1, k), jnp.float32)]
        row = self.encode(fill)
        return compat.mark_varying(jnp.broadcast_to(row, (slots, row.shape[1])), _vary(like))


def _vary(x):
    return compat.varying_axes(x)


def _zeros(shape, dtype, like):
    return compat.mark_varying(jnp.zeros(shape, dtype), _vary(like))


# ----------------------------------------------------------------------------- the level


def _batched_as_rows(exchange, axis_name, operand, output, *offsets):
    """`exchange(operand, output, *offsets)`; under `jax.vmap` (combine's and dispatch's VJPs
    mapped over cotangents, e.g. `jax.jacrev`) the batch of rows travels as one exchange of rows
    `batch` times wider, with the same offsets. jax 0.12's own batching rule of
    `ragged_all_to_all` fails on offsets that are not batched (`assert x.ndim == 2` in
    `_ragged_all_to_all_batched_collective`), and the offsets here come from the dispatch, never
    batched."""
    if not (compat.is_batched(operand) or compat.is_batched(output)):
        return exchange(operand, output, *offsets, axis_name=axis_name)

    @jax.custom_batching.custom_vmap
    def one(operand, output, *offsets):
        return exchange(operand, output, *offsets, axis_name=axis_name)

    @one.def_vmap
    def rule(axis_size, in_batched, operand, output, *offsets):
        if any(in_batched[2:]):
            raise NotImplementedError("ragged levels take no offsets batched by jax.vmap")

        def wide(x, batched):  # [batch, N, ...] -> [N, batch * ...]
            x = x if batched else jnp.broadcast_to(x, (axis_size,) + x.shape)
            return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1)

        shape = output.shape[1:] if in_batched[1] else output.shape
        got = _batched_as_rows(
            exchange, axis_name, wide(operand, in_batched[0]), wide(output, in_batched[1]), *offsets
        )
        return jnp.moveaxis(got.reshape((shape[0], axis_size) + shape[1:]), 1, 0), True

    return one(operand, output, *offsets)


def _exclusive_cumsum(x, axis=0):
    return jnp.cumsum(x, axis=axis, dtype=jnp.int32) - x


@pytree_record
@dataclasses.dataclass(frozen=True)
class RaggedLevelRecord(LevelRecord):
    send_item: jax.Array  # [M * min(S, K)] int32: send-buffer slot -> the item it carries, -1
    counts: jax.Array  # [S, S] int32: copies sender i sent peer p at this level


@dataclasses.dataclass(frozen=True)
class RaggedLevel:
    """A level crossed by one ragged exchange per direction (see the module docstring).

    Attributes:
      exchange: the collective, with `jax.lax.ragged_all_to_all`'s signature.
    """

    exchange: Callable = jax.lax.ragged_all_to_all
    sends: ClassVar[str] = "ragged"  # what crosses the level (jax_hybridep/level_traffic.py)

    def _ragged(self, plan: DispatchPlan, level: int, me, counts, operand, output):
        """operand's copies (laid out by `counts[me, :]`) into output (by `counts[:, me]`):
        sender i's block for p lands on p at `sum(counts[:i, p])`."""
        return _batched_as_rows(
            self.exchange,
            plan.topology.levels[level],
            operand,
            output,
            _exclusive_cumsum(counts[me]),
            counts[me],
            _exclusive_cumsum(counts, axis=0)[me],
            counts[:, me],
        )

    def send(self, plan: DispatchPlan, level: int, shard: Shard, held: Items):
        size, stride = plan.topology.level_sizes[level], plan.topology.level_strides[level]
        items = held.dest.shape[0]
        send_slots, recv_slots = buffer_slots(plan, level, items)
        me = level_peer(plan, level, shard)[0]
        coord = jnp.where(held.dest >= 0, (held.dest // stride) % size, -1)
        to_peer = jnp.any(coord[:, :, None] == jnp.arange(size), axis=1)  # [M, S]
        send_slot = jnp.where(to_peer, jnp.cumsum(to_peer, axis=0, dtype=jnp.int32) - 1, -1)
        mine = jnp.sum(to_peer, axis=0, dtype=jnp.int32)
        counts = jax.lax.all_gather(mine, plan.topology.levels[level])  # [S, S]
        at = jnp.where(to_peer, _exclusive_cumsum(mine)[None, :] + send_slot, send_slots)
        grid = jnp.broadcast_to(jnp.arange(items, dtype=jnp.int32)[:, None], at.shape)
        send_item = jnp.full(send_slots, -1, jnp.int32).at[at].set(grid, mode="drop")
        peer_of = jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32), at.shape)
        send_peer = jnp.full(send_slots, -1, jnp.int32).at[at].set(peer_of, mode="drop")
        # Slots past the copies are never sent, so what they hold does not matter.
        item = jnp.maximum(send_item, 0)
        here = coord[item] == send_peer[:, None]  # [Q, K]: the k under the slot's peer
        fields = [held.rows[item]] + ([] if held.scales is None else [held.scales[item]])
        fields += [
            jnp.where(here, held.dest[item], -1),
            jnp.where(here, held.pos[item], -1),
            jnp.where(here, held.weights[item], 0.0),
        ]
        wire = _WireRow.of(held)
        operand = wire.encode(fields)
        received = self._ragged(plan, level, me, counts, operand, wire.empty(recv_slots, operand))
        decoded = wire.decode(received)
        scales = None if held.scales is None else decoded[1]
        dest, pos, weights = decoded[-3:]
        nxt = Items(decoded[0], dest, pos, weights, scales)
        return nxt, RaggedLevelRecord(send_slot, held.dest, send_item, counts)

    def forward(self, plan: DispatchPlan, level: int, shard: Shard, record: RaggedLevelRecord, g):
        me = level_peer(plan, level, shard)[0]
        recv_slots = buffer_slots(plan, level, g.shape[0])[1]
        operand = g[jnp.maximum(record.send_item, 0)]
        output = _zeros((recv_slots, g.shape[1]), g.dtype, operand)
        return self._ragged(plan, level, me, record.counts, operand, output)

    def _back(self, plan: DispatchPlan, level: int, me, record: RaggedLevelRecord, values):
        """values [B, ...] of the received items back into the send layout [Q, ...]."""
        output = _zeros(record.send_item.shape + values.shape[1:], values.dtype, values)
        return self._ragged(plan, level, me, record.counts.T, values, output)

    def reduce(
        self, plan: DispatchPlan, level: int, shard: Shard, record: RaggedLevelRecord, partials
    ):
        size, send_slot = plan.topology.level_sizes[level], record.send_slot
        me = level_peer(plan, level, shard)[0]
        back = self._back(plan, level, me, record, partials)
        start = _exclusive_cumsum(record.counts[me])

        def add_partial(p, acc):  # peers ascending, as the padded level adds them
            slot = send_slot[:, p]
            part = back[start[p] + jnp.maximum(slot, 0)].astype(jnp.float32)
            return jnp.where((slot >= 0)[:, None], acc + part, acc)

        zeros = _zeros((send_slot.shape[0], partials.shape[-1]), jnp.float32, back)
        return jax.lax.fori_loop(0, size, add_partial, zeros).astype(partials.dtype)

    def pick(self, plan: DispatchPlan, level: int, shard: Shard, record: RaggedLevelRecord, values):
        size, stride = plan.topology.level_sizes[level], plan.topology.level_strides[level]
        me = level_peer(plan, level, shard)[0]
        back = self._back(plan, level, me, record, values)
        held_dest = record.held_dest
        coord = jnp.where(held_dest >= 0, (held_dest // stride) % size, 0)
        slot = jnp.maximum(jnp.take_along_axis(record.send_slot, coord, axis=1), 0)
        at = _exclusive_cumsum(record.counts[me])[coord] + slot
        picked = back[at, jnp.arange(plan.k)[None, :]]
        return jnp.where(held_dest >= 0, picked, 0.0)

"""What a route's levels send and allocate, padded vs ragged (docs/design.md §3.2).

Host-side accounting (numpy and ints, not for use inside `jit`) beside `jax_hybridep.traffic`,
which counts copies and reads compiled programs. Each level step says how it crosses its level
(`sends`):

* **"padded"** (`XlaLevel`, `HostPackedLevel`): a static block of M slots to every peer whatever
  the routing, so `(S - 1) * M` slots leave each rank (its own block stays home);
* **"ragged"** (`RaggedLevel`): the real copies only, `level_rows` slots per rank (copies to
  other ranks, docs/design.md §2.1.1), plus the counts' all-gather: S int32 from each of the
  S - 1 peers;
* **"copies"** (the host's direct-write levels and the bottoms that span a level): one payload
  row per copy written into the peer (`traffic.level_bytes`; their metadata is not counted).

A slot (`slot_bytes`) is one copy's payload (`traffic.copy_bytes`: H x itemsize, or with FP8 on
the wire the payload and its block scales) plus its metadata: per k the destination EP rank and
row (int32) and the routing weight (float32), 12 K bytes. Padded and ragged levels carry the same
fields (the padded one as three or four arrays, the ragged one as one wire row).

Buffers, in slots per rank at level l, with M_0 = T and M_{l+1} the receive slots of level l:
padded send and receive `S * M`; ragged send `M * min(S, K)` and receive `min(S * M, C * below)`
(`exchange/ragged_steps.slots`; C the expert-major rows, `below` the ranks under each peer).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jax_hybridep import traffic
from jax_hybridep.exchange.ragged_steps import slots
from jax_hybridep.topology import Topology
from jax_hybridep.values import check_array, check_int, check_str, check_type

SENDS = ("padded", "ragged", "copies")
METADATA_BYTES_PER_K = 12  # destination and row (int32), routing weight (float32)
COUNT_BYTES = 4  # one int32 count per (sender, peer) in the ragged level's all-gather


def slot_bytes(hidden: int, dtype, k: int, wire_dtype: str | None = None) -> int:
    """Bytes of one slot a padded or ragged level sends: a copy's payload and its metadata."""
    check_int("k", k, 1)
    return traffic.copy_bytes(hidden, dtype, wire_dtype) + METADATA_BYTES_PER_K * k


def route_sends(route) -> tuple[str, ...]:
    """Per topology level, how `route` (an `exchange.routes.Route`) crosses it: each walked level
    step's `sends`, then "copies" for a level its bottom spans."""
    walked = tuple(step.sends for step in route.levels)
    return walked + (("copies",) if route.bottom.spans_level else ())


def _sends(sends, levels: int) -> tuple[str, ...]:
    sends = tuple(sends)
    for s in sends:
        check_str("sends", s, SENDS)
    if len(sends) != levels:
        raise ValueError(f"sends {sends} must name one kind per level ({levels} levels)")
    return sends


def buffer_slots(
    topology: Topology, sends: Sequence[str], tokens: int, k: int, rows: int
) -> list[tuple[int, int]]:
    """Per level, (send, receive) buffer slots of one rank (the module docstring); a "copies"
    level is counted as padded (the host levels receive into [S * M] buffers)."""
    topology = check_type("topology", topology, Topology, "a jax_hybridep.Topology")
    sends = _sends(sends, len(topology.levels))
    check_int("tokens", tokens, 1)
    check_int("k", k, 1)
    check_int("rows", rows, 1)
    out, held = [], tokens
    for size, below, kind in zip(topology.level_sizes, topology.level_strides, sends, strict=True):
        send, recv = (
            slots(size, below, held, k, rows) if kind == "ragged" else (size * held, size * held)
        )
        out.append((send, recv))
        held = recv
    return out


def sent_bytes(
    topology: Topology,
    sends: Sequence[str],
    copies,
    *,
    tokens: int,
    hidden: int,
    dtype,
    k: int,
    rows: int,
    wire_dtype: str | None = None,
) -> np.ndarray:
    """Bytes each rank sends to other ranks at each level, as its route's levels send them.

    Args:
      topology: the EP topology.
      sends: per level, "padded", "ragged" or "copies" (`route_sends`).
      copies: [..., levels] copies each rank sent to other ranks (`stats.level_rows`, or
        `level_copies`); padded levels do not read them.
      tokens, hidden, dtype, k, rows: T, H, x's dtype, K and C of the dispatch.
      wire_dtype: the dispatch's `wire_dtype`.

    Returns [..., levels] int64, copies' shape.
    """
    buffers = buffer_slots(topology, sends, tokens, k, rows)  # checks topology, sends, sizes
    copies = check_array("copies", copies, integer=True, lo=0, nonempty=False)
    if copies.ndim < 1 or copies.shape[-1] != len(buffers):
        raise ValueError(f"copies {copies.shape} must end in one count per level ({len(buffers)})")
    slot = slot_bytes(hidden, dtype, k, wire_dtype)
    out = np.zeros(copies.shape, np.int64)
    held = tokens
    for level, (size, kind) in enumerate(zip(topology.level_sizes, sends, strict=True)):
        if kind == "padded":
            out[..., level] = (size - 1) * held * slot
        elif kind == "ragged":
            out[..., level] = copies[..., level] * slot + (size - 1) * size * COUNT_BYTES
        else:
            out[..., level] = copies[..., level] * traffic.copy_bytes(hidden, dtype, wire_dtype)
        held = buffers[level][1]
    return out


def level_copies(dest, topology: Topology) -> np.ndarray:
    """[R, levels] int64: copies each rank sends to other ranks at each level, from the routing.

    Args:
      dest: [R, T, K] destination EP rank of each kept (source rank, t, k), -1 otherwise.
      topology: the EP topology.

    A copy of token t of source s crosses level l once per distinct destination prefix
    (coordinates of levels 0..l) whose level-l coordinate differs from the source's, as the
    tests' independent count `routed_pairs` (tests/harness.py) has it; the rank sending it holds
    the prefix's coordinates 0..l-1 and the source's from l on. Summed over ranks it is that
    count.
    """
    topology = check_type("topology", topology, Topology, "a jax_hybridep.Topology")
    dest = check_array("dest", dest, ndim=3, integer=True, lo=-1).astype(np.int64)
    ranks = topology.ep_size
    if dest.shape[0] != ranks or np.any(dest >= ranks):
        raise ValueError(f"dest {dest.shape} must hold ranks in [-1, {ranks}) per source rank")
    src = np.arange(ranks)[:, None, None]
    out = np.zeros((ranks, len(topology.levels)), np.int64)
    for level, (size, stride) in enumerate(
        zip(topology.level_sizes, topology.level_strides, strict=True)
    ):
        span = size * stride  # ranks sharing coordinates 0..l-1
        crosses = (dest >= 0) & ((dest // stride) % size != (src // stride) % size)
        prefix = np.sort(np.where(crosses, dest // stride, -1), axis=-1)
        first = (prefix >= 0) & np.concatenate(
            [np.ones(prefix.shape[:2] + (1,), bool), prefix[..., 1:] != prefix[..., :-1]], -1
        )
        sender = (prefix // size) * span + src % span
        out[:, level] = np.bincount(sender[first], minlength=ranks)
    return out

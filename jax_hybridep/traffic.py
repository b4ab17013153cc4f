"""Traffic accounting: what crosses each level, at run time and in the compiled program.

* Run time: `Dispatched.stats.level_rows [levels]` counts, per shard, the token copies it sent to
  other ranks at each level; `level_bytes` turns them into payload bytes.
* Independent count: `routed_pairs` counts, from the routing alone, the (token, destination
  group) pairs that must cross each level; summed over an EP group's shards, `level_rows` equals
  it exactly (one copy per (token, destination group), DESIGN §2.1.1).
* Program: `padded_level_bytes` is the payload a rank's static buffers move per level, and
  `collective_bytes` reads collective payload sizes out of compiled HLO text to check it.

Host-side helpers on concrete values (numpy), not for use inside `jit`.
"""

from __future__ import annotations

import math
import re

import numpy as np

from jax_hybridep.topology import Topology


def level_bytes(level_rows, hidden: int, dtype) -> np.ndarray:
    """Payload bytes per level: rows x hidden x itemsize (int64, exact)."""
    return np.asarray(level_rows, np.int64) * hidden * np.dtype(dtype).itemsize


def routed_pairs(dest, topology: Topology) -> np.ndarray:
    """[levels] int64: copies that must cross each level for one EP group.

    Args:
      dest: [R, T, K] destination EP rank of each kept (source rank, t, k), -1 otherwise.
      topology: the EP topology.

    At level l a copy of token t travels to every distinct destination prefix (coordinates of
    levels 0..l) whose level-l coordinate differs from the source's; a rank never sends to itself.
    """
    dest = np.asarray(dest)
    num_ranks, tokens, _ = dest.shape
    sizes, strides = topology.level_sizes, topology.level_strides
    counts = np.zeros(len(sizes), np.int64)
    for src in range(num_ranks):
        for t in range(tokens):
            ranks = {int(d) for d in dest[src, t] if d >= 0}
            for level, (size, stride) in enumerate(zip(sizes, strides, strict=True)):
                own = (src // stride) % size
                prefixes = {d // stride for d in ranks if (d // stride) % size != own}
                counts[level] += len(prefixes)
    return counts


def flat_pairs(dest) -> int:
    """Copies flat EP sends: one per (token, destination rank other than the source)."""
    dest = np.asarray(dest)
    return sum(
        len({int(d) for d in dest[src, t] if d >= 0 and d != src})
        for src in range(dest.shape[0])
        for t in range(dest.shape[1])
    )


def padded_level_bytes(topology: Topology, tokens: int, hidden: int, dtype) -> list[int]:
    """Payload bytes one rank's static send buffer holds per level: S_l x M_l x H x itemsize,
    with M_0 = T and M_{l+1} = S_l x M_l (every level is dropless)."""
    return padded_buffer_bytes(topology.level_sizes, tokens, hidden, np.dtype(dtype).itemsize)


def padded_buffer_bytes(level_sizes, tokens: int, hidden: int, itemsize: int) -> list[int]:
    """`padded_level_bytes` from the level sizes alone."""
    out, held = [], tokens
    for size in level_sizes:
        out.append(size * held * hidden * itemsize)
        held *= size
    return out


_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "pred": 1, "f64": 8, "s64": 8}
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
COLLECTIVES = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce")


def collective_bytes(
    hlo_text: str, op: str = "all-to-all", op_name: str | None = None
) -> list[tuple[str, int, str]]:
    """Every `op` collective in compiled HLO text: (element type, result bytes, replica groups).

    XLA may split one collective into a tuple of per-peer operands; their bytes are summed. For
    an all-gather the result is what each rank holds afterwards (its own block included).
    `op_name` keeps only instructions whose metadata op_name contains it (e.g. "shard_map").
    """
    if op not in COLLECTIVES:
        raise ValueError(f"op must be one of {COLLECTIVES}, got {op!r}")
    pattern = re.compile(
        rf"= \(?([^=]*?)\)? {op}(?:-start)?\(.*?replica_groups=(\S+(?: \{{[^}}]*\}})?)"
        r"(?:.*?op_name=\"([^\"]*)\")?"
    )
    out = []
    for result, groups, name in pattern.findall(hlo_text):
        if op_name is not None and op_name not in name:
            continue
        arrays = _ARRAY.findall(result)
        total = sum(
            math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES[kind]
            for kind, dims in arrays
        )
        out.append((arrays[0][0], total, groups))
    return out


def all_to_all_bytes(hlo_text: str) -> list[tuple[str, int, str]]:
    """`collective_bytes` of the all-to-alls."""
    return collective_bytes(hlo_text, "all-to-all")


_MESH_GROUPS = re.compile(r"mesh\[([^\]]*)\]\s*\{([^}]*)\}")


def crossing_bytes(
    hlo_text: str, axes, dtype: str | None = None, op_name: str | None = None
) -> dict[str, int]:
    """Per op, the payload bytes one rank receives in a compiled program from peers whose
    coordinate on any of `axes` differs from its own (e.g. everything crossing the "dc" level:
    axes {"dc", "dc_domain"} when that level is split into domains), counted as a direct
    exchange: all-to-all and all-gather blocks from those peers, one result-sized block from each
    for reduce-scatter, and a reduce-scatter plus an all-gather for all-reduce.

    Args:
      hlo_text: compiled HLO text.
      axes: a mesh axis name or a collection of them.
      dtype: only collectives of this HLO element type (e.g. "f32"); None counts all.
      op_name: only collectives whose op_name contains it (e.g. "shard_map": the MoE block's).

    Reads replica groups printed as `mesh['a'=2,...] {'a',...}` (how XLA prints `shard_map`
    collectives); a group printed otherwise raises ValueError rather than being miscounted.
    """
    axes = {axes} if isinstance(axes, str) else set(axes)
    out = {}
    for op in COLLECTIVES:
        total = 0
        for kind, size, groups in collective_bytes(hlo_text, op, op_name):
            match = _MESH_GROUPS.search(groups)
            if match is None:
                raise ValueError(f"cannot read the mesh axes of replica groups {groups!r}")
            sizes = {n: int(s) for n, s in re.findall(r"'(\w+)'=(\d+)", match.group(1))}
            group = re.findall(r"'(\w+)'", match.group(2))
            if (dtype is not None and kind != dtype) or not axes & set(group):
                continue
            n = math.prod(sizes[a] for a in group)
            same_side = n // math.prod(sizes[a] for a in group if a in axes)
            across = n - same_side  # peers in the group on the other side of `axes`
            if op in ("all-to-all", "all-gather"):
                total += size // n * across
            elif op == "reduce-scatter":
                total += size * across
            else:
                total += 2 * (size // n) * across
        out[op] = total
    return out

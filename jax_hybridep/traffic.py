"""Traffic accounting: what crosses each level, at run time and in the compiled program.

* Run time: `Dispatched.stats.level_rows [levels]` counts, per shard, the token copies it sent to
  other ranks at each level (one per (token, destination group), docs/design.md §2.1.1);
  `level_bytes` turns them into payload bytes.
* Program: `padded_level_bytes` is the payload a rank's static buffers move per level;
  `collectives` reads every collective (its arrays, replica groups, op_name) out of compiled HLO
  text, `collective_bytes` their sizes, and `crossing_bytes` what crosses a level, with one
  all-reduce convention (`all_reduce_bytes`) shared with the cross-DC model (`xdc.volumes`).

Helpers on concrete values (numpy), not for use inside `jit`; each checks its arguments
(ValueError/TypeError naming the argument).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable

import numpy as np

from jax_hybridep import fp8
from jax_hybridep.topology import Topology
from jax_hybridep.values import check_array, check_int, check_ints, check_str, check_type, short


def _itemsize(dtype) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        raise TypeError(f"dtype must be a numpy or jax dtype, got {short(dtype)}") from None


def _topology(topology) -> Topology:
    return check_type("topology", topology, Topology, "a jax_hybridep.Topology")


def copy_bytes(hidden: int, dtype, wire_dtype: str | None = None) -> int:
    """Bytes one token copy carries: hidden x itemsize, or with FP8 on the wire its payload and
    block scales (`jax_hybridep.fp8.wire_bytes`)."""
    hidden = check_int("hidden", hidden, 1)
    itemsize = _itemsize(dtype)
    if fp8.wire_dtype_name(wire_dtype) is not None:
        return fp8.wire_bytes(hidden)
    return hidden * itemsize


def level_bytes(level_rows, hidden: int, dtype, wire_dtype: str | None = None) -> np.ndarray:
    """Payload bytes per level: copies x copy_bytes (int64, exact)."""
    rows = check_array("level_rows", level_rows, integer=True, lo=0, nonempty=False)
    return rows * copy_bytes(hidden, dtype, wire_dtype)


def padded_level_bytes(topology: Topology, tokens: int, hidden: int, dtype) -> list[int]:
    """Payload bytes one rank's static send buffer holds per level: S_l x M_l x H x itemsize,
    with M_0 = T and M_{l+1} = S_l x M_l (every level is dropless)."""
    return padded_buffer_bytes(_topology(topology).level_sizes, tokens, hidden, _itemsize(dtype))


def padded_buffer_bytes(level_sizes, tokens: int, hidden: int, itemsize: int) -> list[int]:
    """`padded_level_bytes` from the level sizes alone."""
    level_sizes = check_ints("level_sizes", level_sizes, 1, min_len=0)  # none: nothing moves
    check_int("tokens", tokens, 0)
    check_int("hidden", hidden, 1)
    check_int("itemsize", itemsize, 1)
    out, held = [], tokens
    for size in level_sizes:
        out.append(size * held * hidden * itemsize)
        held *= size
    return out


_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "s32": 4,
    "u32": 4,
    "s64": 8,
    "u64": 8,
    "f16": 2,
    "bf16": 2,
    "f32": 4,
    "f64": 8,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
}
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
COLLECTIVES = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce")
# One instruction: `%name = <result shape> <op>(...)`. The shape is read up to the op's name, so a
# tuple's `/*index=5*/` annotations (XLA prints them from the sixth operand on) are skipped over.
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+ = (.*?) (" + "|".join(COLLECTIVES) + r")(-start)?\((.*)$",
    re.MULTILINE,
)
_GROUPS = re.compile(r"replica_groups=(\S+(?: \{[^}]*\})?)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of compiled HLO text.

    Attributes:
      op: one of `COLLECTIVES`.
      operands: (element type, shape) of each array of its result. XLA's combiner passes merge
        several collectives with the same replica groups into one with a tuple result.
      groups: the replica groups as printed.
      op_name: the metadata op_name, "" if none. A combined collective joins the op_names of
        the ops it merged with ":" (one per array, or one for all when they were equal).
    """

    op: str
    operands: tuple[tuple[str, tuple[int, ...]], ...]
    groups: str
    op_name: str

    @property
    def bytes(self) -> int:
        return sum(array_bytes(kind, shape) for kind, shape in self.operands)

    @property
    def op_names(self) -> tuple[str, ...]:
        """The op_name of each array: the ":"-joined parts when there is one per array, else the
        whole op_name for every array (then a filter on it is approximate)."""
        parts = self.op_name.split(":")
        if len(parts) != len(self.operands):
            parts = [self.op_name] * len(self.operands)
        return tuple(parts)


def array_bytes(kind: str, shape) -> int:
    """Bytes of one array of HLO element type `kind` (e.g. "f32") and `shape`."""
    if kind not in _DTYPE_BYTES:
        raise ValueError(f"unknown HLO element type {kind!r} (known: {sorted(_DTYPE_BYTES)})")
    shape = check_ints("shape", shape, 0, min_len=0)
    return math.prod(shape) * _DTYPE_BYTES[kind]


def collectives(hlo_text: str, op: str | None = None) -> list[Collective]:
    """Every collective (or every `op` collective) in compiled HLO text, in program order.

    An async `all-gather-start` prints its operands and results as one tuple; only the results
    are kept, so that every op's operands are what each rank holds afterwards.
    """
    check_str("hlo_text", hlo_text)
    if op is not None:
        check_str("op", op, COLLECTIVES)
    out = []
    for shape, kind, start, rest in _INSTRUCTION.findall(hlo_text):
        if op is not None and kind != op:
            continue
        groups = _GROUPS.search(rest)
        if groups is None:
            continue  # not a collective over replica groups (e.g. a collective-permute form)
        arrays = [
            (dtype, tuple(int(d) for d in dims.split(",") if d))
            for dtype, dims in _ARRAY.findall(shape)
        ]
        if start and kind == "all-gather":
            arrays = arrays[len(arrays) // 2 :]
        name = _OP_NAME.search(rest)
        out.append(Collective(kind, tuple(arrays), groups.group(1), name.group(1) if name else ""))
    return out


def collective_bytes(
    hlo_text: str, op: str = "all-to-all", op_name: str | None = None
) -> list[tuple[str, int, str]]:
    """Every `op` collective in compiled HLO text: (element type, result bytes, replica groups).

    XLA may split one collective into a tuple of per-peer operands, or combine several into one
    tuple; their bytes are summed (the element type is the first operand's). For an all-gather
    the result is what each rank holds afterwards (its own block included). `op_name` keeps only
    the arrays whose metadata op_name contains it (e.g. "shard_map"; `Collective.op_names`).
    """
    check_str("op", op, COLLECTIVES)
    if op_name is not None:
        check_str("op_name", op_name)
    out = []
    for c in collectives(hlo_text, op):
        kept = [
            (kind, shape)
            for (kind, shape), name in zip(c.operands, c.op_names, strict=True)
            if op_name is None or op_name in name
        ]
        if kept:
            out.append((kept[0][0], sum(array_bytes(k, s) for k, s in kept), c.groups))
    return out


def all_reduce_bytes(nbytes: int, members: int, across: int) -> int:
    """Bytes one rank receives in an all-reduce of `nbytes` over `members` ranks from the `across`
    of them on the other side of a level, counted as a direct exchange: a reduce-scatter and an
    all-gather, `nbytes / members` from each peer in each. Over one level's `S` members that is
    `2 (S - 1) / S * nbytes`, a ring's volume. The one all-reduce convention of `crossing_bytes`,
    `xdc.volumes` and `xdc.cost`."""
    check_int("nbytes", nbytes, 0)
    check_int("members", members, 1)
    check_int("across", across, 0, members - 1, what=f"an int in [0, members - 1 = {members - 1}]")
    return 2 * nbytes * across // members


def all_to_all_bytes(hlo_text: str) -> list[tuple[str, int, str]]:
    """`collective_bytes` of the all-to-alls."""
    return collective_bytes(hlo_text, "all-to-all")


_MESH_GROUPS = re.compile(r"mesh\[([^\]]*)\]\s*\{([^}]*)\}")


def crossing_bytes(
    hlo_text: str,
    axes,
    dtype: str | None = None,
    op_name: str | None = None,
    operands: Callable[[str, tuple[int, ...]], bool] | None = None,
) -> dict[str, int]:
    """Per op, the payload bytes one rank receives in a compiled program from peers whose
    coordinate on any of `axes` differs from its own (e.g. everything crossing the "dc" level:
    axes {"dc", "dc_domain"} when that level is split into domains), counted as a direct
    exchange: all-to-all and all-gather blocks from those peers, one result-sized block from each
    for reduce-scatter, and a reduce-scatter plus an all-gather for all-reduce
    (`all_reduce_bytes`).

    Args:
      hlo_text: compiled HLO text.
      axes: a mesh axis name or a collection of them.
      dtype: only arrays of this HLO element type (e.g. "f32"); None counts all.
      op_name: only arrays whose op_name contains it (e.g. "shard_map": the MoE block's own;
        per array inside a combined collective, `Collective.op_names`).
      operands: only the arrays for which `operands(element type, shape)` is true.

    Reads replica groups printed as `mesh['a'=2,...] {'a',...}` (how XLA prints `shard_map`
    collectives); a group printed otherwise raises ValueError rather than being miscounted.
    """
    check_str("hlo_text", hlo_text)
    given = axes
    axes = {axes} if isinstance(axes, str) else list(axes) if isinstance(axes, Iterable) else None
    if not axes or not all(isinstance(a, str) for a in axes):
        raise TypeError(
            f"axes must be a mesh axis name or a collection of them, got {short(given)}"
        )
    axes = set(axes)
    if dtype is not None:
        check_str("dtype", dtype, tuple(_DTYPE_BYTES))
    if op_name is not None:
        check_str("op_name", op_name)
    if operands is not None and not callable(operands):
        raise TypeError(
            f"operands must be a callable (element type, shape) -> bool or None, got "
            f"{short(operands)}"
        )
    out = {op: 0 for op in COLLECTIVES}
    for c in collectives(hlo_text):
        names = c.op_names
        if op_name is not None and not any(op_name in name for name in names):
            continue
        match = _MESH_GROUPS.search(c.groups)
        if match is None:
            raise ValueError(f"cannot read the mesh axes of replica groups {c.groups!r}")
        sizes = {n: int(s) for n, s in re.findall(r"'(\w+)'=(\d+)", match.group(1))}
        group = re.findall(r"'(\w+)'", match.group(2))
        if not axes & set(group):
            continue
        n = math.prod(sizes[a] for a in group)
        same_side = n // math.prod(sizes[a] for a in group if a in axes)
        across = n - same_side  # peers in the group on the other side of `axes`
        for (kind, shape), name in zip(c.operands, names, strict=True):
            if (
                (dtype is not None and kind != dtype)
                or (op_name is not None and op_name not in name)
                or (operands is not None and not operands(kind, shape))
            ):
                continue
            size = array_bytes(kind, shape)
            if c.op in ("all-to-all", "all-gather"):
                out[c.op] += size // n * across
            elif c.op == "reduce-scatter":
                out[c.op] += size * across
            else:
                out[c.op] += all_reduce_bytes(size, n, across)
    return out

"""Dispatch configuration and the static plan derived from it for one call (docs/design.md §2.1).

`DispatchConfig` is what users write: frozen, hashable, validated once. `DispatchPlan` adds what
only the call site knows (the topology and the per-shard shapes): EP size, local slots, capacity
and the receive-buffer row count C, and the placement tables. Every backend consumes the same
`DispatchPlan`, so they agree on every row, drop and group size.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings

import numpy as np

from jax_hybridep import _native
from jax_hybridep.fp8 import wire_dtype_name
from jax_hybridep.topology import Topology
from jax_hybridep.values import check_bool, check_int, is_real

BACKENDS = ("auto", "xla", "ffi")
BACKEND_ENV = "JAX_HYBRIDEP_BACKEND"
TIMEOUT_ENV = "JAX_HYBRIDEP_TIMEOUT_S"
# Test switch: with zero_padding=False, rows past sum(group_sizes) are filled with NaN (in the
# dispatched rows and in combine's row cotangents), so a consumer that reads them fails loudly.
POISON_ENV = "JAX_HYBRIDEP_POISON_PADDING"


@dataclasses.dataclass(frozen=True)
class DispatchConfig:
    """How tokens are routed to experts.

    Attributes:
      num_experts: E, the number of (global) experts.
      capacity_factor: f; each local expert keeps
        `round_up(ceil(f * T * EP * K / E), pad_multiple)` rows. None means dropless.
      pad_multiple: every group size is a multiple of this (padding rows are zero).
      expert_placement: optional, per expert e its (EP rank, local slot); default
        `e -> (e // E_local, e % E_local)`. Must be injective.
      num_local_slots: local expert slots per rank; default E // EP, or one more than the largest
        slot in `expert_placement`.
      backend: "auto", "xla" or "ffi"; the env var JAX_HYBRIDEP_BACKEND overrides it.
      strict: turn any dropped row or invalid expert id into a runtime error.
      timeout_s: how long a rank waits for its peers before failing with an error (ffi backend);
        the env var JAX_HYBRIDEP_TIMEOUT_S overrides it.
      row_budget: opt-in, dropless mode only (capacity_factor=None): the expert-major buffer has
        C = row_budget rows per rank instead of the worst case
        `T * EP * min(K, E_local) + E_local * (pad_multiple - 1)` (Hybrid-EP's non-blocking
        mode with a token budget). No expert has a capacity; experts fill the buffer slot after
        slot and the rows that do not fit overflow: they are dropped in the §2.1 order and
        counted in `stats.dropped` (strict mode raises), never silently. Default None: the worst
        case, which never overflows.
      num_sms: GPUs only: thread blocks (about one SM each) of every transport kernel of the
        ffi backend's CUDA path; the rest of the GPU stays free for compute running beside it.
      zero_padding: True (default): rows past sum(group_sizes) are zero, like the padding inside
        each group. False (opt-in): those rows are unspecified (may hold anything, NaN
        included; their weights stay 0) and the ffi backend does not write them, so a dropless
        buffer costs what moves, not its worst-case size; padding inside a group stays zero.
        Consumers must then use group_sizes (ragged_dot does) or mask with a select, never a
        multiply. Combine's row cotangents follow the same rule. (The xla backend may still
        write them.)
      wire_dtype: None (default): tokens travel in x's dtype. "float8_e4m3fn": each token is
        quantised once at the source to e4m3fn with one float32 scale per 128 elements of H
        (docs/design.md §2.1.8, jax_hybridep/fp8.py); payload and scales cross every level together,
        never requantised, and the receiver dequantises them into the rows (x's dtype). Every
        backend; gradients are the 16-bit path's (straight-through).
      fp8_rows: with wire_dtype: deliver the rows as FP8 payload (`d.tokens` float8_e4m3fn)
        plus `d.scales [C, ceil(H / 128)]` float32, for an FP8 grouped GEMM, instead of
        dequantising them; `dispatch` then also takes an already quantised
        `x = (q [T, H] e4m3fn, scales [T, nb] float32)`. The rows carry no gradient: one that
        needs x's cotangent through them raises TypeError while tracing, while gradients with
        respect to `topk_weights` work and equal the dequantised path's bit for bit
        (docs/errors.md).
      gpu_stream: GPUs only: the stream the transport's custom calls run on. None: XLA's compute
        stream; "collective": XLA's collective stream, scheduled like its own collectives so
        compute overlaps them (needs an XLA that knows the annotation); an int n >= 1: XLA's
        extra stream n (`compute_on("gpu_stream:n")`). Exchanges of one shape share one
        window: give every call site of a shape the same stream.
    """

    num_experts: int
    capacity_factor: float | None = None
    pad_multiple: int = 1
    expert_placement: tuple[tuple[int, int], ...] | None = None
    num_local_slots: int | None = None
    backend: str = "auto"
    strict: bool = False
    timeout_s: float = 120.0
    row_budget: int | None = None
    num_sms: int = 16
    gpu_stream: str | int | None = None
    zero_padding: bool = True
    wire_dtype: str | None = None
    fp8_rows: bool = False

    def __post_init__(self):
        self._set("num_experts", check_int("num_experts", self.num_experts, 1))
        if self.capacity_factor is not None:
            f = self.capacity_factor
            if not is_real(f) or not math.isfinite(f) or not f > 0:
                raise ValueError(
                    f"capacity_factor must be a finite number > 0 or None (dropless), got {f!r}"
                )
            self._set("capacity_factor", float(f))
        self._set("pad_multiple", check_int("pad_multiple", self.pad_multiple, 1))
        if not isinstance(self.backend, str) or self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        self._set("strict", check_bool("strict", self.strict))
        self._set("zero_padding", check_bool("zero_padding", self.zero_padding))
        self._set("wire_dtype", wire_dtype_name(self.wire_dtype))
        self._set("fp8_rows", check_bool("fp8_rows", self.fp8_rows))
        if self.fp8_rows and self.wire_dtype is None:
            raise ValueError("fp8_rows=True needs wire_dtype='float8_e4m3fn' (FP8 on the wire)")
        self._set("timeout_s", _timeout("timeout_s", self.timeout_s))
        if self.row_budget is not None:
            budget = check_int("row_budget", self.row_budget, 1, what="an int >= 1 or None")
            self._set("row_budget", budget)
            if self.capacity_factor is not None:
                raise ValueError(
                    f"row_budget={self.row_budget} is for dropless mode only; it cannot be "
                    f"combined with capacity_factor={self.capacity_factor} (a capacity already "
                    "bounds the buffer)"
                )
        self._set("num_sms", check_int("num_sms", self.num_sms, 1, _max_send_blocks()))
        stream = self.gpu_stream
        if not (
            stream is None
            or stream == "collective"
            or (
                isinstance(stream, int | np.integer)
                and not isinstance(stream, bool)
                and stream >= 1
            )
        ):
            raise ValueError(
                f"gpu_stream must be None, 'collective' or an int >= 1, got {stream!r}"
            )
        if self.num_local_slots is not None:
            self._set("num_local_slots", check_int("num_local_slots", self.num_local_slots, 1))
        if self.expert_placement is not None:
            self._set("expert_placement", _placement(self.expert_placement, self.num_experts))

    def _set(self, name, value):
        object.__setattr__(self, name, value)

    @property
    def poison_padding(self) -> bool:
        """Whether rows past sum(group_sizes) get NaN (zero_padding=False and the test switch
        JAX_HYBRIDEP_POISON_PADDING=1)."""
        raw = os.environ.get(POISON_ENV, "0")
        if raw not in ("0", "1"):
            raise ValueError(f"{POISON_ENV}={raw!r}; expected 0 or 1")
        return not self.zero_padding and raw == "1"

    @property
    def resolved_timeout_s(self) -> float:
        """timeout_s, or the env var JAX_HYBRIDEP_TIMEOUT_S when it is set (checked alike)."""
        raw = os.environ.get(TIMEOUT_ENV)
        if raw is None:
            return self.timeout_s
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(
                f"{TIMEOUT_ENV}={raw!r} is not a number of seconds (e.g. {TIMEOUT_ENV}=60)"
            ) from None
        return _timeout(TIMEOUT_ENV, value)


# Longest wait a config or JAX_HYBRIDEP_TIMEOUT_S may set (its milliseconds must fit an int64).
MAX_TIMEOUT_S = 1e7


def _max_send_blocks() -> int | None:
    """The transport's block limit (num_sms) as the native module states it; None without the
    module (nothing native then runs, so num_sms only has to be >= 1)."""
    return _native.limits()["max_send_blocks"] if _native.available() else None


def _timeout(name: str, value) -> float:
    if not is_real(value) or not 0 < value <= MAX_TIMEOUT_S:
        raise ValueError(
            f"{name} must be a number of seconds in (0, {MAX_TIMEOUT_S:g}] (how long a rank waits "
            f"for its peers before failing), got {value!r}"
        )
    return float(value)


def _placement(placement, num_experts: int) -> tuple[tuple[int, int], ...]:
    """expert_placement as int pairs, checked: one (rank, slot) per expert, injective."""
    try:
        pairs = [tuple(entry) for entry in placement]
    except TypeError:
        raise ValueError(
            f"expert_placement must be a sequence of (rank, slot) pairs, got {placement!r}"
        ) from None
    if any(len(p) != 2 for p in pairs):
        raise ValueError(f"expert_placement entries must be (rank, slot) pairs, got {placement!r}")
    bad = [
        p
        for p in pairs
        if not all(
            isinstance(v, int | np.integer) and not isinstance(v, bool | np.bool_) for v in p
        )
    ]
    if bad:
        raise ValueError(f"expert_placement entries must be int pairs, got {bad[:4]}")
    pairs = [(int(r), int(s)) for r, s in pairs]
    if len(pairs) != num_experts:
        raise ValueError(f"expert_placement has {len(pairs)} entries for num_experts={num_experts}")
    if any(r < 0 or s < 0 for r, s in pairs):
        raise ValueError(f"expert_placement has negative ranks or slots: {tuple(pairs)}")
    if len(set(pairs)) != len(pairs):
        raise ValueError(f"expert_placement maps two experts to one (rank, slot): {tuple(pairs)}")
    return tuple(pairs)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class DispatchPlan:
    """Static geometry of one dispatch call on one EP group (identical on every rank).

    Attributes:
      topology, config: what the call was given.
      tokens, k: T and K per shard.
      hidden, row_dtype: H and the dtype of the rows dispatch delivers (x's; None when not known).
      ep_size: R, the ranks of the EP group.
      num_slots: L, local expert slots per rank.
      capacity: rows kept per local expert, or None (dropless).
      rows: C, rows of the expert-major buffer.
      expert_rank, expert_slot: placement tables, per expert.
    """

    topology: Topology
    config: DispatchConfig
    tokens: int
    k: int
    hidden: int | None
    row_dtype: str | None
    ep_size: int
    num_slots: int
    capacity: int | None
    rows: int
    expert_rank: tuple[int, ...]
    expert_slot: tuple[int, ...]

    @property
    def num_experts(self) -> int:
        return self.config.num_experts

    @property
    def slot_expert(self) -> np.ndarray:
        """[R, L] int32: the expert in each (rank, slot), -1 where empty."""
        table = np.full((self.ep_size, self.num_slots), -1, np.int32)
        table[list(self.expert_rank), list(self.expert_slot)] = np.arange(self.num_experts)
        return table


# Row indices are int32 everywhere (row_pos, group sizes, the handlers' buffers).
_MAX_ROWS = 2**31 - 1


def _warn_clamped(setting: str, result: str) -> None:
    warnings.warn(
        f"jax_hybridep: {setting} asks for more rows than any expert or rank can receive; "
        f"clamped to {result} (the same rows and drops, a smaller buffer)",
        stacklevel=4,
    )


def make_plan(
    topology: Topology,
    config: DispatchConfig,
    tokens: int,
    k: int,
    hidden: int | None = None,
    row_dtype: str | None = None,
) -> DispatchPlan:
    """Derives the static plan; raises ValueError naming the offending values."""
    num_ranks, num_experts = topology.ep_size, config.num_experts
    if k > num_experts:
        raise ValueError(f"topk_idx has K={k} columns but there are only num_experts={num_experts}")
    if config.expert_placement is None:
        if num_experts % num_ranks:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by the EP size {num_ranks} "
                f"(EP axes {topology.ep_axes}); pass expert_placement for an uneven placement"
            )
        per_rank = num_experts // num_ranks
        num_slots = config.num_local_slots or per_rank
        if num_slots < per_rank:
            raise ValueError(f"num_local_slots={num_slots} < num_experts / EP size = {per_rank}")
        expert_rank = tuple(e // per_rank for e in range(num_experts))
        expert_slot = tuple(e % per_rank for e in range(num_experts))
    else:
        expert_rank = tuple(r for r, _ in config.expert_placement)
        expert_slot = tuple(s for _, s in config.expert_placement)
        num_slots = config.num_local_slots or max(expert_slot) + 1
        if max(expert_rank) >= num_ranks:
            raise ValueError(
                f"expert_placement names EP rank {max(expert_rank)} but the EP size is {num_ranks}"
            )
        if max(expert_slot) >= num_slots:
            raise ValueError(
                f"expert_placement names slot {max(expert_slot)} but num_local_slots={num_slots}"
            )
    pad = config.pad_multiple
    # No expert can receive more than T * EP * K rows, nor a rank more than that plus each
    # group's padding: larger capacities or budgets change no row or drop, only the buffer, so
    # they are clamped to these bounds (with a warning).
    most_per_expert = tokens * num_ranks * k
    most_per_rank = most_per_expert + num_slots * (pad - 1)
    if config.capacity_factor is None:
        capacity = None
        rows = tokens * num_ranks * min(k, num_slots) + num_slots * (pad - 1)
        if config.row_budget is not None:  # opt-in: overflow is dropped and counted
            rows = min(config.row_budget, most_per_rank)
            if rows < config.row_budget:
                _warn_clamped(f"row_budget={config.row_budget}", f"C={rows} rows per rank")
    else:
        # The factor may be huge: bound it before rounding (no overflow to inf).
        wanted = config.capacity_factor * tokens * num_ranks * k / num_experts  # §2.1.3
        capacity = round_up(math.ceil(min(wanted, most_per_expert)), pad)
        rows = min(num_slots * capacity, most_per_rank)
        if wanted > most_per_expert:
            _warn_clamped(
                f"capacity_factor={config.capacity_factor} (over {most_per_expert} rows per "
                "local expert)",
                f"capacity {capacity} rows per local expert and C={rows}",
            )
    if rows > _MAX_ROWS:
        raise ValueError(
            f"the expert-major buffer would need C={rows} rows per rank (T={tokens}, EP size "
            f"{num_ranks}, K={k}, {num_slots} local slots, capacity "
            f"{'dropless' if capacity is None else capacity}), more than the {_MAX_ROWS} an int32 "
            "row index reaches; lower capacity_factor or set row_budget"
        )
    return DispatchPlan(
        topology=topology,
        config=config,
        tokens=tokens,
        k=k,
        hidden=hidden,
        row_dtype=row_dtype,
        ep_size=num_ranks,
        num_slots=num_slots,
        capacity=capacity,
        rows=rows,
        expert_rank=expert_rank,
        expert_slot=expert_slot,
    )

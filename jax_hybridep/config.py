"""Dispatch configuration and the static plan derived from it for one call (DESIGN §2.1).

`DispatchConfig` is what users write: frozen, hashable, validated once. `DispatchPlan` adds what
only the call site knows (the topology and the per-shard shapes): EP size, local slots, capacity
and the receive-buffer row count C, and the placement tables. Every backend consumes the same
`DispatchPlan`, so they agree on every row, drop and group size.
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

from jax_hybridep.topology import Topology

BACKENDS = ("auto", "xla", "ffi")
BACKEND_ENV = "JAX_HYBRIDEP_BACKEND"
TIMEOUT_ENV = "JAX_HYBRIDEP_TIMEOUT_S"
MAX_SMS = 256  # xla_ffi/limits.h: kMaxSendBlocks (tests/native_test.py checks it)


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
      gpu_stream: GPUs only: the stream the transport's custom calls run on. None: XLA's compute
        stream; "collective": XLA's collective stream, scheduled like its own collectives so
        compute overlaps them (needs an XLA that knows the annotation); an int n >= 1: XLA's
        extra stream n (`compute_on("gpu_stream:n")`).
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

    def __post_init__(self):
        if not isinstance(self.num_experts, int | np.integer) or self.num_experts < 1:
            raise ValueError(f"num_experts must be a positive int, got {self.num_experts!r}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(
                f"capacity_factor must be > 0 or None (dropless), got {self.capacity_factor!r}"
            )
        if not isinstance(self.pad_multiple, int | np.integer) or self.pad_multiple < 1:
            raise ValueError(f"pad_multiple must be an int >= 1, got {self.pad_multiple!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if self.row_budget is not None:
            integer = isinstance(self.row_budget, int | np.integer)
            if not integer or isinstance(self.row_budget, bool) or self.row_budget < 1:
                raise ValueError(f"row_budget must be an int >= 1 or None, got {self.row_budget!r}")
            if self.capacity_factor is not None:
                raise ValueError(
                    f"row_budget={self.row_budget} is for dropless mode only; it cannot be "
                    f"combined with capacity_factor={self.capacity_factor} (a capacity already "
                    "bounds the buffer)"
                )
        if not isinstance(self.num_sms, int | np.integer) or not 1 <= self.num_sms <= MAX_SMS:
            raise ValueError(f"num_sms must be an int in [1, {MAX_SMS}], got {self.num_sms!r}")
        stream = self.gpu_stream
        if not (stream is None or stream == "collective" or (
            isinstance(stream, int | np.integer) and not isinstance(stream, bool) and stream >= 1
        )):  # fmt: skip
            raise ValueError(
                f"gpu_stream must be None, 'collective' or an int >= 1, got {stream!r}"
            )
        if self.num_local_slots is not None and self.num_local_slots < 1:
            raise ValueError(f"num_local_slots must be >= 1, got {self.num_local_slots!r}")
        if self.expert_placement is not None:
            placement = tuple((int(r), int(s)) for r, s in self.expert_placement)
            object.__setattr__(self, "expert_placement", placement)
            if len(placement) != self.num_experts:
                raise ValueError(
                    f"expert_placement has {len(placement)} entries for "
                    f"num_experts={self.num_experts}"
                )
            if any(r < 0 or s < 0 for r, s in placement):
                raise ValueError(f"expert_placement has negative ranks or slots: {placement}")
            if len(set(placement)) != len(placement):
                raise ValueError(
                    f"expert_placement maps two experts to one (rank, slot): {placement}"
                )

    @property
    def resolved_timeout_s(self) -> float:
        return float(os.environ.get(TIMEOUT_ENV, self.timeout_s))


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class DispatchPlan:
    """Static geometry of one dispatch call on one EP group (identical on every rank).

    Attributes:
      topology, config: what the call was given.
      tokens, k: T and K per shard.
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


def make_plan(topology: Topology, config: DispatchConfig, tokens: int, k: int) -> DispatchPlan:
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
    if config.capacity_factor is None:
        capacity = None
        rows = tokens * num_ranks * min(k, num_slots) + num_slots * (pad - 1)
        if config.row_budget is not None:  # opt-in: overflow is dropped and counted
            rows = int(config.row_budget)
    else:
        capacity = round_up(
            math.ceil(config.capacity_factor * tokens * num_ranks * k / num_experts), pad
        )
        rows = num_slots * capacity
    return DispatchPlan(
        topology=topology,
        config=config,
        tokens=tokens,
        k=k,
        ep_size=num_ranks,
        num_slots=num_slots,
        capacity=capacity,
        rows=rows,
        expert_rank=expert_rank,
        expert_slot=expert_slot,
    )

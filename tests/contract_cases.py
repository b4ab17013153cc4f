"""The contract suite's rows (tests/contract_test.py): the routings, the cases (a mesh, its EP
levels, a `DispatchConfig` at fixed small shapes) and each case's inputs, model view and mesh.

Adding a case is one entry of `CASES`; adding a routing one entry of `ROUTINGS` (and a case that
runs it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import zlib

import jax.numpy as jnp
import numpy as np
from harness import PlanView, make_mesh, random_routing

import jax_hybridep as hep

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
    "flat4_dropless": _case(
        *FLAT4,
        routings=(
            "random",
            "all_minus_one",
            "invalid_ids",
            "ranks_receive_nothing",
            "all_to_one_expert",
        ),
    ),
    "flat4_pad4": _case(*FLAT4, pad_multiple=4, routings=("random", "duplicates_in_a_row")),
    "flat4_capacity_placed": _case(
        *FLAT4,
        capacity_factor=1.0,
        expert_placement=REVERSED,
        routings=("random", "hot", "all_to_one_expert", "one_hot_rank_of_sources", "balanced"),
    ),
    "flat4_low_capacity_pad2_unweighted": _case(
        *FLAT4, capacity_factor=0.5, pad_multiple=2, weighted=False, routings=("random", "hot")
    ),
    "flat4_k_equals_e_one_token": _case(
        *FLAT4, experts_per_rank=1, tokens=1, k=4, routings=("random", "duplicates_in_a_row")
    ),
    "ep1": _case((1,), ("ep",), experts_per_rank=4, routings=("random", "hot")),
    "ep16_capacity": _case((16,), ("ep",), capacity_factor=1.0),
    "flat8_bf16_capacity_pad4": _case(
        *FLAT8,
        capacity_factor=0.75,
        pad_multiple=4,
        k=4,
        dtype="bfloat16",
        routings=("random", "invalid_ids"),
    ),
    "flat8_f16": _case(*FLAT8, dtype="float16", routings=("random", "all_to_one_expert")),
    # The opt-in row budget: a dropless buffer smaller than the worst case, overflow dropped.
    "flat4_row_budget": _case(*FLAT4, tokens=8, row_budget=20, routings=("hot", "random")),
    # Groups of mesh axes: one level over two axes, two EP groups beside a data axis.
    "one_level_two_axes": _case((2, 4), ("x", "y"), (("x", "y"),)),
    "data_groups_capacity": _case(
        (2, 4), ("data", "ep"), ("ep",), capacity_factor=1.0, routings=("second_half_hot", "random")
    ),
    # Several levels: rows, drops and order as flat EP; one copy per destination group.
    "node2_local4": _case(
        *NODE2_LOCAL4,
        routings=("random", "all_to_one_expert", "one_remote_half", "duplicates_in_a_row"),
    ),
    "node2_local4_capacity_unweighted": _case(
        *NODE2_LOCAL4, capacity_factor=1.0, k=4, weighted=False, routings=("random", "hot")
    ),
    "node4_local2_capacity": _case(
        *NODE4_LOCAL2, capacity_factor=1.0, routings=("random", "all_minus_one")
    ),
    "node2_local2_row_budget_pad4": _case(
        (2, 2), ("node", "local"), tokens=8, row_budget=24, pad_multiple=4, routings=("hot",)
    ),
    "dc2_node2_local2_bf16": _case(
        *DC2_NODE2_LOCAL2, dtype="bfloat16", routings=("random", "one_remote_half")
    ),
    "dc2_node2_local2_capacity_pad2": _case(*DC2_NODE2_LOCAL2, capacity_factor=1.0, pad_multiple=2),
    "dc2_node2_local4_capacity": _case(
        (2, 2, 4), ("dc", "node", "local"), capacity_factor=1.0, k=4
    ),
    "level_over_two_axes": _case((2, 2, 2), ("node", "x", "y"), ("node", ("x", "y"))),
    # zero_padding=False: rows past the groups poisoned with NaN change no value or gradient.
    "flat4_pad4_poisoned": _case(
        *FLAT4,
        pad_multiple=4,
        zero_padding=False,
        poison=True,
        same_as="flat4_pad4",
        routings=("random", "duplicates_in_a_row"),
    ),
    "node2_local4_capacity_unweighted_poisoned": _case(
        *NODE2_LOCAL4,
        capacity_factor=1.0,
        k=4,
        weighted=False,
        zero_padding=False,
        poison=True,
        same_as="node2_local4_capacity_unweighted",
    ),
    "dc2_node2_local2_capacity_pad2_poisoned": _case(
        *DC2_NODE2_LOCAL2,
        capacity_factor=1.0,
        pad_multiple=2,
        zero_padding=False,
        poison=True,
        same_as="dc2_node2_local2_capacity_pad2",
    ),
    # FP8 on the wire: rows are the 16-bit dispatch of the dequantised tokens; straight-through.
    "node2_local4_fp8": _case(*NODE2_LOCAL4, wire_dtype=FP8, dtype="bfloat16"),
    "flat8_fp8_capacity": _case(*FLAT8, wire_dtype=FP8, capacity_factor=1.0),
}


@contextlib.contextmanager
def poisoned(on: bool):
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


def mesh_topology(case):
    mesh = make_mesh(case.shape, case.axes)
    return mesh, hep.Topology.from_mesh(mesh, case.levels or case.axes)


def plan_view(case):
    """The PlanView of §2.1.3 for one EP group of the case."""
    fields = case.fields
    view = PlanView(
        case.num_experts,
        case.ep,
        case.tokens,
        case.k,
        fields.get("capacity_factor"),
        fields.get("pad_multiple", 1),
        fields.get("expert_placement"),
    )
    if fields.get("row_budget") is not None:
        view.rows = fields["row_budget"]
    return view


def inputs(case, routing):
    """(x, idx, w, experts [E, H, F] logical, cot); the same for cases of the same shapes."""
    n, e, k = int(np.prod(case.shape)) * case.tokens, case.num_experts, case.k
    rng = np.random.default_rng([zlib.crc32(routing.encode()), n, e, k])
    idx = np.asarray(ROUTINGS[routing](rng, n, k, e), np.int32)
    w = rng.random((n, k)).astype(np.float32)
    x = jnp.asarray(rng.normal(size=(n, H)), case.dtype)
    experts = jnp.asarray(rng.normal(size=(e, H, F)) / np.sqrt(H), case.dtype)
    cot = rng.normal(size=(n, F)).astype(np.float32)
    return x, idx, w, experts, cot


def stored_experts(case, experts):
    """Expert weights in (rank, slot) order, as the placement stores them."""
    view = plan_view(case)
    order = np.argsort(np.asarray(view.expert_rank) * view.num_slots + view.expert_slot)
    return experts[order], order

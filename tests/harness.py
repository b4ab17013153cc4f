"""Shared test machinery: meshes, a sharded MoE step, and an independent numpy model of §2.1
(the layout, the rows, and the copies per level: `routed_pairs`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jax_hybridep as hep
from jax_hybridep.ops import dispatch_with_route

# The backends every backend-comparing test runs (the `backend` fixture of conftest.py too).
BACKENDS = ("xla", "ffi")


def make_mesh(shape, names):
    devices = np.asarray(jax.devices()[: math.prod(shape)]).reshape(shape)
    return jax.sharding.Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


def local_experts(tokens, group_sizes, w_local):
    """Each row times its local expert's matrix (CPU path: no ragged_dot); padding rows give 0.

    Rows outside every group are masked by a select before they are read, so padding that holds
    NaN (zero_padding=False under JAX_HYBRIDEP_POISON_PADDING=1) reaches no value or gradient,
    as with ragged_dot."""
    ends = jnp.cumsum(group_sizes)
    expert = jnp.searchsorted(ends, jnp.arange(tokens.shape[0]), side="right")
    in_group = (expert < w_local.shape[0])[:, None]
    rows = jnp.where(in_group, tokens, 0).astype(jnp.float32)
    expert = jnp.minimum(expert, w_local.shape[0] - 1)
    y = jnp.einsum("ch,chf->cf", rows, w_local[expert].astype(jnp.float32))
    return jnp.where(in_group, y, 0).astype(tokens.dtype)


def all_axes_spec(mesh):
    return P(tuple(mesh.axis_names))


def moe_fn(mesh, topo, cfg, *, weighted_combine=True, expert_weights_spec=None, route=None):
    """jit(shard_map(...)) of dispatch -> local experts -> combine over all mesh axes.

    Inputs are global [N, ...] arrays sharded over every mesh axis (row-major device order);
    expert weights [E, H, F] are sharded over the EP axes (replicated over the others). `route`:
    an explicit exchange route (default: the one cfg.backend selects).
    Returns (out [N, F], dispatched pytree stacked per shard).
    """
    spec = all_axes_spec(mesh)
    w_spec = expert_weights_spec or P(topo.ep_axes)

    def step(x, idx, w, experts):
        d = dispatch_with_route(route, x, idx, w, topology=topo, config=cfg)
        y = local_experts(d.tokens, d.group_sizes, experts)
        if weighted_combine:
            out = hep.combine(y, d.handle, weights=d.weights)
        else:
            out = hep.combine(y * d.weights[:, None].astype(y.dtype), d.handle)
        stacked = jax.tree.map(
            lambda a: a[None], (d.tokens, d.weights, d.group_sizes, d.kept, d.stats)
        )
        return out, stacked

    return jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(spec, spec, spec, w_spec), out_specs=(spec, spec))
    )


def random_routing(rng, n, k, num_experts, invalid_fraction=0.0):
    idx = np.stack([rng.permutation(num_experts)[:k] for _ in range(n)]).astype(np.int32)
    if invalid_fraction:
        mask = rng.random(idx.shape) < invalid_fraction
        idx[mask] = rng.choice([-1, -2, num_experts, num_experts + 3], size=mask.sum())
    weights = rng.random((n, k)).astype(np.float32)
    return idx, weights


def routed_pairs(dest, topology: hep.Topology) -> np.ndarray:
    """[levels] int64: copies that must cross each level for one EP group, counted from the
    routing alone (the independent count `level_rows` is held to, docs/design.md §2.1.1).

    dest: [R, T, K] destination EP rank of each kept (source rank, t, k), -1 otherwise. At level
    l a copy of token t travels to every distinct destination prefix (coordinates of levels
    0..l) whose level-l coordinate differs from the source's; a rank never sends to itself.
    """
    dest = np.asarray(dest)
    num_ranks, tokens, _ = dest.shape
    assert num_ranks == topology.ep_size and np.all(dest < num_ranks), (dest.shape, topology)
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
    """Copies flat EP sends: one per (token, destination rank other than the source), for
    dest [R, T, K] as in `routed_pairs`."""
    dest = np.asarray(dest)
    return sum(
        len({int(d) for d in dest[src, t] if d >= 0 and d != src})
        for src in range(dest.shape[0])
        for t in range(dest.shape[1])
    )


def reference_layout(idx, num_ranks, plan_like):
    """Independent model of docs/design.md §2.1 for one EP group.

    Args:
      idx: [R, T, K] expert ids per source rank.
      plan_like: object with num_experts, num_slots, capacity (None = dropless), rows, pad,
        expert_rank, expert_slot.

    Returns: dict with row_pos [R, T, K] ((dest, row) flattened as row, -1 if none), dest
      [R, T, K], group_sizes [R, L], dropped [R], invalid [R], tokens_per_expert [E].
    """
    p = plan_like
    R, T, K = idx.shape
    rows_of = {e: [] for e in range(p.num_experts)}
    invalid = np.zeros(R, np.int64)
    for s in range(R):
        for t in range(T):
            for k in range(K):
                e = int(idx[s, t, k])
                if 0 <= e < p.num_experts:
                    rows_of[e].append((s, t, k))
                elif e != -1:
                    invalid[s] += 1
    row_pos = np.full((R, T, K), -1, np.int64)
    dest = np.full((R, T, K), -1, np.int64)
    group_sizes = np.zeros((num_ranks, p.num_slots), np.int64)
    slot_expert = {(p.expert_rank[e], p.expert_slot[e]): e for e in range(p.num_experts)}
    for r in range(num_ranks):
        offset = 0
        for s in range(p.num_slots):
            e = slot_expert.get((r, s))
            rows = rows_of[e] if e is not None else []
            room = (p.rows - offset) // p.pad * p.pad
            kept = min(len(rows), room, p.capacity if p.capacity is not None else len(rows))
            for i, (src, t, k) in enumerate(rows[:kept]):
                row_pos[src, t, k] = offset + i
                dest[src, t, k] = r
            size = -(-kept // p.pad) * p.pad
            group_sizes[r, s] = size
            offset += size
    valid = (idx >= 0) & (idx < p.num_experts)
    dropped = np.sum(valid & (row_pos < 0), axis=(1, 2))
    tokens_per_expert = np.array([len(rows_of[e]) for e in range(p.num_experts)])
    return dict(
        row_pos=row_pos,
        dest=dest,
        group_sizes=group_sizes,
        dropped=dropped,
        invalid=invalid,
        tokens_per_expert=tokens_per_expert,
    )


class PlanView:
    """The numbers reference_layout needs, computed from the formulas of docs/design.md §2.1.3."""

    def __init__(
        self,
        num_experts,
        num_ranks,
        tokens,
        k,
        capacity_factor=None,
        pad=1,
        placement=None,
        num_slots=None,
    ):
        self.num_experts, self.pad = num_experts, pad
        if placement is None:
            per = num_experts // num_ranks
            placement = [(e // per, e % per) for e in range(num_experts)]
        self.expert_rank = [r for r, _ in placement]
        self.expert_slot = [s for _, s in placement]
        self.num_slots = num_slots or max(self.expert_slot) + 1
        L = self.num_slots
        if capacity_factor is None:
            self.capacity = None
            self.rows = tokens * num_ranks * min(k, L) + L * (pad - 1)
        else:
            cap = math.ceil(capacity_factor * tokens * num_ranks * k / num_experts)
            self.capacity = -(-cap // pad) * pad
            self.rows = L * self.capacity


def expected_rows(x, w, idx, layout, num_ranks, rows, hidden_dtype):
    """Per destination rank: the tokens [C, H] and weights [C] §2.1 prescribes."""
    R, T, K = idx.shape
    tokens = np.zeros((num_ranks, rows, x.shape[-1]), hidden_dtype)
    weights = np.zeros((num_ranks, rows), np.float32)
    for s in range(R):
        for t in range(T):
            for k in range(K):
                pos = layout["row_pos"][s, t, k]
                if pos >= 0:
                    d = layout["dest"][s, t, k]
                    tokens[d, pos] = x[s, t]
                    weights[d, pos] = w[s, t, k]
    return tokens, weights

"""Moving stored expert weights, and the optimiser state shaped like them, to a new placement.

A re-placement permutes the expert dim of every replicated block's stacked weights
(`placement.permutation`); Adam's moments (any optax state shaped like the parameters) move
with them, so training continues as if nothing had moved. Leaves are tagged with the index of
their block (`expert_tags`) so one pass moves every block's weights with its own permutation.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from jax_hybridep.balance.placement import Placement
from jax_hybridep.values import check_array, is_int, short

NOT_EXPERT = -1


def _names(key_path) -> tuple:
    parts = []
    for key in key_path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(getattr(key, attr))
                break
    return tuple(parts[:-1] if parts and parts[-1] == "value" else parts)


def expert_tags(model, params) -> tuple[object, list]:
    """(tags, blocks): `blocks` are the modules of the Flax NNX `model` that hold a replica
    `placement` (e.g. `nn.MoEBlock(redundant_slots=...)`), in graph order; `tags` is shaped like
    `params` (`nnx.split(model, nnx.Param, ...)[1]`) with, per leaf, the index in `blocks` of
    the block whose stored expert weights it is, or NOT_EXPERT."""
    from flax import nnx  # noqa: PLC0415  (the placement layers need no Flax)

    blocks, index = [], {}
    for path, node in nnx.iter_graph(model):
        if isinstance(getattr(node, "placement", None), Placement):
            for name in node.EXPERT_WEIGHTS:
                index[tuple(path) + (name,)] = len(blocks)
            blocks.append(node)
    tags = jax.tree_util.tree_map_with_path(
        lambda path, _: index.get(_names(path), NOT_EXPERT), params
    )
    return tags, blocks


def permute(leaf, perm):
    """`leaf[perm]` (along the first dim), keeping its sharding; `perm` None: leaf. `perm` must
    be a permutation of range(leaf.shape[0]) (an index out of range would be clamped)."""
    if perm is None:
        return leaf
    perm = check_array("perm", perm, ndim=1, integer=True, nonempty=False)
    if np.ndim(leaf) == 0 or leaf.shape[0] != perm.size:
        raise ValueError(f"cannot move {np.shape(leaf)} expert weights with {perm.size} indices")
    if not np.array_equal(np.sort(perm), np.arange(perm.size)):
        raise ValueError(f"perm must be a permutation of 0..{perm.size - 1}, got {short(perm)}")
    sharding = getattr(leaf, "sharding", None)
    move = jax.jit(lambda a: a[perm], out_shardings=sharding)
    return move(leaf)


def move_experts(tree, tags, perms: Sequence[np.ndarray | None], *, tx=None):
    """`tree` with every tagged leaf permuted along its first dim by `perms[tag]` (None: left
    as is), sharding kept. With `tx` (the optax transformation), `tree` is its state and the
    parameter-shaped parts of it move (`optax.tree_map_params`)."""
    if isinstance(perms, str) or not isinstance(perms, Sequence):
        raise TypeError(f"perms must be a sequence (one per block, or None), got {short(perms)}")
    used = [t for t in jax.tree.leaves(tags) if t != NOT_EXPERT]
    bad = sorted({t for t in used if not is_int(t) or not 0 <= t < len(perms)}, key=str)
    if bad:
        raise ValueError(
            f"tags name blocks {bad[:8]} but perms has {len(perms)} entries (expert_tags' "
            "blocks, in order)"
        )

    def move(leaf, tag):
        return leaf if tag == NOT_EXPERT else permute(leaf, perms[tag])

    if tx is None:
        return jax.tree.map(move, tree, tags)
    import optax  # noqa: PLC0415

    return optax.tree_map_params(tx, move, tree, tags)

"""Where expert replicas live under per-level domains (numpy, shared by the runtime
`domains.ExpertDomains` and the byte model `volumes`, so both follow one rule).

Level sizes `G_l` slow -> fast, domain sizes `S_l | G_l`: a rank's coordinate `c_l` splits into
outer `c_l // S_l` (which domain) and inner `c_l % S_l` (which member). The token group of a rank
is the ranks with its inner coordinates; its levels are the outer sizes `n_l = G_l / S_l > 1`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def token_level_sizes(level_sizes: Sequence[int], domains: Sequence[int]) -> tuple[int, ...]:
    """The token EP group's level sizes: the outer sizes `n_l > 1`, slow -> fast."""
    return tuple(g // s for g, s in zip(level_sizes, domains, strict=True) if g // s > 1)


def replica_placement(
    level_sizes: Sequence[int], domains: Sequence[int], num_experts: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per expert, the token-group rank and slot of its replica in the sender's own domain.

    Expert e is owned by rank `e // E_local` (row-major over the levels). The replica lives on
    the token-group rank of the owner's outer coordinates; its slot is where the slow -> fast
    all-gathers over the inner axes put it: each gather over level l stacks S_l blocks of what
    the rank held before, so the fastest inner coordinate is the most significant.

    Returns:
      (ranks [E], slots [E]) int arrays.
    """
    e_local = num_experts // int(np.prod(level_sizes))
    owners = np.arange(num_experts) // e_local
    coords = np.stack(np.unravel_index(owners, tuple(level_sizes)))  # [levels, E]
    sizes = np.asarray(domains)[:, None]
    outer, inner = coords // sizes, coords % sizes
    outer_sizes = [g // s for g, s in zip(level_sizes, domains, strict=True)]
    token_coords = [o for o, n in zip(outer, outer_sizes, strict=True) if n > 1]
    token_sizes = token_level_sizes(level_sizes, domains)
    ranks = np.ravel_multi_index(token_coords, token_sizes) if token_sizes else owners * 0
    slots, held = np.arange(num_experts) % e_local, e_local
    for j, size in zip(inner, domains, strict=True):
        if size > 1:
            slots, held = j * held + slots, held * size
    return ranks, slots

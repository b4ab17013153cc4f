"""Token loads of the hierarchical exchange: per rank and level, the copies each rank causes,
sends and receives in one exchange, exact for a routing or expected for routing probabilities.

Numpy, shared by `volumes` (the runtime's bytes) and its tests. At level l of a token
group with level sizes `n_l`, a copy of a token goes to every distinct destination prefix (the
coordinates of levels 0..l) whose level-l coordinate differs from the source's; it is sent by the
rank holding the destination's coordinates below l and the source's from l on, and received by
the rank with the destination's prefix and the source's coordinates after l.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def exact_loads(dest, token_sizes: Sequence[int]):
    """Exact per-rank token copies per level for one token group.

    Args:
      dest: [R, T, K] destination rank in the group of each (source, t, k), -1 for none.
      token_sizes: the group's level sizes.

    Returns:
      (copies, sent, received), each [R, levels] int64: copies by source rank (summed over
      sources this equals the tests' independent count, `routed_pairs` in tests/harness.py),
      and by the rank that actually sends and receives each copy (at level l a copy goes from
      the rank holding the destination's coordinates below l and the source's from l on, to the
      destination's coordinates up to l).
    """
    dest = np.asarray(dest)
    ranks = dest.shape[0]
    strides = [math.prod(token_sizes[i + 1 :]) for i in range(len(token_sizes))]
    out = np.zeros((3, ranks, len(token_sizes)), np.int64)
    src = np.arange(ranks)[:, None, None]
    for lvl, (n, stride) in enumerate(zip(token_sizes, strides, strict=True)):
        prefix = np.where(dest >= 0, dest // stride, -1)
        keep = (dest >= 0) & (prefix % n != (src // stride) % n)
        p = np.sort(np.where(keep, prefix, -1), axis=-1)
        new = p >= 0
        new[..., 1:] &= p[..., 1:] != p[..., :-1]  # one copy per (token, destination prefix)
        s, t, k = np.nonzero(new)
        pp = p[s, t, k]
        out[0, :, lvl] = np.bincount(s, minlength=ranks)
        out[1, :, lvl] = np.bincount((pp // n) * n * stride + s % (n * stride), minlength=ranks)
        out[2, :, lvl] = np.bincount(pp * stride + s % stride, minlength=ranks)
    return out[0], out[1], out[2]


def expected_loads(token_sizes, groups, probs, tokens, top_k):
    """Expected (copies, sent, received) [R, levels] per token-group rank.

    A prefix holding routing mass P is hit with probability `1 - prod_{i<K} (1 - P E/(E-i))`:
    exact for uniform routing (the hypergeometric `1 - C(E-E_p, K)/C(E, K)`), an approximation
    of drawing K distinct experts without replacement otherwise.
    """
    num_experts = len(probs)
    ranks = math.prod(token_sizes)
    out = np.zeros((3, ranks, len(token_sizes)))
    rank = np.arange(ranks)
    for lvl, n in enumerate(token_sizes):
        stride = math.prod(token_sizes[lvl + 1 :])
        above = math.prod(token_sizes[:lvl])
        mass = np.bincount(groups // stride, weights=probs, minlength=above * n)
        miss = np.ones_like(mass)
        for i in range(top_k):
            miss *= np.clip(1 - mass * num_experts / (num_experts - i), 0, None)
        hit = (1 - miss).reshape(above, n)
        own = (rank // stride) % n
        # Copies by source: every prefix whose level coordinate differs from the source's.
        out[0, :, lvl] = tokens * (hit.sum() - hit.sum(0)[own])
        block = (rank // (n * stride)) % above
        out[1, :, lvl] = tokens * above * (hit[block].sum(1) - hit[block, own])
        out[2, :, lvl] = tokens * above * (n - 1) * hit[block, own]
    return out[0], out[1], out[2]

"""Skewed routings for the balance table and tests (numpy; nothing here runs in a model).

A `Skew` fixes which experts are popular (drawn once from a seed); batches drawn from it with
other seeds are the "measured" and "held-out" routings. Each token picks top_k distinct experts:

* `zipf`: expert popularity p_e proportional to 1 / rank_e ** exponent (ranks a random
  permutation of the ids); a token's experts are a draw without replacement from p (Gumbel
  top-k of log p).
* `group_limited`: DeepSeek-V3-like: sigmoid scores of N(0, 1) logits plus a per-expert bias
  (scale `skew`), experts in `num_groups` groups, each token keeps its `topk_groups` groups with
  the largest sum of their top-2 scores and takes its top_k experts inside them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jax_hybridep.values import check_array, check_int, check_real, check_str

KINDS = ("zipf", "group_limited")


@dataclasses.dataclass(frozen=True)
class Skew:
    """Which experts are popular, and how much (see the module docstring)."""

    kind: str
    num_experts: int
    top_k: int
    popularity: tuple[float, ...]  # zipf: log p_e; group_limited: the score bias
    num_groups: int = 8
    topk_groups: int = 4

    def __post_init__(self):
        check_str("kind", self.kind, KINDS)
        e = check_int("num_experts", self.num_experts, 1)
        check_int("top_k", self.top_k, 1, e, what=f"an int in [1, num_experts={e}]")
        pop = check_array("popularity", self.popularity, ndim=1)
        if pop.size != e:
            raise ValueError(f"popularity has {pop.size} entries for num_experts={e}")
        if self.kind == "group_limited":
            g = check_int("num_groups", self.num_groups, 1)
            if e % g:
                raise ValueError(f"num_groups={g} does not divide num_experts={e}")
            check_int("topk_groups", self.topk_groups, 1, g, what=f"an int in [1, num_groups={g}]")
            if self.top_k > self.topk_groups * (e // g):
                raise ValueError(
                    f"top_k={self.top_k} is more than the {self.topk_groups * (e // g)} experts "
                    f"of topk_groups={self.topk_groups} groups of {e // g}"
                )
        object.__setattr__(self, "popularity", tuple(float(v) for v in pop))

    @classmethod
    def make(
        cls,
        kind: str,
        num_experts: int,
        top_k: int,
        strength: float,
        seed: int = 0,
        num_groups: int = 8,
        topk_groups: int = 4,
    ) -> Skew:
        """A skew of `kind` with `strength` (the Zipf exponent, or the bias scale; >= 0)."""
        check_str("kind", kind, KINDS)
        check_int("num_experts", num_experts, 1)
        check_real("strength", strength, 0.0)
        check_int("seed", seed, 0)
        rng = np.random.default_rng(seed)
        ranks = rng.permutation(num_experts) + 1
        if kind == "zipf":
            logp = -strength * np.log(ranks)
            popularity = logp - np.log(np.exp(logp).sum())
        else:
            popularity = strength * rng.normal(size=num_experts)
        return cls(kind, num_experts, top_k, tuple(popularity.tolist()), num_groups, topk_groups)

    def sample(self, tokens: int, seed: int) -> np.ndarray:
        """[tokens, top_k] int32 expert ids (distinct per token)."""
        check_int("tokens", tokens, 1)
        check_int("seed", seed, 0)
        rng = np.random.default_rng(seed)
        e, k = self.num_experts, self.top_k
        pop = np.asarray(self.popularity)
        if self.kind == "zipf":
            keys = pop + rng.gumbel(size=(tokens, e))
            return np.argsort(-keys, axis=1, kind="stable")[:, :k].astype(np.int32)
        scores = 1 / (1 + np.exp(-(rng.normal(size=(tokens, e)) + pop)))
        groups = scores.reshape(tokens, self.num_groups, -1)
        group_score = np.sort(groups, axis=2)[:, :, -2:].sum(2)
        keep = np.argsort(-group_score, axis=1, kind="stable")[:, : self.topk_groups]
        mask = np.zeros((tokens, self.num_groups), bool)
        np.put_along_axis(mask, keep, True, axis=1)
        masked = np.where(np.repeat(mask, e // self.num_groups, axis=1), scores, -np.inf)
        return np.argsort(-masked, axis=1, kind="stable")[:, :k].astype(np.int32)


def counts(topk_idx, num_experts: int) -> np.ndarray:
    """[E] rows per expert of a routing (integer ids; those outside [0, E) ignored)."""
    check_int("num_experts", num_experts, 1)
    flat = check_array("topk_idx", topk_idx, integer=True, nonempty=False).reshape(-1)
    return np.bincount(flat[(flat >= 0) & (flat < num_experts)], minlength=num_experts)

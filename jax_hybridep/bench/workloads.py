"""Benchmark workloads: size presets and routings (uniform, DeepSeek-V3 group-limited, skewed).

A workload is built once in numpy (seeded) as global arrays `x [R*T, H]`,
`topk_idx [R*T, K]`, `topk_weights [R*T, K]` and a cotangent `ct [R*T, H]`; every method is timed
on exactly these arrays. Expert e lives on EP rank `e // (E / R)` (the library's default placement),
so the numpy counts here (received unique tokens, copies per level) hold for every method.
"""

from __future__ import annotations

import dataclasses

import numpy as np

ROUTINGS = ("uniform", "deepseek", "skewed")


@dataclasses.dataclass(frozen=True)
class Preset:
    """Sizes of one benchmark preset (per rank: `tokens` tokens of width `hidden`)."""

    name: str
    devices: int
    tokens: int
    hidden: int
    local_experts: int
    top_k: int
    dtype: str
    repeats: int
    warmup: int
    gpu_only: bool = False

    def experts(self, ranks: int) -> int:
        return self.local_experts * ranks


PRESETS = {
    # CI smoke test: seconds on 2 cores.
    "tiny": Preset("tiny", 4, 32, 64, 4, 2, "float32", 3, 1),
    # Scaled for 2-core CPU machines with 8 fake devices: a few minutes.
    "cpu": Preset("cpu", 8, 512, 1024, 8, 8, "bfloat16", 5, 1),
    # The Hybrid-EP standard: 4096 tokens/rank, hidden 7168, top-8, 8 local experts, BF16.
    "hybridep": Preset("hybridep", 0, 4096, 7168, 8, 8, "bfloat16", 20, 5, gpu_only=True),
}


@dataclasses.dataclass(frozen=True)
class BenchInputs:
    """Global inputs of one routing (numpy) and its traffic counts."""

    routing: str
    x: np.ndarray  # [R*T, H] in the preset dtype (numpy float32 for bf16, cast on device)
    topk_idx: np.ndarray  # [R*T, K] int32
    topk_weights: np.ndarray  # [R*T, K] float32
    ct: np.ndarray  # [R*T, H] cotangent
    ranks: int
    experts: int

    @property
    def tokens(self) -> int:
        return self.x.shape[0] // self.ranks

    def dest(self) -> np.ndarray:
        """[R, T, K] destination EP rank of every (source rank, t, k)."""
        local = self.experts // self.ranks
        return (self.topk_idx // local).reshape(self.ranks, self.tokens, -1)

    def presence(self) -> np.ndarray:
        """[R, T, R] bool: token t of rank s has at least one expert on rank d."""
        dest = self.dest()
        out = np.zeros((self.ranks, self.tokens, self.ranks), bool)
        s, t, _ = np.indices(dest.shape)
        out[s, t, dest] = True
        return out

    def received_tokens(self) -> int:
        """(token, destination rank) pairs, self included: Hybrid-EP's received unique tokens."""
        return int(self.presence().sum())

    def flat_copies(self, nodes: int) -> dict[str, int]:
        """Copies one-per-(token, destination rank) EP sends, split by the level they cross."""
        pres = self.presence()
        per_node = self.ranks // nodes
        rank = np.arange(self.ranks)
        same_node = (rank[:, None] // per_node) == (rank[None, :] // per_node)  # [src, dst]
        other = rank[:, None] != rank[None, :]
        node = int((pres & ~same_node[:, None, :]).sum())
        local = int((pres & (same_node & other)[:, None, :]).sum())
        return {"node": node, "local": local}

    def expanded_copies(self, nodes: int) -> dict[str, int]:
        """Rows a ×top-k expanded exchange (MaxText) sends, split by level (no dedup)."""
        dest = self.dest()
        per_node = self.ranks // nodes
        src = np.arange(self.ranks)[:, None, None]
        node = int((dest // per_node != src // per_node).sum())
        local = int(((dest // per_node == src // per_node) & (dest != src)).sum())
        return {"node": node, "local": local}


def _distinct_topk(scores: np.ndarray, k: int) -> np.ndarray:
    return np.argsort(-scores, axis=-1, kind="stable")[:, :k].astype(np.int32)


def make_inputs(preset: Preset, ranks: int, routing: str, seed: int = 0) -> BenchInputs:
    """Builds the global inputs of `routing` for `ranks` EP ranks."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    rng = np.random.default_rng(seed)
    n, experts, k = ranks * preset.tokens, preset.experts(ranks), preset.top_k
    x = rng.standard_normal((n, preset.hidden), np.float32)
    ct = rng.standard_normal((n, preset.hidden), np.float32)
    logits = rng.standard_normal((n, experts)).astype(np.float32)
    if routing == "uniform":
        idx = _distinct_topk(logits, k)  # iid scores: every expert equally likely
        weights = rng.uniform(0.1, 1.0, (n, k)).astype(np.float32)
        weights /= weights.sum(-1, keepdims=True)
    elif routing == "deepseek":
        idx, weights = _deepseek(logits, experts, k, ranks)
    else:
        idx = _distinct_topk(logits + _skew(experts), k)
        weights = np.exp(np.take_along_axis(logits, idx, -1))
        weights = (weights / weights.sum(-1, keepdims=True)).astype(np.float32)
    return BenchInputs(routing, x, idx, weights, ct, ranks, experts)


def _skew(experts: int) -> np.ndarray:
    """The skewed routing's logit bias: expert 0 is hot (~half the tokens), experts 1-3 warm."""
    bias = np.zeros(experts, np.float32)
    bias[0], bias[1:4] = 2.5, 1.0
    return bias


def topk_ids(routing: str, logits: np.ndarray, top_k: int, groups: int) -> np.ndarray:
    """[n, top_k] int32: the expert ids `make_inputs` routes router logits [n, E] to (no
    payload drawn: what the traffic accounting needs at sizes whose tokens would not fit);
    `groups`: DeepSeek routing's expert groups (`make_inputs`: one per EP rank)."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    experts = logits.shape[1]
    if routing == "uniform":
        return _distinct_topk(logits, top_k)
    if routing == "deepseek":
        return _deepseek(logits, experts, top_k, groups)[0]
    return _distinct_topk(logits + _skew(experts), top_k)


def _deepseek(logits, experts, k, ranks):
    """DeepSeek-V3 group-limited routing via `jax_hybridep.nn.route`: one group per EP rank
    (as V3 puts one group per node), each token picks its experts from half the groups."""
    import jax.numpy as jnp

    from jax_hybridep import nn as hnn

    groups = ranks if experts % ranks == 0 else 1
    topk_groups = max(1, groups // 2)
    while groups > 1 and (experts // groups < 2 or topk_groups * experts // groups < k):
        groups, topk_groups = 1, 1
    cfg = hnn.RouterConfig(
        num_experts=experts,
        top_k=k,
        score_fn="sigmoid",
        num_groups=groups if groups > 1 else None,
        topk_groups=topk_groups if groups > 1 else None,
    )
    out = hnn.route(jnp.asarray(logits), jnp.zeros(experts, jnp.float32), cfg)
    return np.asarray(out.topk_idx, np.int32), np.asarray(out.topk_weights, np.float32)

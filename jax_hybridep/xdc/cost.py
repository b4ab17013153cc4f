"""Cost models of cross-DC expert parallelism: the paper's stream model and an extended one.

Units throughout: bytes, seconds, bytes/s.

1. The HybridEP paper's stream model (arXiv 2510.19470, docs/crossdc_model.md), one flat level of
   G ranks with domain size S: `V_A2A(S) = D (G - S) / G`, `V_AG(S) = (S - 1) P_E` and
   `Lat(S) = max(Lat_PE, V_AG / B) + 2 V_A2A / B`; its continuous form in p (the fraction still
   sent as tokens), the closed-form optimum p*, and the pair counts of its Table VII.
2. The extended multi-level model of this runtime (`volumes.Volumes`), adding what the paper
   leaves out: per-level links (per-rank bandwidth, per-message latency alpha, an uplink shared by
   the ranks of one site), the backward reduce-scatter of replica gradients, skewed routing (the
   busiest rank and site set each level's time), compressed gathers plus the shared-expert sync,
   the dense gradients' all-reduce, a compute term and the pre-expert compute the forward gather
   may hide under. Levels run one after another (hierarchical, this runtime) or all at once
   ("flat" plain EP, the baseline). All-reduces are counted by `traffic.all_reduce_bytes`, the
   convention the compiled programs are read with (`volumes` holds the bytes).
"""

from __future__ import annotations

import dataclasses
import math
import numbers

from jax_hybridep.xdc.volumes import Volumes

# -- 1. The paper's stream model -------------------------------------------------------------


def a2a_volume(s: float, *, g: int, d: float) -> float:
    """Token bytes a rank sends in one all-to-all with domain size s: `D (G - s) / G`."""
    return d * (g - s) / g


def ag_volume(s: float, *, p_e: float) -> float:
    """Expert bytes a rank all-gathers with domain size s: `(s - 1) P_E`."""
    return (s - 1) * p_e


def stream_latency(s: float, *, g: int, d: float, p_e: float, bandwidth: float, lat_pe: float):
    """The paper's per-block latency `max(Lat_PE, V_AG / B) + 2 V_A2A / B` (seconds)."""
    return max(lat_pe, ag_volume(s, p_e=p_e) / bandwidth) + 2 * a2a_volume(s, g=g, d=d) / bandwidth


def domain_p(s: int, g: int) -> float:
    """p of domain size s: the fraction of the other ranks still reached by tokens."""
    return (g - s) / (g - 1)


def stream_latency_p(p: float, *, g: int, d: float, p_e: float, bandwidth: float, lat_pe: float):
    """Continuous form: `V_A2A = p D (G-1)/G`, `V_AG = (1-p)(G-1) P_E` (p in [0, 1])."""
    a2a = p * d * (g - 1) / g
    ag = (1 - p) * (g - 1) * p_e
    return max(lat_pe, ag / bandwidth) + 2 * a2a / bandwidth


def optimal_p(*, g: int, d: float, p_e: float, bandwidth: float, lat_pe: float) -> float:
    """The closed-form optimum p* of `stream_latency_p`.

    `2D >= G P_E`: tokens cost at least as much as experts, p* = 0. Otherwise shrink p only until
    the gather stops hiding under Lat_PE: `p* = 1 - B Lat_PE / (P_E (G - 1))`, clamped to [0, 1].
    """
    if 2 * d >= g * p_e:
        return 0.0
    return min(1.0, max(0.0, 1 - bandwidth * lat_pe / (p_e * (g - 1))))


def divisors(n: int) -> list[int]:
    """The realisable domain sizes of a level of n ranks."""
    return [s for s in range(1, n + 1) if n % s == 0]


def best_domain(*, g: int, d: float, p_e: float, bandwidth: float, lat_pe: float):
    """Evaluates `stream_latency` at every divisor of g: (best S, {S: latency})."""
    lat = {
        s: stream_latency(s, g=g, d=d, p_e=p_e, bandwidth=bandwidth, lat_pe=lat_pe)
        for s in divisors(g)
    }
    return min(lat, key=lambda s: (lat[s], s)), lat


def pair_counts(g: int, s: int) -> tuple[int, int]:
    """Ordered rank pairs that communicate (Table VII): all-to-all `G(G/S - 1)`, gather `G(S-1)`."""
    if g % s:
        raise ValueError(f"domain size {s} does not divide {g} ranks")
    return g * (g // s - 1), g * (s - 1)


# -- 2. The extended multi-level model --------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Link:
    """One level's link, each direction.

    Attributes:
      bandwidth: bytes/s one rank can move at this level on its own.
      alpha: seconds per message (one message per peer per collective).
      uplink: bytes/s shared by the ranks of one site at this level (the ranks with equal
        coordinates up to this level, e.g. the 8 GPUs of a DC behind its WAN link); None = none.
    """

    bandwidth: float
    alpha: float = 0.0
    uplink: float | None = None

    def __post_init__(self):
        for name in ("bandwidth", "alpha", "uplink"):
            value = getattr(self, name)
            if name == "uplink" and value is None:
                continue
            if not _finite(value):
                raise ValueError(f"Link.{name} must be a finite number, got {value!r}")
        if self.bandwidth <= 0 or self.alpha < 0 or (self.uplink is not None and self.uplink <= 0):
            raise ValueError(
                f"Link needs bandwidth > 0, alpha >= 0 and uplink None or > 0; got "
                f"bandwidth={self.bandwidth!r}, alpha={self.alpha!r}, uplink={self.uplink!r}"
            )


def _finite(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Mesh levels slow -> fast and their links.

    Attributes:
      level_sizes: ranks per level group, `G_l`.
      links: one `Link` per level.
      names: optional level names, e.g. ("dc", "local").
    """

    level_sizes: tuple[int, ...]
    links: tuple[Link, ...]
    names: tuple[str, ...] | None = None

    def __post_init__(self):
        sizes = tuple(self.level_sizes)
        if not all(isinstance(g, numbers.Integral) and not isinstance(g, bool) for g in sizes):
            raise ValueError(f"Cluster.level_sizes must be integers, got {self.level_sizes!r}")
        if not sizes or min(sizes) < 1:
            raise ValueError(f"Cluster.level_sizes must be >= 1 (one or more), got {sizes}")
        if len(sizes) != len(self.links):
            raise ValueError(
                f"need one link per level: {len(sizes)} levels {sizes}, {len(self.links)} links"
            )
        bad = [x for x in self.links if not isinstance(x, Link)]
        if bad:
            raise ValueError(f"Cluster.links must be cost.Link values, got {bad!r}")
        if self.names is not None:
            if len(self.names) != len(self.links) or len(set(self.names)) != len(self.names):
                raise ValueError(
                    f"Cluster.names {self.names} must name each of the levels {sizes} once"
                )
        object.__setattr__(self, "level_sizes", tuple(int(g) for g in sizes))
        object.__setattr__(self, "links", tuple(self.links))


def transfer_time(link: Link, rank_bytes: float, site_bytes: float, messages: int) -> float:
    """Seconds to move `rank_bytes` per rank while the site moves `site_bytes` over its uplink."""
    if rank_bytes <= 0 and messages <= 0:
        return 0.0
    t = rank_bytes / link.bandwidth
    if link.uplink is not None:
        t = max(t, site_bytes / link.uplink)
    return t + link.alpha * messages


@dataclasses.dataclass(frozen=True)
class LevelCost:
    """One level's seconds per layer (tokens: per exchange) and per-step totals."""

    gather: float
    shared_sync: float
    tokens: float
    reduce_scatter: float
    dense: float  # per step: the dense gradients' all-reduce (training)
    time: float  # per step: layers x (gather + sync + exchanges x tokens + reduce-scatter) + dense
    bytes: float  # per step and rank, all traffic at this level


@dataclasses.dataclass(frozen=True)
class StepCost:
    """Predicted seconds of one step (or forward pass).

    Attributes:
      time: compute + comm.
      comm: exposed communication per step.
      compute: the fixed compute term.
      exposed_gather: forward gather + shared sync not hidden under Lat_PE, per step.
      tokens: token exchanges per step.
      reduce_scatter: backward reduce-scatters per step.
      dense: the dense gradients' all-reduce per step (training; levels one after another).
      levels: per level, `LevelCost` (raw, before hiding; flat levels overlap).
    """

    time: float
    comm: float
    compute: float
    exposed_gather: float
    tokens: float
    reduce_scatter: float
    dense: float
    levels: tuple[LevelCost, ...]

    @property
    def bytes_per_level(self) -> tuple[float, ...]:
        return tuple(level.bytes for level in self.levels)


def step_cost(
    cluster: Cluster,
    volumes: Volumes,
    *,
    layers: int = 1,
    training: bool = True,
    compute: float = 0.0,
    lat_pe: float = 0.0,
) -> StepCost:
    """The extended model: seconds and bytes of one step of `layers` MoE layers.

    Per layer: the forward gather and shared sync run level after level and hide under `lat_pe`
    (the paper's `max(Lat_PE, V_AG / B)`, with Lat_PE counted in `compute`); then the token
    exchanges (4 training, 2 forward), each level after level (hierarchical) or all levels at once
    (flat: the slowest level sets the time); training adds the gradients' reduce-scatter, which
    nothing hides, and once per step the dense gradients' all-reduce (`volumes` dense bytes).
    Each level's time is that of its busiest rank and site.

    Args:
      cluster: level sizes and links; must match `volumes.level_sizes`.
      volumes: per-level volumes of one configuration (`volumes.expected_volumes` etc.).
      layers: MoE layers per step.
      training: forward + backward (True) or forward only.
      compute: fixed compute seconds per step (includes the pre-expert compute).
      lat_pe: pre-expert compute seconds per layer under which the forward gather may hide.
    """
    if tuple(cluster.level_sizes) != tuple(volumes.level_sizes):
        raise ValueError(
            f"cluster levels {cluster.level_sizes} do not match volumes {volumes.level_sizes}"
        )
    if not isinstance(layers, numbers.Integral) or layers < 1:
        raise ValueError(f"layers must be an integer >= 1, got {layers!r}")
    for name, value in (("compute", compute), ("lat_pe", lat_pe)):
        if not _finite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    exchanges = volumes.token_exchanges(training)
    per_level = []
    for link, v in zip(cluster.links, volumes.levels, strict=True):
        gather = transfer_time(link, v.gather_bytes, v.site_ranks * v.gather_bytes, v.gather_peers)
        b = v.shared_sync_bytes
        sync = transfer_time(link, b, v.site_ranks * b, 2 * (v.domain - 1)) if b else 0.0
        tokens = transfer_time(link, v.token_bytes_max, v.token_site_bytes_max, v.token_peers)
        rs = v.reduce_scatter_bytes
        rs = transfer_time(link, rs, v.site_ranks * rs, v.gather_peers) if training else 0.0
        b = v.dense_sync_bytes if training else 0
        dense = transfer_time(link, b, v.site_ranks * b, 2 * v.dense_peers) if b else 0.0
        per_level.append((gather, sync, tokens, rs, dense))
    gather = max(0.0, sum(p[0] + p[1] for p in per_level) - lat_pe)
    if volumes.mode == "flat":
        exchange = max((p[2] for p in per_level), default=0.0)
    else:
        exchange = sum(p[2] for p in per_level)
    rs = sum(p[3] for p in per_level)
    dense = sum(p[4] for p in per_level)
    comm = layers * (gather + exchanges * exchange + rs) + dense
    levels = tuple(
        LevelCost(g, s, t, r, d, layers * (g + s + exchanges * t + r) + d, b)
        for (g, s, t, r, d), b in zip(per_level, volumes.step_bytes(training, layers), strict=True)
    )
    return StepCost(
        time=compute + comm,
        comm=comm,
        compute=compute,
        exposed_gather=layers * gather,
        tokens=layers * exchanges * exchange,
        reduce_scatter=layers * rs,
        dense=dense,
        levels=levels,
    )

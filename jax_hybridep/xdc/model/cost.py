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
from collections.abc import Sequence

from jax_hybridep.values import check_bool, check_int, check_real, check_type
from jax_hybridep.xdc.model.volumes import Volumes

# -- 1. The paper's stream model -------------------------------------------------------------


def _paper(s=None, p=None, **named) -> None:
    """Checks the stream model's arguments: g an int >= 1, s a domain size in [1, g], p in
    [0, 1], bandwidth > 0, the byte counts and seconds finite and >= 0."""
    g = check_int("g", named.pop("g"), 1) if "g" in named else None
    if s is not None:
        check_real("s", s, 1.0, math.inf if g is None else g)
    if p is not None:
        check_real("p", p, 0.0, 1.0)
    for name, value in named.items():
        check_real(name, value, 0.0, positive=name == "bandwidth")


def a2a_volume(s: float, *, g: int, d: float) -> float:
    """Token bytes a rank sends in one all-to-all with domain size s: `D (G - s) / G`."""
    _paper(s, g=g, d=d)
    return d * (g - s) / g


def ag_volume(s: float, *, p_e: float) -> float:
    """Expert bytes a rank all-gathers with domain size s: `(s - 1) P_E`."""
    _paper(s, p_e=p_e)
    return (s - 1) * p_e


def stream_latency(s: float, *, g: int, d: float, p_e: float, bandwidth: float, lat_pe: float):
    """The paper's per-block latency `max(Lat_PE, V_AG / B) + 2 V_A2A / B` (seconds)."""
    _paper(s, g=g, d=d, p_e=p_e, bandwidth=bandwidth, lat_pe=lat_pe)
    return max(lat_pe, ag_volume(s, p_e=p_e) / bandwidth) + 2 * a2a_volume(s, g=g, d=d) / bandwidth


def domain_p(s: int, g: int) -> float:
    """p of domain size s: the fraction of the other ranks still reached by tokens (g >= 2)."""
    check_int("g", g, 2)
    check_int("s", s, 1, g)
    return (g - s) / (g - 1)


def stream_latency_p(p: float, *, g: int, d: float, p_e: float, bandwidth: float, lat_pe: float):
    """Continuous form: `V_A2A = p D (G-1)/G`, `V_AG = (1-p)(G-1) P_E` (p in [0, 1])."""
    _paper(p=p, g=g, d=d, p_e=p_e, bandwidth=bandwidth, lat_pe=lat_pe)
    a2a = p * d * (g - 1) / g
    ag = (1 - p) * (g - 1) * p_e
    return max(lat_pe, ag / bandwidth) + 2 * a2a / bandwidth


def optimal_p(*, g: int, d: float, p_e: float, bandwidth: float, lat_pe: float) -> float:
    """The closed-form optimum p* of `stream_latency_p`.

    `2D >= G P_E`: tokens cost at least as much as experts, p* = 0. Otherwise shrink p only until
    the gather stops hiding under Lat_PE: `p* = 1 - B Lat_PE / (P_E (G - 1))`, clamped to [0, 1].
    """
    _paper(g=g, d=d, p_e=p_e, bandwidth=bandwidth, lat_pe=lat_pe)
    check_int("g", g, 2)  # p* divides by G - 1
    if 2 * d >= g * p_e:
        return 0.0
    return min(1.0, max(0.0, 1 - bandwidth * lat_pe / (p_e * (g - 1))))


def divisors(n: int) -> list[int]:
    """The realisable domain sizes of a level of n ranks: n's divisors, ascending."""
    check_int("n", n, 1)
    return [s for s in range(1, n + 1) if n % s == 0]


def best_domain(*, g: int, d: float, p_e: float, bandwidth: float, lat_pe: float):
    """Evaluates `stream_latency` at every divisor of g: (best S, {S: latency})."""
    _paper(g=g, d=d, p_e=p_e, bandwidth=bandwidth, lat_pe=lat_pe)
    lat = {
        s: stream_latency(s, g=g, d=d, p_e=p_e, bandwidth=bandwidth, lat_pe=lat_pe)
        for s in divisors(g)
    }
    return min(lat, key=lambda s: (lat[s], s)), lat


def pair_counts(g: int, s: int) -> tuple[int, int]:
    """Ordered rank pairs that communicate (Table VII): all-to-all `G(G/S - 1)`, gather `G(S-1)`."""
    check_int("g", g, 1)
    check_int("s", s, 1)
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
            if isinstance(self.names, str) or not all(isinstance(n, str) for n in self.names):
                raise TypeError(f"Cluster.names must be level names (str), got {self.names!r}")
            if len(self.names) != len(self.links) or len(set(self.names)) != len(self.names):
                raise ValueError(
                    f"Cluster.names {self.names} must name each of the levels {sizes} once"
                )
        object.__setattr__(self, "level_sizes", tuple(int(g) for g in sizes))
        object.__setattr__(self, "links", tuple(self.links))


def transfer_time(link: Link, rank_bytes: float, site_bytes: float, messages: int) -> float:
    """Seconds to move `rank_bytes` per rank while the site moves `site_bytes` over its uplink."""
    check_type("link", link, Link, "a cost.Link")
    check_real("rank_bytes", rank_bytes, 0.0)
    check_real("site_bytes", site_bytes, 0.0)
    check_int("messages", messages, 0)
    return _transfer_time(link, rank_bytes, site_bytes, messages)


def _transfer_time(link: Link, rank_bytes, site_bytes, messages) -> float:
    if rank_bytes <= 0 and messages <= 0:
        return 0.0
    t = rank_bytes / link.bandwidth
    if link.uplink is not None:
        t = max(t, site_bytes / link.uplink)
    return t + link.alpha * messages


@dataclasses.dataclass(frozen=True)
class LevelCost:
    """One level's seconds (raw transfer times, before any hiding), summed over the layers, and its
    per-step totals.

    `gather`, `shared_sync` and `reduce_scatter` are per step (with prefetch the fused
    collectives' once); `tokens` is one token exchange (a step makes 4 training, 2 forward);
    `refresh` is the persistent shared experts' all-reduce per step (over `sync_every`)."""

    gather: float
    shared_sync: float
    tokens: float
    reduce_scatter: float
    dense: float  # per step: the dense gradients' all-reduce (training)
    time: float  # per step: gather + sync + exchanges x tokens + reduce-scatter + refresh + dense
    bytes: float  # per step and rank, all traffic at this level
    refresh: float = 0.0


@dataclasses.dataclass(frozen=True)
class StepCost:
    """Predicted seconds of one step (or forward pass).

    Attributes:
      time: compute + comm.
      comm: exposed communication per step.
      compute: the fixed compute term.
      exposed_gather: forward gather + "mean" reference sync not hidden under Lat_PE, per step.
      tokens: token exchanges per step.
      reduce_scatter: backward reduce-scatters per step.
      dense: the dense gradients' all-reduce per step (training; levels one after another).
      refresh: the persistent shared experts' refresh per step (amortised over `sync_every`).
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
    refresh: float = 0.0

    @property
    def bytes_per_level(self) -> tuple[float, ...]:
        return tuple(level.bytes for level in self.levels)


def _site(link, v, nbytes, messages) -> float:
    """`transfer_time` of `nbytes` per rank, the site's ranks moving as much each."""
    return _transfer_time(link, nbytes, v.site_ranks * nbytes, messages) if nbytes else 0.0


def step_cost(
    cluster: Cluster,
    volumes: Volumes | Sequence[Volumes],
    *,
    layers: int | None = None,
    training: bool = True,
    compute: float = 0.0,
    lat_pe: float = 0.0,
    prefetch: bool = False,
) -> StepCost:
    """The extended model: seconds and bytes of one step of MoE layers.

    Per layer: the forward gather and the "mean" reference's sync run level after level and hide
    under `lat_pe` (the paper's `max(Lat_PE, V_AG / B)`, with Lat_PE counted in `compute`); then
    the token exchanges (4 training, 2 forward), each level after level (hierarchical) or all
    levels at once (flat: the slowest level sets the time); training adds the gradients'
    reduce-scatter, which nothing hides. With `prefetch` every layer's gather is one collective
    per level at step start (one message per peer for all the layers sharing a domain tuple),
    hidden under the first layer's pre-expert compute only; the reduce-scatters likewise fused.
    Once per step: the persistent shared experts' refresh (its all-reduce over `sync_every`,
    counted as exposed though it has no consumer in the step) and, training, the dense gradients'
    all-reduce (`volumes` dense bytes, taken from the first layer's). Each level's time is that
    of its busiest rank and site.

    Args:
      cluster: level sizes and links; must match every volume's `level_sizes`.
      volumes: one configuration's per-level volumes for every layer (`Volumes`, with `layers`
        layers, default 1), or one `Volumes` per layer (layers may differ in domains or routing).
      layers: MoE layers per step when `volumes` is one `Volumes`.
      training: forward + backward (True) or forward only.
      compute: fixed compute seconds per step (includes the pre-expert compute).
      lat_pe: pre-expert compute seconds per layer under which a forward gather may hide.
      prefetch: every layer's experts gathered at step start
        (`nn.migration_state.prefetch_experts`).
    """
    check_type("cluster", cluster, Cluster, "a cost.Cluster")
    check_bool("training", training)
    check_bool("prefetch", prefetch)
    if isinstance(volumes, Volumes):
        if layers is not None and (not isinstance(layers, numbers.Integral) or layers < 1):
            raise ValueError(f"layers must be an integer >= 1, got {layers!r}")
        per_layer = [volumes] * (1 if layers is None else int(layers))
    else:
        per_layer = list(volumes)
        if not per_layer or not all(isinstance(v, Volumes) for v in per_layer):
            raise ValueError("volumes must be a Volumes or a non-empty sequence of them")
        if layers is not None and layers != len(per_layer):
            raise ValueError(f"layers={layers!r} but {len(per_layer)} per-layer volumes given")
    for v in per_layer:
        if tuple(cluster.level_sizes) != tuple(v.level_sizes):
            raise ValueError(
                f"cluster levels {cluster.level_sizes} do not match volumes {v.level_sizes}"
            )
    for name, value in (("compute", compute), ("lat_pe", lat_pe)):
        if not _finite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    exchanges = Volumes.token_exchanges(training)
    links, n_levels = cluster.links, len(cluster.links)

    def raw(v, lvl, nbytes, messages):
        return _site(links[lvl], v.levels[lvl], nbytes, messages)

    gather_t = [[0.0] * n_levels for _ in per_layer]
    rs_t = [[0.0] * n_levels for _ in per_layer]
    sync_t, token_t, refresh_t = ([[0.0] * n_levels for _ in per_layer] for _ in range(3))
    for i, v in enumerate(per_layer):
        for lvl, lv in enumerate(v.levels):
            sync_t[i][lvl] = raw(v, lvl, lv.shared_sync_bytes, 2 * (lv.domain - 1))
            token_t[i][lvl] = _transfer_time(
                links[lvl], lv.token_bytes_max, lv.token_site_bytes_max, lv.token_peers
            )
            refresh = raw(v, lvl, lv.shared_refresh_bytes, 2 * (lv.size - 1))
            refresh_t[i][lvl] = refresh / v.sync_every
            if not prefetch:
                gather_t[i][lvl] = raw(v, lvl, lv.gather_bytes, lv.gather_peers)
                if training:
                    rs_t[i][lvl] = raw(v, lvl, lv.reduce_scatter_bytes, lv.gather_peers)
    if prefetch:  # one fused collective per level and domain tuple, charged to its first layer
        groups: dict = {}
        for i, v in enumerate(per_layer):
            groups.setdefault(v.domains, []).append(i)
        for members in groups.values():
            first = per_layer[members[0]]
            for lvl, lv in enumerate(first.levels):
                g = sum(per_layer[i].levels[lvl].gather_bytes for i in members)
                gather_t[members[0]][lvl] = raw(first, lvl, g, lv.gather_peers)
                if training:
                    r = sum(per_layer[i].levels[lvl].reduce_scatter_bytes for i in members)
                    rs_t[members[0]][lvl] = raw(first, lvl, r, lv.gather_peers)
        exposed = max(0.0, sum(map(sum, gather_t)) + sum(map(sum, sync_t)) - lat_pe)
    else:
        exposed = sum(
            max(0.0, sum(g) + sum(y) - lat_pe) for g, y in zip(gather_t, sync_t, strict=True)
        )
    if per_layer[0].mode == "flat":
        tokens = sum(exchanges * max(t, default=0.0) for t in token_t)
    else:
        tokens = sum(exchanges * sum(t) for t in token_t)
    rs = sum(map(sum, rs_t))
    refresh = sum(map(sum, refresh_t))
    first = per_layer[0]
    dense_t = [
        raw(first, lvl, lv.dense_sync_bytes, 2 * lv.dense_peers) if training else 0.0
        for lvl, lv in enumerate(first.levels)
    ]
    dense = sum(dense_t)
    comm = exposed + tokens + rs + refresh + dense
    level_bytes = [sum(b) for b in zip(*(v.layer_bytes(training) for v in per_layer), strict=True)]
    levels = []
    for lvl in range(n_levels):
        g, y, t, r, f = (
            sum(row[lvl] for row in x) for x in (gather_t, sync_t, token_t, rs_t, refresh_t)
        )
        d = dense_t[lvl]
        b = level_bytes[lvl] + (first.levels[lvl].dense_sync_bytes if training else 0)
        levels.append(LevelCost(g, y, t, r, d, g + y + exchanges * t + r + f + d, b, f))
    return StepCost(
        time=compute + comm,
        comm=comm,
        compute=compute,
        exposed_gather=exposed,
        tokens=tokens,
        reduce_scatter=rs,
        dense=dense,
        levels=tuple(levels),
        refresh=refresh,
    )

"""The flags of the cross-DC job: the example's mesh, its settings as one value (`Settings`,
checked before jax starts; each field with its default and help, from which its flag is made:
`job_runtime/flag_fields.py`), the cluster they describe for the cost model, and their absl
flags.

The cluster is 2 datacenters x 2 nodes x 2 GPUs (`MESH`), its links described by the flags: WAN
bandwidth shared by a DC's GPUs and its latency, the inter-node and intra-node bandwidths.
"""

from __future__ import annotations

import dataclasses
import math

from examples.job_runtime import flag_fields
from examples.job_runtime.flag_fields import setting
from examples.train_moe.config import check_output_dir, migration_flags
from examples.train_moe.flags import define_migration_flags
from jax_hybridep import xdc
from jax_hybridep.config import BACKENDS

MESH = (("dc", 2), ("node", 2), ("local", 2))
RANKS = math.prod(s for _, s in MESH)


@dataclasses.dataclass(frozen=True)
class Settings:
    """The example's flags, as one value tests can build directly; the cross-DC flags
    (--domains overriding the plan, --domain_compression, ...) as one `xdc.Migration`
    (`train_moe.config.parse_migration`), its help that of --domains."""

    steps: int = setting(150, "training steps per run")
    batch: int = setting(16, "sequences (of 128 bytes) per step, a multiple of 8")
    wan_gbps: float = setting(10.0, "bandwidth between datacenters, shared by a DC")
    wan_latency_ms: float = setting(5.0, "one-way WAN latency per message")
    node_gbps: float = setting(100.0, "per-GPU bandwidth between nodes of a DC")
    local_gbps: float = setting(3600.0, "per-GPU bandwidth inside a node (NVLink)")
    migration: xdc.Migration = setting(
        xdc.Migration(sync_every=10), "override the plan, e.g. 'dc=2' (default: planned)"
    )
    prefetch: bool = setting(True, "gather every layer's experts at step start")
    sr_table: bool = setting(False, "train plain EP, domains and the SR variants")
    replan_every: int = setting(0, "re-plan every N steps (one run)")
    link_schedule: str | None = setting(None, "bandwidth changes by step, e.g. '50:dc=0.5'")
    skew_at: int = setting(0, "skew the routing at this step (re-planning run)")
    min_gain: float = setting(0.02, "predicted gain a re-plan needs to switch")
    backend: str = setting("auto", f"dispatch/combine backend: {', '.join(BACKENDS)}")
    output_dir: str = setting("/tmp/cross_dc", "where runs, metrics and summary go")

    def check(self) -> None:
        """ValueError naming the flag and its value, before any model is built."""

        def bad(flag, why):
            raise ValueError(f"--{flag}={getattr(self, flag)!r}: {why}")

        def number(value) -> bool:
            return isinstance(value, int | float) and not isinstance(value, bool)

        def integer(flag, low):
            value = getattr(self, flag)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                bad(flag, f"must be an integer >= {low}")

        integer("steps", 1)
        if not isinstance(self.batch, int) or self.batch < 1 or self.batch % RANKS:
            bad("batch", f"must be a positive multiple of the {RANKS} devices")
        for flag in ("wan_gbps", "node_gbps", "local_gbps"):
            value = getattr(self, flag)
            if not number(value) or not 0 < value < math.inf:
                bad(flag, "must be a finite bandwidth > 0")
        if not number(self.wan_latency_ms) or not 0 <= self.wan_latency_ms < math.inf:
            bad("wan_latency_ms", "must be a finite latency >= 0")
        integer("replan_every", 0)
        integer("skew_at", 0)
        if not number(self.min_gain) or not 0 <= self.min_gain < 1:
            bad("min_gain", "must be a fraction in [0, 1)")
        if self.sr_table and self.replan_every:
            bad("sr_table", "is a mode of its own: leave --replan_every unset")
        if (self.link_schedule or self.skew_at) and not self.replan_every:
            bad("replan_every", "must be set for --link_schedule and --skew_at")
        if self.backend not in BACKENDS:
            bad("backend", f"must be one of {', '.join(BACKENDS)}")
        check_output_dir(self.output_dir, "--output_dir")  # creatable and writable
        if not isinstance(self.migration, xdc.Migration):
            bad("migration", "must be a jax_hybridep.xdc.Migration")
        self.domain_sizes()
        xdc.LinkSchedule.parse(self.link_schedule, [n for n, _ in MESH])

    def domain_sizes(self) -> tuple[int, ...] | None:
        """`--domains` (`migration.domains`) as one size per mesh level (None: use the plan)."""
        if not self.migration.domains:
            return None
        sizes, spec = dict(MESH), migration_flags(self.migration)["domains"]
        for name, size in self.migration.domains:
            if name not in sizes:
                raise ValueError(
                    f"--domains={spec!r}: {name!r} is not a level, one of {', '.join(sizes)}"
                )
            if sizes[name] % size:
                raise ValueError(
                    f"--domains={spec!r}: {name}={size} must divide the level's {sizes[name]} ranks"
                )
        given = dict(self.migration.domains)
        return tuple(given.get(n, 1) for n, _ in MESH)


def describe_cluster(s: Settings) -> xdc.cost.Cluster:
    """The flags as a cost-model cluster (bytes/s, seconds)."""
    wan = s.wan_gbps * 1e9 / 8
    links = (
        xdc.cost.Link(bandwidth=wan, alpha=s.wan_latency_ms * 1e-3, uplink=wan),
        xdc.cost.Link(bandwidth=s.node_gbps * 1e9 / 8, alpha=5e-6),
        xdc.cost.Link(bandwidth=s.local_gbps * 1e9 / 8, alpha=2e-6),
    )
    return xdc.cost.Cluster(tuple(g for _, g in MESH), links, tuple(n for n, _ in MESH))


def links_spec(s: Settings) -> str:
    """`describe_cluster`'s links as the main job's --links spells them."""
    return (
        f"dc={s.wan_gbps:g}:{s.wan_latency_ms:g}:shared,node={s.node_gbps:g}:0.005,"
        f"local={s.local_gbps:g}:0.002"
    )


def define_flags() -> None:
    """One flag per `Settings` field, with the field's default and help; `migration` as the
    cross-DC flags (only when a command runs)."""
    flag_fields.define_flags(Settings(), custom=dict(migration=define_migration_flags))

"""What a run of the main job depends on: its config and the config's validation.

`TrainConfig` holds the flags as one value (tests build it directly); `check_config` validates every
field before any model is built and raises `FlagError` naming the flag, its value and what is
wrong, in the library's own words where the library has a rule (e.g. experts per EP rank). The
cross-DC flags (--domains, --domain_compression, --domain_shared, --domain_sync_every,
--grad_compression) become one `xdc.Migration` in one place, `parse_migration`, and are spelled
back by `migration_flags`. The command-line flags themselves are defined and read in
`flags.py`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from numbers import Integral, Real

from examples.job_runtime.errors import FlagError
from examples.moe_lm.data import ByteData
from examples.moe_lm.model import DATA_AXIS, make_mesh
from jax_hybridep import xdc
from jax_hybridep.fp8 import WIRE_DTYPES
from jax_hybridep.xdc.migration import SHARED_VARIANTS

BACKENDS = ("auto", "xla", "ffi")
DROPLESS = "none"  # the one spelling of "no capacity" on the command line (and the default)


# The flags a resumed run may change (the rest shape the model, its routing, its data or its
# optimizer and must equal the checkpoint's: `checkpoint.check_resume_flags`), and with
# them the TrainConfig fields without a flag that may change too.
RESUMABLE_FLAGS = (
    "steps",
    "schedule_steps",
    "eval_every",
    "checkpoint_every",
    "backend",
    "output_dir",
)
RESUMABLE_FIELDS = (*RESUMABLE_FLAGS, "eval_batches", "progress", "resume")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a run depends on (the flags, as one value that tests can build directly).

    Attributes:
      steps: total optimizer steps (a resumed run continues up to this many).
      batch, seq_len: sequences per step and bytes per sequence.
      d_model, d_ff, layers, heads, experts, top_k: model sizes (see `model.ModelConfig`).
      mesh: mesh axis sizes, e.g. "node=2,local=4", "ep=8" or "data=2,ep=4"; None means
        "node=2,local=<n/2>" on fake CPU devices and "ep=<all devices>" on accelerators.
      backend: dispatch/combine backend, "auto", "xla" or "ffi".
      migration: cross-DC EP as one `xdc.Migration` (`parse_migration` of the flags):
        --domains, the expert domain sizes per EP level, e.g. "dc=2" (experts all-gathered
        inside each pair of "dc" coordinates, tokens only between domains; unset: plain EP);
        --domain_compression, the SR compression ratio (> 1) of the experts moved inside a
        domain (unset: off); --domain_shared, the SR reference, "persistent" (a shared expert
        kept as state), "mean" (the domain's mean every step) or "none"; --domain_sync_every,
        steps between refreshes of the persistent one; --grad_compression, the top-k ratio
        (> 1) of the replicas' gradient reduce-scatter, with error feedback (opt-in, not exact;
        unset: off).
      prefetch: gather every layer's experts at step start instead of inside each layer.
      replan_every: re-plan the domains every this many steps from the measured routing and
        `links` / `link_schedule` (0: never; `replan.py`), recompiling when they change.
      links: the links of the mesh's EP levels for the planner, e.g. "dc=10:5:shared,node=100,
        local=3600" (Gbps[:latency ms][:shared]); link_schedule: bandwidth changes by step,
        e.g. "200:dc=1"; memory_limit_mb: per-device memory limit of the plans (0: none).
      capacity_factor: per-expert capacity factor (> 0); None means dropless.
      wire_dtype: None (tokens travel in the model's dtype) or "float8_e4m3fn" (FP8 dispatch:
        one scale per 128 elements, dequantised at the receiver).
      redundant_slots: per EP rank, expert slots for copies of hot experts (0: none).
      rebalance_every: re-place the experts every this many steps from the measured load
        (`rebalance.py`; 0: never).
      charge_sync: the balancer charges each remote replica's sync bytes (weights forward,
        gradient back) against the rows it saves; False places replicas by load alone.
      lr: peak learning rate of the warmup + cosine schedule.
      schedule_steps: the step the schedule's cosine decay ends at (0: `steps`); a run meant to
        be resumed later to N steps sets N, so that it follows the uninterrupted run's schedule.
      seed: initialisation and data seed.
      output_dir: where metrics, plot and checkpoint go.
      eval_every: evaluate every this many steps (and at the end).
      checkpoint_every: also commit a checkpoint (and metrics.json) every this many steps (0:
        only at the end), so that `resume` after a crash loses at most this many steps.
      resume: restore the checkpoint in output_dir and continue from its step.
      eval_batches: held-out batches per evaluation.
      progress: show a live progress bar (only drawn on a terminal).
    """

    steps: int = 500
    batch: int = 16
    seq_len: int = 128
    d_model: int = 128
    d_ff: int = 256
    layers: int = 2
    heads: int = 4
    experts: int = 8
    top_k: int = 2
    mesh: str | None = None
    backend: str = "auto"
    migration: xdc.Migration = xdc.Migration()
    prefetch: bool = False
    replan_every: int = 0
    links: str | None = None
    link_schedule: str | None = None
    memory_limit_mb: float = 0.0
    capacity_factor: float | None = None
    wire_dtype: str | None = None
    redundant_slots: int = 0
    rebalance_every: int = 0
    charge_sync: bool = True
    lr: float = 3e-3
    schedule_steps: int = 0
    seed: int = 0
    output_dir: str = "/tmp/train_moe"
    eval_every: int = 50
    checkpoint_every: int = 0
    resume: bool = False
    eval_batches: int = 4
    progress: bool = True


def parse_sizes(spec: str, what: str) -> tuple[tuple[str, int], ...]:
    """ "a=2,b=4" -> (("a", 2), ("b", 4)); FlagError naming `what` when it does not parse."""
    try:
        pairs = tuple((n.strip(), int(v)) for n, v in (item.split("=") for item in spec.split(",")))
    except ValueError:
        pairs = ()
    if not pairs or any(not name for name, _ in pairs):
        raise FlagError(f"{what}={spec} must look like 'dc=2' or 'dc=2,node=2'")
    return pairs


def parse_migration(
    domains: str | None = None,
    domain_compression: float | None = None,
    domain_shared: str = "persistent",
    domain_sync_every: int = 1,
    grad_compression: float | None = None,
) -> xdc.Migration:
    """The cross-DC flags as one `xdc.Migration`; FlagError naming the first bad flag."""
    for name, value, hint in (
        ("domain_compression", domain_compression, "a compression ratio"),
        ("grad_compression", grad_compression, "a top-k ratio of the gradients"),
    ):
        _check_number(
            name, value, above=1, optional=True, hint=f" ({hint}; leave it unset for none)"
        )
    if domain_shared not in SHARED_VARIANTS:
        raise FlagError(
            f"--domain_shared={domain_shared!r} must be one of {', '.join(SHARED_VARIANTS)}"
        )
    _check_int("domain_sync_every", domain_sync_every, 1)
    sizes = parse_sizes(domains, "--domains") if domains is not None else ()
    try:
        return xdc.Migration(
            sizes, domain_compression, domain_shared, domain_sync_every, grad_compression
        )
    except (TypeError, ValueError) as err:
        raise FlagError(f"--domains={domains}: {err}") from None


def migration_flags(migration: xdc.Migration) -> dict:
    """`migration` spelled as the flags `parse_migration` reads (name -> value)."""
    return dict(
        domains=",".join(f"{n}={s}" for n, s in migration.domains) or None,
        domain_compression=migration.compression,
        domain_shared=migration.shared,
        domain_sync_every=migration.sync_every,
        grad_compression=migration.grad_compression,
    )


def flag_values(cfg: TrainConfig) -> dict:
    """`cfg` as its flags (name -> value; what a checkpoint's meta records)."""
    values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    migration = values.pop("migration")
    return {**values, **migration_flags(migration)}


def parse_capacity_factor(value: str | None) -> float | None:
    """The --capacity_factor flag: a number > 0, or 'none' (also the default) for dropless."""
    if value is None or value.strip().lower() == DROPLESS:
        return None
    try:
        return float(value)
    except ValueError:
        raise FlagError(
            f"--capacity_factor={value} must be a number > 0, or '{DROPLESS}' (the default) for "
            "dropless"
        ) from None


def _check_int(name: str, value, minimum: int) -> None:
    if not isinstance(value, Integral) or isinstance(value, bool) or value < minimum:
        raise FlagError(f"--{name}={value!r} must be an integer >= {minimum}")


def _check_number(name: str, value, *, above: float, optional: bool, hint: str = "") -> None:
    if value is None and optional:
        return
    real = isinstance(value, Real) and not isinstance(value, bool)
    if not real or not math.isfinite(value) or not value > above:
        raise FlagError(f"--{name}={value!r} must be a finite number > {above:g}{hint}")


def check_config(cfg: TrainConfig, devices, data: ByteData | None = None) -> None:
    """Raises FlagError naming the first flag of `cfg` that the run cannot use on `devices`.

    Covers every field: types and ranges, the model's shape rules, the mesh (axes, device count,
    experts per EP rank, tokens per device), the expert domains, the eval and train text's length
    (`data`, loaded when not given) and the output directory (first: creatable and writable).
    Builds no model and creates nothing.
    """
    _check_output_dir(cfg.output_dir)  # first: nothing else is worth checking without it
    for name, minimum in (
        ("steps", 0),
        ("batch", 1),
        ("seq_len", 1),
        ("d_model", 1),
        ("d_ff", 1),
        ("layers", 1),
        ("heads", 1),
        ("experts", 1),
        ("top_k", 1),
        ("seed", 0),
        ("eval_every", 1),
        ("eval_batches", 1),
        ("redundant_slots", 0),
        ("rebalance_every", 0),
        ("replan_every", 0),
        ("schedule_steps", 0),
        ("checkpoint_every", 0),
    ):
        _check_int(name, getattr(cfg, name), minimum)
    if cfg.top_k > cfg.experts:
        raise FlagError(
            f"--top_k={cfg.top_k} exceeds --experts={cfg.experts}: each token picks top_k "
            "distinct experts"
        )
    head_dim, rest = divmod(cfg.d_model, cfg.heads)
    if rest or head_dim % 2:
        raise FlagError(
            f"--d_model={cfg.d_model} must split into --heads={cfg.heads} heads of even size "
            "(rotary embeddings rotate pairs of features)"
        )
    _check_number("lr", cfg.lr, above=0, optional=False)
    _check_number(
        "capacity_factor",
        cfg.capacity_factor,
        above=0,
        optional=True,
        hint=f", or '{DROPLESS}' (the default) for dropless",
    )
    if not isinstance(cfg.migration, xdc.Migration):
        raise FlagError(f"migration={cfg.migration!r} must be a jax_hybridep.xdc.Migration")
    limit = cfg.memory_limit_mb
    if (
        not isinstance(limit, Real)
        or isinstance(limit, bool)
        or not math.isfinite(limit)
        or limit < 0
    ):
        raise FlagError(f"--memory_limit_mb={limit!r} must be a finite number >= 0 (0: no limit)")
    if cfg.backend not in BACKENDS:
        raise FlagError(f"--backend={cfg.backend!r} must be one of {', '.join(BACKENDS)}")
    if cfg.wire_dtype not in (None, *WIRE_DTYPES):
        raise FlagError(
            f"--wire_dtype={cfg.wire_dtype!r} must be unset (the model's dtype) or one of "
            f"{', '.join(WIRE_DTYPES)}"
        )
    for name in ("resume", "progress", "charge_sync", "prefetch"):
        if not isinstance(getattr(cfg, name), bool):
            raise FlagError(f"--{name}={getattr(cfg, name)!r} must be true or false")
    _check_mesh(cfg, devices)
    _check_data(cfg, data or ByteData.load())


def _check_mesh(cfg: TrainConfig, devices) -> None:
    """The mesh and domains flags against the devices, the experts and the tokens per step."""
    try:
        mesh, topology = make_mesh(cfg.mesh, devices)
    except ValueError as err:
        raise FlagError(str(err)) from None
    spec = cfg.mesh or ",".join(f"{n}={s}" for n, s in mesh.shape.items())
    processes = len({d.process_index for d in devices})
    if processes > 1 and mesh.devices.size < len(devices):
        raise FlagError(
            f"--mesh={spec} uses {mesh.devices.size} of the {len(devices)} devices of the "
            f"{processes} processes; with several processes the mesh must use every device "
            "(each process feeds its own)"
        )
    ep = topology.ep_size
    if cfg.experts % ep:
        raise FlagError(
            f"--experts={cfg.experts} is not divisible by the EP size {ep} of --mesh={spec} "
            f"(EP axes {topology.ep_axes}: every axis but '{DATA_AXIS}'); each EP rank holds "
            "experts / EP of them"
        )
    tokens, shards = cfg.batch * cfg.seq_len, mesh.devices.size
    if tokens % shards:
        raise FlagError(
            f"--batch={cfg.batch} x --seq_len={cfg.seq_len} = {tokens} tokens per step do not "
            f"split evenly over the {shards} devices of --mesh={spec}"
        )
    m, domains = cfg.migration, migration_flags(cfg.migration)["domains"]
    if m.compression is not None and not m.domains:
        raise FlagError(
            f"--domain_compression={m.compression} needs --domains (it compresses the "
            "experts moved inside a domain)"
        )
    if (m.domains or cfg.replan_every) and (cfg.redundant_slots or cfg.rebalance_every):
        raise FlagError(
            f"--redundant_slots={cfg.redundant_slots} / --rebalance_every={cfg.rebalance_every} "
            f"cannot be combined with --domains={domains} or --replan_every="
            f"{cfg.replan_every}: inside a domain every expert is already copied to every member"
        )
    if m.grad_compression is not None and not m.domains and not cfg.replan_every:
        raise FlagError(
            f"--grad_compression={m.grad_compression} needs --domains or --replan_every (it "
            "compresses the gradients of experts moved inside a domain)"
        )
    if m.domains:
        try:
            xdc.ExpertDomains.from_mesh(mesh, topology, m)
        except ValueError as err:
            raise FlagError(f"--domains={domains} on --mesh={spec}: {err}") from None
    _check_replanning(cfg, topology)


def _check_replanning(cfg: TrainConfig, topology) -> None:
    """--replan_every's companions: the links it plans for and their schedule."""
    if not cfg.replan_every:
        for name in ("links", "link_schedule"):
            if getattr(cfg, name) is not None:
                raise FlagError(f"--{name}={getattr(cfg, name)} is only used with --replan_every")
        return
    if cfg.resume:
        # The checkpoint does not record the plan in force, so the restored state's shapes
        # (error-feedback residuals per domain) could not be matched.
        raise FlagError(f"--replan_every={cfg.replan_every} cannot be combined with --resume")
    if not cfg.links:
        raise FlagError(
            f"--replan_every={cfg.replan_every} needs --links (e.g. "
            "dc=10:5:shared,node=100,local=3600), the links to plan for"
        )
    levels = dict(zip((lv[0] for lv in topology.levels), topology.level_sizes, strict=True))
    try:
        xdc.parse_links(cfg.links, levels)
    except ValueError as err:
        raise FlagError(f"--links={cfg.links}: {err}") from None
    try:
        xdc.LinkSchedule.parse(cfg.link_schedule, list(levels))
    except ValueError as err:
        raise FlagError(f"--link_schedule={cfg.link_schedule}: {err}") from None


def _check_data(cfg: TrainConfig, data: ByteData) -> None:
    """Enough train and held-out text for one window of seq_len + 1 bytes per sequence."""
    if len(data.train) <= cfg.seq_len + 1:
        raise FlagError(
            f"--seq_len={cfg.seq_len} is too long for the {len(data.train)}-byte training text"
        )
    windows, room = cfg.eval_batches * cfg.batch, len(data.eval) - cfg.seq_len - 1
    if room < windows:
        raise FlagError(
            f"--eval_batches={cfg.eval_batches} x --batch={cfg.batch} = {windows} held-out "
            f"windows of --seq_len={cfg.seq_len} need more than the {len(data.eval)}-byte "
            "held-out text"
        )


def _check_output_dir(path) -> None:
    check_output_dir(path, "--output_dir")


def check_output_dir(path, flag: str) -> None:
    """FlagError naming `flag` unless `path` is a writable directory or can be created as one
    (its nearest existing ancestor is a directory this process can write into: tried with a
    temporary file, so that it holds for root and read-only filesystems too). Leaves nothing."""
    if not isinstance(path, str) or not path:
        raise FlagError(f"{flag}={path!r} must name a directory")
    path = os.path.abspath(path)
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        if existing == path:
            raise FlagError(f"{flag}={path} exists and is not a directory")
        raise FlagError(f"{flag}={path} cannot be created: {existing} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        what = "is not writable" if existing == path else f"cannot be created in {existing}"
        raise FlagError(f"{flag}={path} {what} ({err.strerror or err})") from None

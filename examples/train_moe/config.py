"""What a run of the main job depends on: its config and the config's validation.

`TrainConfig` holds the flags as one value (tests build it directly), the model's among them as
one `ModelConfig` (`model`). Each setting is written once, as a field with its default and its help
(`job_runtime/flag_fields.setting`): the flag (`flags.py`), the config read back from the flags
and the flags a checkpoint records (`flag_values`) are made from the fields. `check_config`
validates every field before any model is built and raises `FlagError` naming the flag, its value
and what is wrong, in the library's own words where the library has a rule (e.g. experts per EP
rank). The cross-DC flags (--domains, --domain_compression, --domain_shared, --domain_sync_every,
--grad_compression) become one `xdc.Migration` in one place, `parse_migration`, and are spelled
back by `migration_flags`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from numbers import Integral, Real

from examples.job_runtime.errors import FlagError
from examples.job_runtime.flag_fields import flag_fields, setting
from examples.moe_lm.data import ByteData
from examples.moe_lm.model import DATA_AXIS, ModelConfig, make_mesh
from jax_hybridep import balance, xdc
from jax_hybridep.config import BACKENDS
from jax_hybridep.fp8 import WIRE_DTYPES
from jax_hybridep.xdc.migration import SHARED_VARIANTS

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

    A field with help is a flag of that name, its help the flag's --help
    (`job_runtime/flag_fields.py`); so are the model's.

    Attributes:
      model: the model the run trains (sizes, routing, dispatch, cross-DC EP; its `balance` is
        the run's: `built_model`).
      eval_batches: held-out batches per evaluation (no flag).
      progress: show a live progress bar, drawn only on a terminal (no flag).
    """

    steps: int = setting(500, "total training steps (a resumed run continues to it)")
    batch: int = setting(16, "sequences per step")
    seq_len: int = setting(128, "bytes per sequence")
    model: ModelConfig = ModelConfig()  # its flag fields are flags: --d_model, --domains, ...
    mesh: str | None = setting(
        None,
        "mesh axis sizes, e.g. 'node=2,local=4', 'ep=8' or 'data=2,ep=4' "
        "(default: node=2,local=n/2 on CPU, ep=all on GPUs)",
    )
    replan_every: int = setting(0, "re-plan the domains every N steps (needs --links)")
    # Per EP level: Gbps[:latency ms][:shared] (`xdc.parse_links`).
    links: str | None = setting(None, "EP level links to plan for, e.g. dc=10:5:shared,...")
    link_schedule: str | None = setting(None, "link bandwidth changes by step, e.g. '200:dc=1'")
    memory_limit_mb: float = setting(0.0, "per-device memory limit of re-plans (0: none)")
    redundant_slots: int = setting(0, "expert slots per EP rank for copies of hot experts")
    rebalance_every: int = setting(
        0, "re-place the experts every this many steps from the measured load (0: never)"
    )
    charge_sync: bool = setting(
        True, "the balancer charges each replica's sync bytes against the rows it saves"
    )
    lr: float = setting(3e-3, "peak learning rate")
    schedule_steps: int = setting(
        0,
        "the step the learning-rate decay ends at (0: --steps); set it to the final step count "
        "when a run will be resumed to more steps",
    )
    seed: int = setting(0, "random seed (init and data order)")
    output_dir: str = setting("/tmp/train_moe", "metrics, plot and checkpoint go here")
    eval_every: int = setting(50, "evaluate every this many steps")
    checkpoint_every: int = setting(
        0, "also commit a checkpoint and metrics.json every this many steps (0: only at the end)"
    )
    resume: bool = setting(
        False,
        "restore the checkpoint in --output_dir and continue; every flag must equal the "
        f"checkpoint's except {', '.join('--' + n for n in RESUMABLE_FLAGS)}, "
        "--coordinator_address, --process_id and --heartbeat_timeout_s",
    )
    eval_batches: int = 4
    progress: bool = True

    @property
    def built_model(self) -> ModelConfig:
        """The model the run builds: `model` with the blocks' expert placement when the run
        balances (--redundant_slots; with --rebalance_every a placement even without redundant
        slots, so that the rebalancer can move experts), else none."""
        placed = self.redundant_slots or self.rebalance_every
        config = balance.BalanceConfig(self.redundant_slots) if placed else None
        return dataclasses.replace(self.model, balance=config)


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
    """`cfg` as its flags (name -> value; what a checkpoint's meta records): every field but
    `model`, then the model's flag fields, `migration` spelled as its flags. The model's fields
    without a flag (vocabulary, loss weights, placement, per-layer domains) are the code's to set,
    not the run's."""
    values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "model"}
    values.update((f.name, value) for f, value in flag_fields(cfg.model))
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


_TRAIN_FIELDS = frozenset(f.name for f in dataclasses.fields(TrainConfig))


def _flag(cfg: TrainConfig, name: str):
    """The value of the flag `name` in `cfg`: its own field, or its model's."""
    return getattr(cfg, name) if name in _TRAIN_FIELDS else getattr(cfg.model, name)


def check_config(cfg: TrainConfig, devices, data: ByteData | None = None) -> None:
    """Raises FlagError naming the first flag of `cfg` that the run cannot use on `devices`.

    Covers every field: types and ranges, the model's shape rules, the mesh (axes, device count,
    experts per EP rank, tokens per device), the expert domains, the eval and train text's length
    (`data`, loaded when not given) and the output directory (first: creatable and writable).
    Builds no model and creates nothing.
    """
    _check_output_dir(cfg.output_dir)  # first: nothing else is worth checking without it
    m = cfg.model
    if not isinstance(m, ModelConfig):
        raise FlagError(f"model={m!r} must be an examples.moe_lm.model.ModelConfig")
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
        _check_int(name, _flag(cfg, name), minimum)
    if m.top_k > m.experts:
        raise FlagError(
            f"--top_k={m.top_k} exceeds --experts={m.experts}: each token picks top_k "
            "distinct experts"
        )
    head_dim, rest = divmod(m.d_model, m.heads)
    if rest or head_dim % 2:
        raise FlagError(
            f"--d_model={m.d_model} must split into --heads={m.heads} heads of even size "
            "(rotary embeddings rotate pairs of features)"
        )
    _check_number("lr", cfg.lr, above=0, optional=False)
    _check_number(
        "capacity_factor",
        m.capacity_factor,
        above=0,
        optional=True,
        hint=f", or '{DROPLESS}' (the default) for dropless",
    )
    if not isinstance(m.migration, xdc.Migration):
        raise FlagError(f"migration={m.migration!r} must be a jax_hybridep.xdc.Migration")
    limit = cfg.memory_limit_mb
    if (
        not isinstance(limit, Real)
        or isinstance(limit, bool)
        or not math.isfinite(limit)
        or limit < 0
    ):
        raise FlagError(f"--memory_limit_mb={limit!r} must be a finite number >= 0 (0: no limit)")
    if m.backend not in BACKENDS:
        raise FlagError(f"--backend={m.backend!r} must be one of {', '.join(BACKENDS)}")
    if m.wire_dtype not in (None, *WIRE_DTYPES):
        raise FlagError(
            f"--wire_dtype={m.wire_dtype!r} must be unset (the model's dtype) or one of "
            f"{', '.join(WIRE_DTYPES)}"
        )
    for name in ("resume", "progress", "charge_sync", "prefetch"):
        if not isinstance(_flag(cfg, name), bool):
            raise FlagError(f"--{name}={_flag(cfg, name)!r} must be true or false")
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
    if cfg.model.experts % ep:
        raise FlagError(
            f"--experts={cfg.model.experts} is not divisible by the EP size {ep} of --mesh={spec} "
            f"(EP axes {topology.ep_axes}: every axis but '{DATA_AXIS}'); each EP rank holds "
            "experts / EP of them"
        )
    tokens, shards = cfg.batch * cfg.seq_len, mesh.devices.size
    if tokens % shards:
        raise FlagError(
            f"--batch={cfg.batch} x --seq_len={cfg.seq_len} = {tokens} tokens per step do not "
            f"split evenly over the {shards} devices of --mesh={spec}"
        )
    m, domains = cfg.model.migration, migration_flags(cfg.model.migration)["domains"]
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

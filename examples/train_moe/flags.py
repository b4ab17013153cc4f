"""The command line of the main job: one absl flag per flag field of `TrainConfig` (its model's
included), defined from the fields (`job_runtime/flag_fields.py`: the field's default and help),
and the `TrainConfig` the parsed flags describe (`config.py` validates it). Two flags are spelled
otherwise than their fields and defined here: --capacity_factor (a number, or 'none' for None)
and the cross-DC flags a `migration` is made of, which the cross-DC job (`examples/cross_dc/`)
shares (`define_migration_flags`, `migration_from_flags`).

Flags are defined only when a command runs, so that importing these modules, e.g. from a test,
leaves absl's global flag registry alone.
"""

from __future__ import annotations

from absl import flags

from examples.job_runtime import flag_fields
from examples.train_moe.config import (
    DROPLESS,
    TrainConfig,
    migration_flags,
    parse_capacity_factor,
    parse_migration,
)
from jax_hybridep import xdc
from jax_hybridep.xdc.migration import SHARED_VARIANTS

# The fields whose flags are spelled otherwise: defined and read back here.
CUSTOM = ("capacity_factor", "migration")


def define_flags() -> None:
    """The command-line flags, one per flag field of TrainConfig (defined only when a command
    runs, so importing this module, e.g. from a test, leaves absl's global flag registry
    alone)."""
    flag_fields.define_flags(
        TrainConfig(),
        custom=dict(capacity_factor=_define_capacity_factor, migration=define_migration_flags),
        module_name=__name__,
    )


def _define_capacity_factor(default: float | None, text: str) -> None:
    # A float flag has no spelling for None (dropless): the flag is a string, `DROPLESS` or a
    # number, parsed back by `parse_capacity_factor`.
    spelled = DROPLESS if default is None else str(default)
    flags.DEFINE_string("capacity_factor", spelled, f"{text}; '{DROPLESS}' (the default): dropless")


def define_migration_flags(default: xdc.Migration, domains_help: str) -> None:
    """The cross-DC flags `parse_migration` reads: --domains (unset by default) and how experts
    travel, with `default`'s values."""
    flags.DEFINE_string("domains", None, domains_help)
    flags.DEFINE_float(
        "domain_compression", default.compression, "SR compression ratio (> 1) of migrated experts"
    )
    flags.DEFINE_enum(
        "domain_shared", default.shared, list(SHARED_VARIANTS), "SR shared expert (reference)"
    )
    flags.DEFINE_integer(
        "domain_sync_every", default.sync_every, "steps between SR shared-expert refreshes"
    )
    flags.DEFINE_float(
        "grad_compression",
        default.grad_compression,
        "top-k ratio (> 1) of replica gradients, error feedback (lossy)",
    )


def migration_from_flags() -> xdc.Migration:
    """The parsed cross-DC flags as one `xdc.Migration` (FlagError for a bad value)."""
    return parse_migration(**{n: flags.FLAGS[n].value for n in migration_flags(xdc.Migration())})


def config_from_flags() -> TrainConfig:
    """The TrainConfig the parsed command-line flags describe (FlagError for a bad value)."""
    values = flag_fields.parsed_values(TrainConfig(), skip=CUSTOM)
    capacity_factor = parse_capacity_factor(flags.FLAGS["capacity_factor"].value)
    return flag_fields.replace(
        TrainConfig(), **values, capacity_factor=capacity_factor, migration=migration_from_flags()
    )

"""`Migration`: cross-DC expert parallelism as one value, the domains (where experts move) and
how they travel (SR compression and its reference, gradient compression). Plain Python, shared by
the runtime (`runtime.domains`, `runtime.migrate`), the cost model and planner (`model`) and the
Flax block (`nn.MoEBlock(migration=...)`); what each setting does is in `runtime.compress`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jax_hybridep.values import check_int
from jax_hybridep.xdc import expert_wire

SHARED_VARIANTS = ("persistent", "mean", "none")


@dataclasses.dataclass(frozen=True)
class Migration:
    """Cross-DC expert parallelism as one value: where experts move (the domains) and how they
    travel (SR compression and its reference, gradient compression).

    Attributes:
      domains: per EP level (named by its first mesh axis), the domain size S, as a
        {axis: S} mapping or ((axis, S), ...) pairs (kept as pairs); levels left out have S = 1.
        Empty: no domains (plain EP); the planner (`xdc.plan`) chooses domains itself and does
        not read them.
      compression: SR compression ratio of the forward gather (full bytes / bytes sent, > 1);
        None sends experts whole, exact.
      shared: the SR reference, one of `SHARED_VARIANTS` (used only with compression).
      sync_every: "persistent": steps between refreshes of the shared expert (>= 1).
      grad_compression: ratio (> 1) of the gradients' reduce-scatter, top-k with error feedback;
        None returns gradients whole (exact). Opt-in; not exact.
    """

    domains: tuple[tuple[str, int], ...] = ()
    compression: float | None = None
    shared: str = "persistent"
    sync_every: int = 1
    grad_compression: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "domains", _domain_pairs(self.domains))
        for name in ("compression", "grad_compression"):
            value = getattr(self, name)
            if value is not None and not expert_wire.compressed(value):
                raise ValueError(
                    f"Migration.{name} must be None or a ratio > 1 (full bytes / bytes sent), "
                    f"got {value!r}"
                )
        if self.shared not in SHARED_VARIANTS:
            raise ValueError(
                f"Migration.shared must be one of {SHARED_VARIANTS}, got {self.shared!r}"
            )
        check_int("Migration.sync_every", self.sync_every, 1)

    def with_domains(self, domains) -> Migration:
        """These settings over other domains (a mapping or pairs, as `domains`)."""
        return dataclasses.replace(self, domains=domains)

    @property
    def exact(self) -> bool:
        """Whether values and gradients equal plain EP's (nothing is compressed)."""
        return self.compression is None and self.grad_compression is None

    @property
    def persistent(self) -> bool:
        """Whether a persistent shared expert is kept as state (SR with shared="persistent")."""
        return self.compression is not None and self.shared == "persistent"


def _domain_pairs(domains) -> tuple[tuple[str, int], ...]:
    """`Migration.domains` as ((axis, S), ...): names unique, sizes ints >= 1."""
    items = domains.items() if isinstance(domains, Mapping) else domains
    try:
        pairs = tuple((name, size) for name, size in items)
    except (TypeError, ValueError):
        raise TypeError(
            f"Migration.domains must map level axes to domain sizes, e.g. {{'dc': 2}}, got "
            f"{domains!r}"
        ) from None
    for name, size in pairs:
        if not isinstance(name, str) or not name:
            raise TypeError(f"Migration.domains names a level by {name!r}, not an axis name")
        check_int(f"Migration.domains[{name!r}]", size, 1)
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"Migration.domains names a level twice: {names}")
    return tuple((name, int(size)) for name, size in pairs)

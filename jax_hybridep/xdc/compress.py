"""What travels when experts migrate inside a domain: the settings (`Migration`) and the top-k
value-index code that SR compression and gradient compression share.

SR compression (HybridEP's parameter-efficient migration) sends each migrated expert as the top-k
entries, by magnitude, of its residual from a reference expert, per matrix, in value-index form:
`k = max(1, floor(n * value_bytes / (ratio * (value_bytes + 4))))` values in the weights' dtype and
k int32 indices for a matrix of n entries, so `ratio` is full bytes / bytes sent (`wire`). The
receiver decodes reference + scatter(values at indices). The reference (`Migration.shared`):

* "persistent" (the paper's, the default): one shared expert per layer, initialised as the mean of
  the layer's experts and kept as state; every `sync_every` steps it is refreshed to the mean of
  the current experts by an all-reduce whose result is used from the next step on, so nothing in
  the step waits for it. Between refreshes it is stale: what is decoded is not a function of the
  current experts alone (not exact, as no SR is).
* "mean": the mean of the domain's experts, recomputed every step by an all-reduce over the
  domain before the gather (on the critical path).
* "none": no reference, the top-k of the weights themselves (the paper's "w/o shared expert"
  ablation).

Decoding is lossless exactly when a residual has at most k nonzero entries per matrix (then values
and gradients equal plain EP's); otherwise SR is lossy. Gradients are straight-through: each
decoded replica is treated as its owner's exact expert.

Gradient compression (`Migration.grad_compression`, opt-in, not exact): the replicas' gradients
return to their owners as the top-k (same k rule) of gradient + error-feedback residual; what is
not sent stays in the sender's residual and is added to the next step's gradient, so over steps
every gradient entry is eventually delivered (the sum delivered plus the residual left equals the
sum of the true gradients).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jax_hybridep.values import check_int
from jax_hybridep.xdc import wire

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
      compression: SR compression ratio of the forward gather (full bytes / bytes sent); None
        (or <= 1 when built by `make`) sends experts whole, exact.
      shared: the SR reference, one of `SHARED_VARIANTS` (used only with compression).
      sync_every: "persistent": steps between refreshes of the shared expert (>= 1).
      grad_compression: ratio of the gradients' reduce-scatter, top-k with error feedback; None
        returns gradients whole (exact). Opt-in; not exact.
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
            if value is not None and not wire.compressed(value):
                raise ValueError(
                    f"Migration.{name} must be None or a ratio > 1 (full bytes / bytes sent), "
                    f"got {value!r}"
                )
        if self.shared not in SHARED_VARIANTS:
            raise ValueError(
                f"Migration.shared must be one of {SHARED_VARIANTS}, got {self.shared!r}"
            )
        check_int("Migration.sync_every", self.sync_every, 1)

    @classmethod
    def make(
        cls, compression=None, shared="persistent", sync_every=1, grad_compression=None
    ) -> Migration:
        """Settings (no domains) from user values: a ratio that is None or <= 1 means "off"
        (ValueError for one that is not a positive number)."""
        off = lambda r: None if not wire.compressed(r) else float(r)  # noqa: E731
        return cls((), off(compression), shared, sync_every, off(grad_compression))

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


def kept_entries(num_entries: int, dtype, compression: float | None) -> int:
    """k: entries of one matrix sent at compression `compression` (all of them when None)."""
    if compression is None:
        return num_entries
    return wire.topk_count(num_entries, compression, np.dtype(dtype).itemsize)


def sent_bytes(matrix_shape, dtype, compression: float | None) -> int:
    """Bytes one expert matrix of `matrix_shape` costs on the wire."""
    n, value_bytes = math.prod(matrix_shape), np.dtype(dtype).itemsize
    if compression is None:
        return n * value_bytes
    return kept_entries(n, dtype, compression) * (value_bytes + wire.INDEX_BYTES)


def top_k(rows, k: int):
    """(values, int32 indices) of the k entries of largest magnitude of each row [..., n]."""
    _, index = jax.lax.top_k(jnp.abs(rows), k)
    return jnp.take_along_axis(rows, index, axis=-1), index.astype(jnp.int32)


def scatter_rows(base, values, index):
    """base [R, n] + values [R, k] added at `index` [R, k] (rows decoded from value-index form)."""
    rows = jnp.arange(values.shape[0])[:, None]
    return base.at[rows, index].add(values.astype(base.dtype))

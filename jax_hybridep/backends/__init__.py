"""Backend selection: one module per backend, each with the same per-shard functions.

Each backend module provides `layout`, `dispatch`, `level_rows`, `redispatch`, `combine_vjp`,
`combine` and `return_row_values` (see backends/xla.py, the oracle); the ffi backend has one
module for the host handlers (ffi.py) and one for GPUs (ffi_gpu.py). `xla` runs everywhere;
`ffi` where its handlers are built and every mesh axis is manual. `auto` picks `ffi` when it can
run the call and `xla` otherwise, except on GPUs, where the CUDA handlers run only when asked for
(`backend="ffi"`) until they beat the `xla` backend (docs/benchmarks.md); the env var
JAX_HYBRIDEP_BACKEND overrides the config.
"""

from __future__ import annotations

import os

from jax_hybridep.backends import ffi, ffi_gpu, xla
from jax_hybridep.config import BACKEND_ENV, BACKENDS, DispatchConfig, Plan
from jax_hybridep.topology import Topology

_MODULES = {xla.NAME: xla, ffi.NAME: ffi}
# Whether `auto` picks the CUDA handlers on GPUs. Off: on one H200 they are exact but take 4x the
# `xla` backend's time (docs/benchmarks.md, 2026-11-29); backend="ffi" opts in.
GPU_AUTO = False


def resolve(config: DispatchConfig, topology: Topology, manual_axes) -> str:
    """The backend name this call runs on; raises ValueError when `ffi` is forced but cannot run."""
    requested = os.environ.get(BACKEND_ENV, config.backend)
    if requested not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={requested!r}; expected one of {BACKENDS}")
    if requested == xla.NAME:
        return xla.NAME
    if requested == "auto" and topology.platform == "gpu" and not GPU_AUTO:
        return xla.NAME
    reason = ffi.unsupported_reason(topology, manual_axes)
    if reason is None:
        return ffi.NAME
    if requested == ffi.NAME:
        raise ValueError(
            f"backend='ffi' cannot run this dispatch: {reason}. Use backend='xla' or 'auto'."
        )
    return xla.NAME


def get(plan: Plan):
    """The module running `plan`'s backend; the ffi backend's GPU handlers live in ffi_gpu."""
    if plan.backend == ffi.NAME and plan.topology.platform == "gpu":
        return ffi_gpu
    return _MODULES[plan.backend]

"""Emitting the ffi backend's custom calls (host and CUDA handlers alike) and their attributes.

Two attribute bundles recur across handlers: the exchange's (where a call meets its peers: call
site, ranks, timeout) and the layout's (the EP group's static plan); the CUDA transport's
exchanges add how the transport runs. Every handler, host or CUDA, decodes a call's attributes as
one struct built from these bundles (xla_ffi/common/ffi_support.h, xla_ffi/cuda/handlers/attrs.h).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from jax_hybridep import compat
from jax_hybridep.config import DispatchPlan

# Every emitted exchange gets its own call-site id; repeated executions of one call site within
# an execution (scan, remat) are told apart by the handlers' generation counter.
_sites = itertools.count(1)


def next_site() -> np.int64:
    return np.int64(next(_sites))


def call(name, out_types, *args, like, plan: DispatchPlan, **attrs):
    """One custom call jax_hybridep_<name>. `like`: the inputs whose varying manual axes the
    results share."""
    results = jax.ffi.ffi_call(f"jax_hybridep_{name}", out_types)(*args, **attrs)
    # FFI results come back typed as not varying over the manual axes; they vary like the
    # inputs and across the EP group.
    axes = set(plan.topology.ep_axes) | set(plan.topology.group_axes)
    axes &= compat.manual_axes()
    for a in like:
        axes |= compat.varying_axes(a)
    return jax.tree.map(lambda r: compat.mark_varying(r, axes), results)


def i32(shape):
    return jax.ShapeDtypeStruct(shape, jnp.int32)


def exchange_attrs(plan: DispatchPlan, num_ranks: int) -> dict:
    """An exchange's meeting point: a fresh call site, the `num_ranks` ranks that meet there, and
    how long each waits for the others (DispatchConfig.timeout_s) before failing."""
    return dict(
        site=next_site(),
        num_ranks=np.int64(num_ranks),
        timeout_ms=np.int64(round(plan.config.resolved_timeout_s * 1000)),
    )


def transport_attrs(plan: DispatchPlan, num_ranks: int, multi_process: bool) -> dict:
    """A CUDA transport exchange (xla_ffi/cuda/handlers/attrs.h, TransportAttrs): the exchange's
    meeting point, the blocks each of its phases runs on (DispatchConfig.num_sms), and whether
    some of the `num_ranks` GPUs live in other processes (their windows come by CUDA IPC)."""
    return exchange_attrs(plan, num_ranks) | dict(
        num_sms=np.int64(plan.config.num_sms), multi_process=np.bool_(multi_process)
    )


def layout_attrs(plan: DispatchPlan) -> dict:
    """The EP group's static plan for the layout handlers (capacity -1: dropless)."""
    return dict(
        num_ranks=np.int64(plan.ep_size),
        num_slots=np.int64(plan.num_slots),
        capacity=np.int64(-1 if plan.capacity is None else plan.capacity),
        rows=np.int64(plan.rows),
        pad_multiple=np.int64(plan.config.pad_multiple),
        expert_rank=np.asarray(plan.expert_rank, np.int64),
        expert_slot=np.asarray(plan.expert_slot, np.int64),
        strict=np.bool_(plan.config.strict),
    )


def pad_attr(plan: DispatchPlan) -> dict:
    """How the row-writing handlers write rows past sum(group_sizes): zeroed (0) or left unwritten
    (a pad multiple: DispatchConfig(zero_padding=False))."""
    pad = 0 if plan.config.zero_padding else plan.config.pad_multiple
    return dict(sparse_pad_multiple=np.int64(pad))


def row_attrs(plan: DispatchPlan, fp8_hidden: int = 0) -> dict:
    """pad_attr, and whether the sources are FP8 wire rows of H elements (fp8_hidden=H:
    dequantised, or copied into uint8 wire rows) or not (0). The CUDA handlers take the same
    two (xla_ffi/cuda/handlers/attrs.h); the CUDA redispatch takes pad_attr alone."""
    return dict(pad_attr(plan), fp8_hidden=np.int64(fp8_hidden))

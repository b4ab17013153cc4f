"""What the walk carries for each token: x itself, or FP8 on the wire (docs/design.md §2.1.8).

With `DispatchConfig(wire_dtype="float8_e4m3fn")` each token is quantised once, at the source, and
every level moves payload and scales together, never requantising them. How they travel is the
route's `fp8_wire`:
* "split" (the xla steps): the e4m3fn payload's bytes as the items' rows and the float32 scales
  beside them; bytes because XLA:CPU widens f8 collectives to f16, which would double what
  crosses each level.
* "bytes" (the host steps): one wire row of H payload bytes then the scales, which the
  row-moving handlers copy as they copy any row and the receiving handler dequantises while
  writing the expert-major rows.
* "fused" (the GPU route): where the CUDA transport is the first level a token crosses (one
  level), its send kernel quantises the token while writing it into each destination GPU's
  window; below slower levels the token is quantised by XLA at the source and its wire row
  crosses them, then the transport, as bytes. Either way the receive kernel dequantises while
  writing the expert-major rows (or writes the wire rows with fp8_rows).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_hybridep import fp8
from jax_hybridep.config import DispatchPlan
from jax_hybridep.exchange.ffi_call import call


def encode(route, plan: DispatchPlan, x):
    """(rows, scales) the walk starts from: (x, None) in x's dtype, else x quantised (or the
    given (q, scales)) in the route's FP8 wire form."""
    if plan.config.wire_dtype is None:
        return x, None
    if route.fp8_wire is None:
        raise ValueError(
            f"route {route.backend!r} does not carry wire_dtype={plan.config.wire_dtype!r}"
        )
    given = isinstance(x, tuple)
    if route.fp8_wire == "split":
        q, scales = x if given else fp8.quantize(x)
        return jax.lax.bitcast_convert_type(q, jnp.uint8), scales
    if route.fp8_wire == "fused" and not given and not route.levels:
        return x, None  # the transport's send kernel quantises it
    if given or route.fp8_wire == "fused":
        return fp8.to_wire(*(x if given else fp8.quantize(x))), None
    tokens, hidden = x.shape
    wire = jax.ShapeDtypeStruct((tokens, fp8.wire_bytes(hidden)), jnp.uint8)
    return call("fp8_quantize", wire, x, like=(x,), plan=plan), None


def host_rows(plan: DispatchPlan, rows):
    """(output type [C, ...], wire_hidden) of a host handler writing expert-major rows from held
    rows: rows' own type (wire_hidden 0), dequantised FP8 wire rows in plan.row_dtype
    (wire_hidden H), or the wire rows themselves with fp8_rows (wire_hidden 0)."""
    config = plan.config
    if config.wire_dtype is None or rows.dtype != jnp.uint8 or config.fp8_rows:
        return jax.ShapeDtypeStruct((plan.rows, rows.shape[1]), rows.dtype), 0
    return jax.ShapeDtypeStruct((plan.rows, plan.hidden), plan.row_dtype), plan.hidden


def transport_rows(plan: DispatchPlan, x):
    """The type of the rows the CUDA transport writes from held x: x's own, or with FP8 on the
    wire the dequantised rows in plan.row_dtype, or the wire rows themselves with fp8_rows."""
    config = plan.config
    if config.wire_dtype is None:
        return jax.ShapeDtypeStruct((plan.rows, x.shape[1]), x.dtype)
    if config.fp8_rows:
        return jax.ShapeDtypeStruct((plan.rows, fp8.wire_bytes(plan.hidden)), jnp.uint8)
    return jax.ShapeDtypeStruct((plan.rows, plan.hidden), plan.row_dtype)


def handler_tokens(plan: DispatchPlan, tokens):
    """(tokens, scales) as dispatch returns them from the rows a handler (host or CUDA) wrote:
    split into the e4m3fn payload and scales when they are FP8 wire rows (fp8_rows), else as
    they are."""
    if plan.config.wire_dtype is not None and tokens.dtype == jnp.uint8:
        return fp8.from_wire(tokens, plan.hidden)
    return tokens, None

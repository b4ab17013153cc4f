"""What the walk carries for each token: x itself, or FP8 on the wire (docs/design.md §2.1.8).

With `DispatchConfig(wire_dtype="float8_e4m3fn")` each token is quantised once, at the source, and
every level moves payload and scales together, never requantising them. How they travel is the
route's `Carrier`:
* SPLIT (the xla steps): the e4m3fn payload's bytes as the items' rows and the float32 scales
  beside them; bytes because XLA:CPU widens f8 collectives to f16, which would double what
  crosses each level.
* WIRE_ROWS (the host steps): one wire row of H payload bytes then the scales, which the
  row-moving handlers copy as they copy any row and the receiving handler dequantises while
  writing the expert-major rows.
* SEND_QUANTISES (the GPU route): where the CUDA transport is the first level a token crosses
  (one level), its send kernel quantises the token while writing it into each destination GPU's
  window; below slower levels the token is quantised by XLA at the source and its wire row
  crosses them, then the transport, as bytes. Either way the receiving kernel dequantises while
  writing the expert-major rows (or writes the wire rows with fp8_rows).

`WireForm.of(route, plan)` decides, once per dispatch, what the walk starts from and what the
bottom's handler is handed; the steps and bottoms ask it instead of branching on the config.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp

from jax_hybridep import fp8
from jax_hybridep.config import DispatchPlan
from jax_hybridep.exchange.ffi_call import call


class Carrier(enum.Enum):
    """How a route's steps carry FP8 payload and scales (see the module docstring)."""

    SPLIT = "split"
    WIRE_ROWS = "wire_rows"
    SEND_QUANTISES = "send_quantises"


class Encoding(enum.Enum):
    """What the walk starts from."""

    PLAIN = "plain"  # the tokens as they are (no FP8 on the wire, or the send quantises them)
    SPLIT = "split"  # the e4m3fn payload's bytes, the scales beside them
    WIRE_ROWS = "wire_rows"  # one uint8 wire row per token (payload, then scales)


@dataclasses.dataclass(frozen=True)
class WireForm:
    """How one dispatch's tokens travel on its route (static; docs/design.md §2.1.8).

    Attributes:
      encoding: what the walk starts from.
      quantiser: who quantises at the source: None (nobody: no FP8, or x given quantised),
        "jnp", "host" (the fp8_quantize handler) or "send" (the CUDA send kernel).
      fp8_hidden: H when the rows the bottom's handler writes come from FP8 wire rows (or are
        quantised into them by the send), else 0: the handlers' `fp8_hidden` attribute.
      fp8_rows: the rows are delivered as FP8 payload and scales (DispatchConfig.fp8_rows).
    """

    encoding: Encoding
    quantiser: str | None
    fp8_hidden: int
    fp8_rows: bool

    @classmethod
    def of(cls, carrier: Carrier | None, walks_levels: bool, plan: DispatchPlan) -> WireForm:
        """The form of `plan` on a route whose steps carry FP8 as `carrier` (None: no FP8 built)
        and that walks `walks_levels` levels before its bottom."""
        config = plan.config
        if config.wire_dtype is None:
            return cls(Encoding.PLAIN, None, 0, False)
        if carrier is None:
            raise ValueError(f"this route does not carry wire_dtype={config.wire_dtype!r}")
        given = plan.row_dtype == "float8_e4m3fn"  # dispatch got x = (q, scales)
        if carrier is Carrier.SPLIT:
            return cls(Encoding.SPLIT, None if given else "jnp", 0, config.fp8_rows)
        if carrier is Carrier.SEND_QUANTISES and not given and not walks_levels:
            return cls(Encoding.PLAIN, "send", plan.hidden, config.fp8_rows)
        quantiser = None if given else ("jnp" if carrier is Carrier.SEND_QUANTISES else "host")
        return cls(Encoding.WIRE_ROWS, quantiser, plan.hidden, config.fp8_rows)

    def encode(self, plan: DispatchPlan, x):
        """(rows, scales) the walk starts from, from x [T, H] (or the given (q, scales))."""
        if self.encoding is Encoding.PLAIN:
            return x, None
        if self.quantiser is None:
            q, scales = x
        elif self.quantiser == "host":
            tokens, hidden = x.shape
            wire = jax.ShapeDtypeStruct((tokens, fp8.wire_bytes(hidden)), jnp.uint8)
            return call("fp8_quantize", wire, x, like=(x,), plan=plan), None
        else:
            q, scales = fp8.quantize(x)
        if self.encoding is Encoding.SPLIT:
            return jax.lax.bitcast_convert_type(q, jnp.uint8), scales
        return fp8.to_wire(q, scales), None

    def handler_rows(self, plan: DispatchPlan, rows) -> jax.ShapeDtypeStruct:
        """The type of the expert-major rows [C, ...] a handler writes from held rows: the rows'
        own, the dequantised rows in plan.row_dtype, or FP8 wire rows with fp8_rows."""
        if self.encoding is Encoding.PLAIN and self.quantiser is None:
            return jax.ShapeDtypeStruct((plan.rows, rows.shape[1]), rows.dtype)
        if self.fp8_rows:
            return jax.ShapeDtypeStruct((plan.rows, fp8.wire_bytes(plan.hidden)), jnp.uint8)
        return jax.ShapeDtypeStruct((plan.rows, plan.hidden), plan.row_dtype)

    def delivered(self, plan: DispatchPlan, tokens):
        """(tokens, scales) as dispatch returns them from the rows a handler wrote: FP8 wire rows
        (fp8_rows) split into the e4m3fn payload and scales, anything else as it is."""
        if self.fp8_rows:
            return fp8.from_wire(tokens, plan.hidden)
        return tokens, None


# Rows that are what they are: no FP8 anywhere (also what the VJPs carry, always 16-bit).
PLAIN = WireForm(Encoding.PLAIN, None, 0, False)

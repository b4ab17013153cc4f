"""What the two CUDA transports' bottoms share (v1: cuda_bottom.py, v2: cuda_v2.py).

Both span the fastest level with custom calls issued the same way (`transport_call`: on the
configured stream, peers in other processes by CUDA IPC), take the kernels' top-k limit
(`MAX_TOP_K`), and have one structure (`TransportBottom`): `expand` checks what the kernels take,
sends the held items with the transport's own `send` and hands the rows to the wire format;
combine's VJP redispatches g along the record, the scaled rows written in the same pass. A
transport supplies `send`, `partials` and `row_values`, and its record's `route`: the record's
part its exchanges take to retrace the dispatch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax_hybridep import compat, weight_grad
from jax_hybridep.config import DispatchPlan
from jax_hybridep.exchange import steps, wire
from jax_hybridep.exchange.ffi_call import call, transport_attrs

# The kernels' limit on routing slots per token (xla_ffi/limits.h: kMaxTopK; tests/native_test.py
# checks it).
MAX_TOP_K = 64


def transport_call(plan: DispatchPlan, fast: steps.FastLevel, name, out_types, *args, like,
                   **attrs):  # fmt: skip
    """One exchange over the fastest level: the custom call jax_hybridep_<name> with the level
    coordinate and group id last, on the configured stream (DispatchConfig.gpu_stream)."""
    # GPUs of the level in other processes (one process per GPU) are reached by CUDA IPC.
    local = plan.topology.level_local[fast.level]
    attrs.update(transport_attrs(plan, fast.size, multi_process=not local))

    def issue():
        return call(name, out_types, *args, fast.coord, fast.group, like=like, plan=plan, **attrs)

    stream = plan.config.gpu_stream
    return issue() if stream is None else compat.on_gpu_stream(issue, stream)


@dataclasses.dataclass(frozen=True)
class TransportBottom(steps.SpanningBottom):
    """A CUDA transport as the bottom. `exchanges` issues its custom calls (a pure-JAX twin with
    the same methods in the tests); its `redispatch(plan, fast, g, *record.route, scale=None)`
    gives the rows of g, and with `scale` also the scaled rows."""

    exchanges: Any

    def check_rows(self, plan: DispatchPlan, rows) -> None:
        """ValueError for held rows [M, H] the transport cannot send; every row by default."""

    def send(self, plan: DispatchPlan, fast: steps.FastLevel, held: steps.Items, dest):
        """(rows [C, H] as the transport delivers them, row weights [C], the record); dest [M, K]
        is each held (item, k)'s coordinate in the level (-1: none)."""
        raise NotImplementedError

    def expand(self, plan: DispatchPlan, shard: steps.Shard, held: steps.Items):
        if plan.k > MAX_TOP_K:
            raise ValueError(
                f"the CUDA transport takes top-k <= {MAX_TOP_K} (topk_idx has k={plan.k}); "
                "use backend='xla'"
            )
        self.check_rows(plan, held.rows)
        fast = steps.fast_level(plan, shard)
        tokens, row_weights, record = self.send(plan, fast, held, steps.fast_dest(fast, held.dest))
        tokens, scales = wire.handler_tokens(plan, tokens)
        return tokens, scales, row_weights, record

    def redispatch(self, plan: DispatchPlan, shard: steps.Shard, record, g):
        return self.exchanges.redispatch(plan, steps.fast_level(plan, shard), g, *record.route)

    def combine_vjp(self, plan: DispatchPlan, shard: steps.Shard, record, g, y, weights):
        # The transport writes the rows of g and the scaled rows in one pass; the weight gradient
        # is weight_grad.row_dot, as in the xla backend.
        fast = steps.fast_level(plan, shard)
        rows, scaled = self.exchanges.redispatch(plan, fast, g, *record.route, scale=weights)
        return scaled, weight_grad.row_dot(plan.topology.platform, y, rows)

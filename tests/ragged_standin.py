"""A pure-JAX stand-in of `jax.lax.ragged_all_to_all` for CPU, whose XLA cannot compile the op.

It follows the op's documented semantics (its docstring, jax 0.12): the K = len(input_offsets)
slices split evenly over the axis, slice i going to the peer i // (K / S); every caller sends
`operand[input_offsets[i] : input_offsets[i] + send_sizes[i]]` and each receiver writes the slice
it gets from peer s (its slice j) at the offset that sender gave in `output_offsets`, for its own
`recv_sizes[s * K / S + j]` rows, into a copy of `output`. As the op, it assumes the sizes agree
(`send_sizes == all_to_all(recv_sizes)`); where they do not, a receiver writes zeros past what was
sent, so a wrong size shows in the result instead of being hidden.

How: every caller cuts each of its slices out into a block of operand's length (rows past the
slice zero), one tiled `all_to_all` hands each peer its blocks and another the output offsets,
then one scatter writes the received rows (writes off the end of `output` are dropped). It moves
K x len(operand) rows per caller: a test device, not a transport.

`RaggedLevel(exchange=ragged_all_to_all)` runs the ragged level step through it on CPU
(tests/route_kinds.py); tests/ragged_test.py holds it to the docstring's worked example and to
hand-made cases.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ragged_all_to_all(
    operand,
    output,
    input_offsets,
    send_sizes,
    output_offsets,
    recv_sizes,
    *,
    axis_name,
    axis_index_groups=None,
):
    """`jax.lax.ragged_all_to_all`'s result, in pure JAX (inside `shard_map`)."""
    if axis_index_groups is not None:
        raise NotImplementedError("the stand-in takes no axis_index_groups")
    lengths = {a.shape for a in (input_offsets, send_sizes, output_offsets, recv_sizes)}
    if len(lengths) != 1 or len(next(iter(lengths))) != 1:
        raise ValueError(f"offsets and sizes must be 1-D of one length, got {sorted(lengths)}")
    if operand.shape[1:] != output.shape[1:]:
        raise ValueError(f"operand {operand.shape} and output {output.shape} rows differ")
    slices, rows = input_offsets.shape[0], operand.shape[0]
    size = jax.lax.psum(1, axis_name)
    if slices % size:
        raise ValueError(f"{slices} slices do not split over an axis of {size}")
    if rows == 0:
        return output
    r = jnp.arange(rows, dtype=jnp.int32)
    src = input_offsets[:, None].astype(jnp.int32) + r[None, :]  # [K, rows]
    sent = (r[None, :] < send_sizes[:, None]) & (src >= 0) & (src < rows)
    trailing = (1,) * (operand.ndim - 1)
    blocks = jnp.where(
        sent.reshape(sent.shape + trailing), operand[jnp.clip(src, 0, rows - 1)], 0
    ).astype(operand.dtype)
    # Tiled over axis 0: the blocks of peer d's slices go to d; each caller gets, in source
    # order, the blocks addressed to it and the output offsets their senders chose.
    got = jax.lax.all_to_all(blocks, axis_name, 0, 0, tiled=True)
    offsets = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    target = offsets[:, None].astype(jnp.int32) + r[None, :]
    keep = (r[None, :] < recv_sizes[:, None]) & (target >= 0)
    target = jnp.where(keep, target, output.shape[0])  # past the end: dropped
    return output.at[target.reshape(-1)].set(got.reshape((-1,) + operand.shape[1:]), mode="drop")

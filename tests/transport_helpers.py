"""The §2.1 numpy model of one exchange round that the GPU transport tests (and the host
executor's) hold the kernels against: routings, the layout of §2.1.2-3 written out, values with
the awkward cases, and `Round`, one round's inputs and the model's outputs (docs/design.md §2.1).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from contract_cases import ROUTINGS as CONTRACT_ROUTINGS

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def routing(name: str, rng: np.random.Generator, R=4, T=24, K=3, E=8) -> np.ndarray:
    """idx [R, T, K] of the kernel tests' routing `name`, or of a contract-suite routing
    (tests/contract_cases.py) drawn for each source rank."""
    if name in CONTRACT_ROUTINGS and name != "random":
        return np.stack([CONTRACT_ROUTINGS[name](rng, T, K, E) for _ in range(R)]).astype(np.int32)
    if name == "random":
        idx = rng.integers(-1, E, size=(R, T, K))
    elif name == "all_minus_one":
        idx = np.full((R, T, K), -1)
    elif name == "one_expert":
        idx = np.full((R, T, K), 5)
    elif name == "duplicates":
        idx = np.repeat(rng.integers(0, E, size=(R, T, 1)), K, axis=2)
        idx[:, ::3, -1] = -1
    elif name == "invalid":
        idx = rng.choice([-7, -2, -1, 0, 3, E, E + 100, 2**31 - 1], size=(R, T, K))
    elif name == "empty_rank":
        idx = rng.integers(0, E, size=(R, T, K))
        idx[1] = -1
    elif name == "many_chunks":  # T * K spans several 2048-id chunks, not a multiple of 32
        idx = rng.integers(-1, E, size=(2, 1501, 3))
        idx[0, :700] = 6
    else:
        raise ValueError(name)
    return idx.astype(np.int32)


# The layout kernels' routings; exchanges take all but many_chunks (which has its own shape).
ROUTINGS = (
    "random",
    "all_minus_one",
    "one_expert",
    "duplicates",
    "invalid",
    "empty_rank",
    "many_chunks",
)
EXCHANGE_ROUTINGS = ROUTINGS[:-1]
# The rows the GPU transport tests send: 2052 float32 = 8208 bytes (two bulk chunks on Hopper,
# whole 16-byte words) and 300 bfloat16 = 600 bytes (not whole 16-byte words: the G2S lanes load
# them, stores stay bulk).
ROWS = (("float32", 2052), ("bfloat16", 300))


def on_every_round(test):
    """A GPU test over 2, 4 and 8 ranks, every exchange routing and both kinds of `ROWS`."""
    for mark in (
        pytest.mark.parametrize("dtype, hidden", ROWS),
        pytest.mark.parametrize("routing", EXCHANGE_ROUTINGS),
        pytest.mark.parametrize("ranks", [2, 4, 8]),
        pytest.mark.gpu,
    ):
        test = mark(test)
    return test


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def layout_args(idx: np.ndarray, E: int, mode: str):
    """Keyword arguments of cuda_selftest_layout for a placement/capacity `mode`."""
    R, T, K = idx.shape
    S = E // R if E % R == 0 else E // R + 1
    rank = np.arange(E) // S
    slot = np.arange(E) % S
    pad = 1
    if mode == "permuted":  # experts scattered over ranks and slots, still one per slot
        perm = np.random.default_rng(7).permutation(R * S)[:E]
        rank, slot = perm // S, perm % S
    if mode in ("dropless", "permuted"):
        capacity, rows = -1, T * R * min(K, S)
    elif mode == "capacity":  # f = 1.0, pad_multiple 4 (§2.1.3)
        pad = 4
        capacity = round_up(round_up(T * R * K, E) // E, pad)
        rows = S * capacity
    elif mode == "tight_rows":  # fewer rows than the groups want: room runs out mid-rank
        pad, capacity, rows = 2, -1, 7
    else:
        raise ValueError(mode)
    return dict(
        topk_idx=idx,
        num_experts=E,
        placement_rank=rank.astype(np.int64),
        placement_slot=slot.astype(np.int64),
        num_slots=S,
        capacity=capacity,
        rows=rows,
        pad_multiple=pad,
    )


def numpy_layout(
    topk_idx, num_experts, placement_rank, placement_slot, num_slots, capacity, rows, pad_multiple
):
    """§2.1.2-3 written out: rows per expert in (source rank, t, k) order, groups slot by slot."""
    R, T, K = topk_idx.shape
    E, S, pad = num_experts, num_slots, pad_multiple
    flat = topk_idx.reshape(R, T * K).astype(np.int64)
    valid = (flat >= 0) & (flat < E)
    counts = np.zeros((R, E), np.int32)
    for r in range(R):
        np.add.at(counts[r], flat[r][valid[r]], 1)
    tpe = counts.sum(0).astype(np.int32)
    slot_expert = np.full((R, S), -1)
    slot_expert[placement_rank, placement_slot] = np.arange(E)
    keep, offset = np.zeros(E, np.int32), np.zeros(E, np.int32)
    sizes = np.zeros((R, S), np.int32)
    for r in range(R):
        at = 0
        for s in range(S):
            e = slot_expert[r, s]
            kept = min(tpe[e] if e >= 0 else 0, (rows - at) // pad * pad)
            if capacity >= 0:
                kept = min(kept, capacity)
            sizes[r, s] = -(-kept // pad) * pad
            if e >= 0:
                keep[e], offset[e] = kept, at
            at += sizes[r, s]
    row_pos = np.full((R, T * K), -1, np.int32)
    index = np.zeros(E, np.int64)
    for r in range(R):
        for i in np.flatnonzero(valid[r]):
            e = flat[r, i]
            if index[e] < keep[e]:
                row_pos[r, i] = offset[e] + index[e]
            index[e] += 1
    dropped = (valid & (row_pos < 0)).sum(1).astype(np.int64)
    return dict(
        counts=counts,
        invalid=(~valid & (flat != -1)).sum(1).astype(np.int64),
        keep_limit=keep,
        group_offset=offset,
        group_sizes=sizes,
        tokens_per_expert=tpe,
        row_pos=row_pos.reshape(R, T, K),
        dropped=dropped,
        dropped_per_source=dropped,
    )


def values(rng, shape, dtype: str) -> np.ndarray:
    """Random values with the awkward cases mixed in: ±0, subnormals, halfway points, big ones."""
    v = rng.standard_normal(shape).astype(np.float32) * np.float32(3)
    flat = v.reshape(-1)
    specials = np.array(
        [0.0, -0.0, 1e-40, -3e-39, 6e-8, 2.9e-8, 1 + 2**-8, 1 + 3 * 2**-8, 65504, 3e4, -1e38],
        np.float32,
    )
    flat[: min(len(specials), flat.size)] = specials[: flat.size]
    with np.errstate(over="ignore"):  # -1e38 is meant to become -inf in 16 bits
        return v.astype(DTYPES[dtype])


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


class Round:
    """Inputs of one harness round over R ranks, and the numpy model's outputs."""

    def __init__(
        self,
        routing_name: str,
        dtype: str,
        hidden: int,
        R: int,
        T: int = 24,
        K: int = 3,
        seed: int = 0,
        mode: str = "dropless",
    ):
        rng = np.random.default_rng([R, hidden, seed])
        E = 2 * R
        idx = routing(routing_name, rng, R=R, T=T, K=K, E=E)
        args = layout_args(idx, E, mode)
        row_pos = numpy_layout(**args)["row_pos"].astype(np.int32)
        safe = np.clip(idx, 0, E - 1)
        self.dest = np.where(row_pos >= 0, args["placement_rank"][safe], -1).astype(np.int32)
        self.row_pos = row_pos
        self.R, self.T, self.K, self.C = R, T, K, args["rows"]
        self.dtype, self.hidden = dtype, hidden
        np_dtype = DTYPES[dtype]
        self.x = values(rng, (R, T, hidden), dtype)
        self.weights = rng.standard_normal((R, T, K)).astype(np.float32)
        self.y = values(rng, (R, self.C, hidden), dtype)
        self.y_weights = rng.standard_normal((R, self.C)).astype(np.float32)
        self.g = values(rng, (R, T, hidden), dtype)
        self.scale = rng.standard_normal((R, self.C)).astype(np.float32)
        self.scale[:, ::5] *= -1  # negative scales: unfilled rows become -0
        self.values = rng.standard_normal((R, self.C)).astype(np.float32)
        self.np_dtype = np_dtype

    def inputs(self, weighted: bool) -> dict:
        """This round's arguments of the reference `transport_reference` (before stacking
        rounds)."""
        as_bytes = lambda a: np.ascontiguousarray(a).view(np.uint8).reshape(a.shape[:2] + (-1,))  # noqa: E731
        return dict(
            x=as_bytes(self.x),
            dest=self.dest,
            row_pos=self.row_pos,
            weights=self.weights,
            y=as_bytes(self.y),
            y_weights=self.y_weights if weighted else None,
            g=as_bytes(self.g),
            scale=self.scale,
            values=self.values,
        )

    def zero_lines(self, zero_pad_multiple: int) -> np.ndarray:
        """[R] rows of each rank's receive rows a permute writes: all C (zero_pad_multiple 0), or
        up to its last received row + 1 rounded up to the multiple (DispatchConfig(
        zero_padding=False): sum(group_sizes)); the rows past it stay unwritten."""
        last = np.zeros(self.R, np.int64)
        for _, _, _, d, row in self.sends():
            last[d] = max(last[d], row + 1)
        if zero_pad_multiple == 0:
            return np.full(self.R, self.C, np.int64)
        return np.minimum(-(-last // zero_pad_multiple) * zero_pad_multiple, self.C)

    def sends(self):
        """(src, t, k, d, row) for every kept row."""
        for src, t, k in zip(*np.nonzero(self.dest >= 0), strict=True):
            yield src, t, k, int(self.dest[src, t, k]), int(self.row_pos[src, t, k])

    def expected(self, weighted: bool) -> dict:
        R, T, K, C, H = self.R, self.T, self.K, self.C, self.hidden
        recv = np.full((R, R * T, K), -1, np.int32)
        tokens = np.zeros((R, C, H), self.np_dtype)
        weights = np.zeros((R, C), np.float32)
        redispatched = np.zeros((R, C, H), self.np_dtype)
        # Rows nobody fills: 0 * scale, which is -0 for negative scales.
        zero_scaled = np.float32(0) * self.scale
        scaled = np.repeat(zero_scaled[:, :, None], H, axis=2).astype(self.np_dtype)
        row_values = np.zeros((R, T, K), np.float32)
        partial = np.zeros((R, R, T, H), np.float32)  # [src, d, t]: f32 sum over ascending k
        for src, t, k, d, row in self.sends():
            recv[d, src * T + t, k] = row
            tokens[d, row] = self.x[src, t]
            weights[d, row] = self.weights[src, t, k]
            redispatched[d, row] = self.g[src, t]
            with np.errstate(over="ignore", invalid="ignore"):
                scaled[d, row] = (self.g[src, t].astype(np.float32) * self.scale[d, row]).astype(
                    self.np_dtype
                )
            row_values[src, t, k] = self.values[d, row]
            v = self.y[d, row].astype(np.float32)
            if weighted:
                v = v * self.y_weights[d, row]
            partial[src, d, t] = partial[src, d, t] + v
        combined = np.zeros((R, T, H), np.float32)
        with np.errstate(over="ignore"):
            rounded = partial.astype(self.np_dtype).astype(np.float32)  # a partial crosses rounded
            for src in range(R):
                for t in range(T):
                    for d in sorted({int(d) for d in self.dest[src, t] if d >= 0}):
                        combined[src, t] = combined[src, t] + rounded[src, d, t]
            combined = combined.astype(self.np_dtype)
        return dict(
            tokens=tokens,
            weights=weights,
            recv_row_pos=recv,
            combined=combined,
            redispatched=redispatched,
            scaled=scaled,
            row_values=row_values,
        )


def stacked_inputs(rounds: list[Round], weighted: bool) -> dict:
    """The rounds' inputs (`Round.inputs`) stacked on a leading round axis, as the hooks take them
    (None stays None)."""
    per_round = [r.inputs(weighted) for r in rounds]
    return {
        key: None if per_round[0][key] is None else np.stack([p[key] for p in per_round])
        for key in per_round[0]
    }


def run_harness(module, rounds: list[Round], weighted: bool, **kw) -> dict:
    """The transport's virtual-rank harness (`module.cuda_selftest_transport`, the GPU's or the
    host executor's) over the rounds in order on one set of windows; [N, R, ...] outputs."""
    inputs = stacked_inputs(rounds, weighted)
    del inputs["values"]  # the routing-weight gradient returns by XLA, not by the transport
    return module.cuda_selftest_transport(rounds[0].dtype, rounds[0].C, **inputs, **kw)


def got_bits(got: np.ndarray, want: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both arrays' bytes, shaped as the hook's output (which may be raw bytes or typed)."""
    got_bytes = bits(got)
    return got_bytes, bits(want).reshape(got_bytes.shape)


def gathered(case: Round) -> np.ndarray:
    """The level's routing as the slot map gets it all-gathered: [R, T, K, 3] of
    (destination, row, weight bits)."""
    return np.stack([case.dest, case.row_pos, case.weights.view(np.int32)], axis=-1)


# The outputs of a round in receive rows: with a zero_pad_multiple, only those below a rank's
# zero line are written (Round.zero_lines).
RECEIVE_ROWS = ("tokens", "redispatched", "scaled")


def check_round(
    module, got: dict, n: int, case: Round, weighted: bool, what: str, zero_pad_multiple: int = 0
):
    """Round n of the transport's harness against the model, bit for bit, and every rank's layout
    against the reference (`module`'s cuda_slot_map). With `zero_pad_multiple` (the harness's),
    receive rows past each rank's zero line are not compared: nothing writes them."""
    want = case.expected(weighted)
    lines = case.zero_lines(zero_pad_multiple)
    for key in ("tokens", "weights", "combined", "redispatched", "scaled"):
        value = got[key][n]
        if key in RECEIVE_ROWS and zero_pad_multiple > 0:
            for r, line in enumerate(lines):
                np.testing.assert_array_equal(
                    bits(value[r, :line]),
                    bits(want[key][r, :line]).reshape(bits(value[r, :line]).shape),
                    err_msg=f"{what}: {key} of rank {r} below its zero line {line}",
                )
            continue
        np.testing.assert_array_equal(
            bits(value), bits(want[key]).reshape(bits(value).shape), err_msg=f"{what}: {key}"
        )
    for r in range(case.R):
        ref = module.cuda_slot_map(gathered(case), r, case.C, reference=True)
        for key in ("send_slot", "recv_item", "recv_rows", "row_slot", "info"):
            np.testing.assert_array_equal(got[key][n, r], ref[key], err_msg=f"{what}: {key} {r}")

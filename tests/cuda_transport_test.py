"""The GPU direct-write transport (xla_ffi/cuda/transport.h) on one GPU, bit for bit (docs/design.md
§2.1).

`cuda_selftest_transport` runs R ranks on one GPU, their windows separate allocations, with the
same device code as the FFI handlers: through the virtual-rank harness (every exchange one
cooperative launch with each rank's blocks resident) or through the per-rank launchers on one
stream per rank with nothing but the flags between them (a rank's next send then overlaps its
peers' receives, as across GPUs). Each round runs dispatch, combine, redispatch (scaled) and row
values with its own routing and values, so reading a stale window half would show.
Tests marked `gpu` compare every output with a numpy model of §2.1; they skip without a CUDA build
or a GPU, and fail instead when JAX_HYBRIDEP_REQUIRE_GPU=1.
"""

from __future__ import annotations

import numpy as np
import pytest
from cuda_kernels_test import (
    DTYPES,
    _bits,
    _layout_args,
    _numpy_layout,
    _routing,
    _values,
)

from jax_hybridep import _native

native = _native.testing_module()


class Round:
    """Inputs of one harness round over R ranks, and the numpy model's outputs."""

    def __init__(
        self, routing: str, dtype: str, hidden: int, R: int, T: int = 24, K: int = 3, seed: int = 0
    ):
        rng = np.random.default_rng([R, hidden, seed])
        E = 2 * R
        idx = _routing(routing, rng, R=R, T=T, K=K, E=E)
        args = _layout_args(idx, E, "dropless")
        row_pos = _numpy_layout(**args)["row_pos"].astype(np.int32)
        safe = np.clip(idx, 0, E - 1)
        self.dest = np.where(row_pos >= 0, args["placement_rank"][safe], -1).astype(np.int32)
        self.row_pos = row_pos
        self.R, self.T, self.K, self.C = R, T, K, args["rows"]
        self.dtype, self.hidden = dtype, hidden
        np_dtype = DTYPES[dtype]
        self.x = _values(rng, (R, T, hidden), dtype)
        self.weights = rng.standard_normal((R, T, K)).astype(np.float32)
        self.y = _values(rng, (R, self.C, hidden), dtype)
        self.y_weights = rng.standard_normal((R, self.C)).astype(np.float32)
        self.g = _values(rng, (R, T, hidden), dtype)
        self.scale = rng.standard_normal((R, self.C)).astype(np.float32)
        self.scale[:, ::5] *= -1  # negative scales: unfilled rows become -0
        self.values = rng.standard_normal((R, self.C)).astype(np.float32)
        self.np_dtype = np_dtype

    def inputs(self, weighted: bool) -> dict:
        """This round's arguments of cuda_selftest_transport (before stacking rounds)."""
        as_bytes = lambda a: np.ascontiguousarray(a).view(np.uint8).reshape(a.shape[:2] + (-1,))  # noqa: E731
        return dict(
            x=as_bytes(self.x), dest=self.dest, row_pos=self.row_pos, weights=self.weights,
            y=as_bytes(self.y), y_weights=self.y_weights if weighted else None, g=as_bytes(self.g),
            scale=self.scale, values=self.values,
        )  # fmt: skip

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
            tokens=tokens, weights=weights, recv_row_pos=recv, combined=combined,
            redispatched=redispatched, scaled=scaled, row_values=row_values,
        )  # fmt: skip


def run_rounds(
    rounds: list[Round], weighted: bool, send_blocks: int = 1, per_rank_streams=False,
    reference=False,
):  # fmt: skip
    """Runs the rounds in order on one set of windows (with reference=True: by the host kernels,
    no GPU); returns each round's outputs."""
    first = rounds[0]
    per_round = [r.inputs(weighted) for r in rounds]
    stacked = {
        key: None if per_round[0][key] is None else np.stack([p[key] for p in per_round])
        for key in per_round[0]
    }
    if reference:
        out = native.transport_reference(first.dtype, first.C, **stacked)
    else:
        out = native.cuda_selftest_transport(
            first.dtype, first.C, **stacked, send_blocks=send_blocks,
            per_rank_streams=per_rank_streams,
        )  # fmt: skip
    return [{key: value[n] for key, value in out.items() if key != "blocks_resident"}
            for n in range(len(rounds))]  # fmt: skip


def got_bits(got: np.ndarray, want: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both arrays' bytes, shaped as the hook's output (which may be raw bytes or typed)."""
    got_bytes = _bits(got)
    return got_bytes, _bits(want).reshape(got_bytes.shape)


def _assert_round(got: dict, want: dict, what: str):
    for key, value in want.items():
        np.testing.assert_array_equal(*got_bits(got[key], value), err_msg=f"{what}: {key}")


ROUTINGS = ("random", "all_minus_one", "one_expert", "duplicates", "invalid", "empty_rank")
# The rows both transports' main test sends (tests/cuda_v2_transport_test.py too): 2052 float32 =
# 8208 bytes (two bulk chunks on Hopper, whole 16-byte words) and 300 bfloat16 = 600 bytes (the
# plain path; in v2 not whole 16-byte words: the G2S lanes load them, stores stay bulk).
ROWS = (("float32", 2052), ("bfloat16", 300))


def on_every_round(test):
    """A GPU test over 2, 4 and 8 ranks, every routing and both kinds of `ROWS`."""
    for mark in (
        pytest.mark.parametrize("dtype, hidden", ROWS),
        pytest.mark.parametrize("routing", ROUTINGS),
        pytest.mark.parametrize("ranks", [2, 4, 8]),
        pytest.mark.gpu,
    ):
        test = mark(test)
    return test


@on_every_round
def test_transport_matches_numpy(gpu, ranks, routing, dtype, hidden):
    case = Round(routing, dtype, hidden, R=ranks)
    for weighted in (False, True):
        (got,) = run_rounds([case], weighted, send_blocks=3)
        _assert_round(got, case.expected(weighted), f"weighted={weighted}")


@pytest.mark.gpu
@pytest.mark.parametrize("per_rank_streams", [False, True])
@pytest.mark.parametrize("send_blocks", [1, 2, 5])
@pytest.mark.parametrize("hidden", [5, 256])
def test_transport_reuses_windows(gpu, per_rank_streams, send_blocks, hidden):
    """Five rounds, each with new routing and values, on one set of windows: both halves are
    reused behind the flags and no round sees another's data."""
    routings = ("random", "duplicates", "one_expert", "random", "empty_rank")
    rounds = [Round(r, "float16", hidden, R=4, seed=n) for n, r in enumerate(routings)]
    got = run_rounds(rounds, True, send_blocks, per_rank_streams)
    for n, case in enumerate(rounds):
        _assert_round(got[n], case.expected(weighted=True), f"round {n} ({routings[n]})")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_transport_nonfinite_combine(gpu, dtype):
    """inf and NaN in the expert outputs: the same bits as the host kernels everywhere but NaN
    payloads. A NaN made or propagated by float arithmetic has the platform's own payload (x86:
    0xffc00000 for inf - inf; NVIDIA GPUs: canonical 0x7fffffff), so those compare as "both NaN"."""
    case = Round("random", dtype, 8, R=4)
    case.y[:, ::3, 0] = np.inf
    case.y[:, 1::3, 1] = -np.inf
    case.y[:, ::2, 1] = np.nan
    case.y[:, 1::4, 2] = DTYPES[dtype](-np.inf)
    case.y[:, ::4, 2] = DTYPES[dtype](np.inf)
    (want,) = run_rounds([case], True, reference=True)
    (got,) = run_rounds([case], True, send_blocks=2)
    want_rows = want["combined"].view(case.np_dtype).astype(np.float32)
    got_rows = got["combined"].view(case.np_dtype).astype(np.float32)
    nan = np.isnan(want_rows)
    assert nan.any() and np.isinf(want_rows).any()
    np.testing.assert_array_equal(np.isnan(got_rows), nan)
    np.testing.assert_array_equal(_bits(got_rows[~nan]), _bits(want_rows[~nan]))


def test_transport_hook_rejects_bad_shapes(cuda_build):
    case = Round("random", "float32", 4, R=2)
    args = {k: None if v is None else v[None] for k, v in case.inputs(weighted=False).items()}
    with pytest.raises(ValueError, match=r"y: expected shape \(1, 2,"):
        native.cuda_selftest_transport(
            "float32", case.C, **{**args, "y": np.zeros((1, 2, 1, 16), np.uint8)}, send_blocks=1
        )
    bad = args["dest"].copy()
    bad[0, 0, 0, 0] = 5
    with pytest.raises(ValueError, match="dest has 5, outside"):
        native.cuda_selftest_transport("float32", case.C, **{**args, "dest": bad}, send_blocks=1)


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_numpy_model_matches_host_kernels(routing, dtype):
    """The model the GPU tests trust, against the host handlers' kernels of the same steps
    (exchange.h's pull transport: PullRows, PullCombine, PullRowValues) on the same rounds, every
    output bit for bit; no GPU needed. Two rounds, so a stale round would show."""
    rounds = [Round(routing, dtype, 7, R=4, seed=n) for n in range(2)]
    for weighted in (False, True):
        got = run_rounds(rounds, weighted, reference=True)
        for n, case in enumerate(rounds):
            _assert_round(got[n], case.expected(weighted), f"round {n} weighted={weighted}")


def test_reference_hook_rejects_bad_shapes():
    case = Round("random", "float32", 4, R=2)
    args = {k: None if v is None else v[None] for k, v in case.inputs(weighted=False).items()}
    with pytest.raises(ValueError, match=r"scale: expected shape \(1, 2,"):
        native.transport_reference("float32", case.C, **{**args, "scale": np.zeros((1, 2, 3))})
    bad = args["row_pos"].copy()
    bad[0, 0, 0, 0] = -1 if bad[0, 0, 0, 0] >= 0 else 0
    with pytest.raises(ValueError, match="dest and row_pos disagree on -1"):
        native.transport_reference("float32", case.C, **{**args, "row_pos": bad})

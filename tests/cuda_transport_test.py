"""The GPU direct-write transport (xla_ffi/cuda/transport.h) on one GPU, bit for bit (DESIGN §2.1).

`cuda_selftest_transport` runs R virtual ranks on one GPU through the virtual-rank harness: their
windows are separate allocations, every exchange one cooperative launch with each rank's blocks
resident, the same device code as the FFI handlers. Each round runs dispatch, combine, redispatch
(scaled) and row values; several rounds reuse both window halves behind the generation flags.
Tests marked `gpu` compare every output with a numpy model of §2.1; they skip without a CUDA build
or a GPU, and fail instead when JAX_HYBRIDEP_REQUIRE_GPU=1.
"""

from __future__ import annotations

import numpy as np
import pytest
from cuda_kernels_test import DTYPES, _bits, _layout_args, _numpy_layout, _routing, _values

from jax_hybridep import _hybridep as native


class Round:
    """Inputs of one harness round over R ranks, and the numpy model's outputs."""

    def __init__(self, routing: str, dtype: str, hidden: int, R: int, T: int = 24, K: int = 3):
        rng = np.random.default_rng(R * 7 + hidden)
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

    def run(self, send_blocks: int, rounds: int, weighted: bool) -> dict:
        as_bytes = lambda a: np.ascontiguousarray(a).view(np.uint8).reshape(a.shape[:2] + (-1,))  # noqa: E731
        return native.cuda_selftest_transport(
            self.dtype, self.C, as_bytes(self.x), self.dest, self.row_pos, self.weights,
            as_bytes(self.y), self.y_weights if weighted else None, as_bytes(self.g), self.scale,
            self.values, send_blocks=send_blocks, rounds=rounds,
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


def _assert_round(got: dict, want: dict, what: str):
    for key, value in want.items():
        np.testing.assert_array_equal(
            _bits(got[key]), _bits(value).reshape(got[key].shape), err_msg=f"{what}: {key}"
        )


ROUTINGS = ("random", "all_minus_one", "one_expert", "duplicates", "invalid", "empty_rank")


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_transport_matches_numpy(gpu, ranks, routing, dtype):
    # 300 bf16 = 600 bytes a row: the plain path; 2052 f32 = 8208 bytes: two bulk chunks on Hopper.
    hidden = 2052 if dtype == "float32" else 300
    case = Round(routing, dtype, hidden, R=ranks)
    for weighted in (False, True):
        _assert_round(case.run(send_blocks=3, rounds=1, weighted=weighted),
                      case.expected(weighted), f"weighted={weighted}")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("send_blocks", [1, 2, 7])
@pytest.mark.parametrize("hidden", [5, 256])
def test_transport_reuses_windows(gpu, send_blocks, hidden):
    """Later rounds reuse both halves of every window behind the flags; same bits each time."""
    case = Round("random", "float16", hidden, R=4)
    want = case.expected(weighted=True)
    _assert_round(case.run(send_blocks, rounds=5, weighted=True), want, "after 5 rounds")


def test_transport_hook_rejects_bad_shapes(cuda_build):
    case = Round("random", "float32", 4, R=2)
    with pytest.raises(ValueError, match=r"y: expected shape \(2,"):
        native.cuda_selftest_transport(
            "float32", case.C, case.x.view(np.uint8).reshape(2, case.T, -1), case.dest,
            case.row_pos, case.weights, np.zeros((2, 1, 16), np.uint8), None,
            case.g.view(np.uint8).reshape(2, case.T, -1), case.scale, case.values, send_blocks=1,
        )  # fmt: skip
    bad = case.dest.copy()
    bad[0, 0, 0] = 5
    with pytest.raises(ValueError, match="dest has 5, outside"):
        native.cuda_selftest_transport(
            "float32", case.C, case.x.view(np.uint8).reshape(2, case.T, -1), bad, case.row_pos,
            case.weights, case.y.view(np.uint8).reshape(2, case.C, -1), None,
            case.g.view(np.uint8).reshape(2, case.T, -1), case.scale, case.values, send_blocks=1,
        )  # fmt: skip

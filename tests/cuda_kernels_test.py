"""CUDA per-rank kernels against the host kernels and a numpy model, bit for bit (docs/design.md
§2.1, §5).

The native module's `cuda_selftest_*` hooks run one layout or exchange step on the GPU, or with
`reference=True` the host kernel of the same name, on the same host inputs. Tests marked `gpu`
compare the two (and a numpy model of §2.1); they skip without a CUDA build or a GPU, and fail
instead when JAX_HYBRIDEP_REQUIRE_GPU=1. The unmarked tests run anywhere the module was built with
CUDA: they check the numpy model against the host kernels, so a GPU run only tests the kernels.

Every rank here is a virtual rank on one device: peers' buffers are separate allocations reached
through a device array of pointers, as NVLink peer memory would be.
"""

from __future__ import annotations

import os
import pathlib
import shutil

import ml_dtypes
import numpy as np
import pytest

from jax_hybridep import _hybridep as native

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def test_built_with_cuda_when_nvcc_present():
    if os.environ.get("JAX_HYBRIDEP_CUDA", "").upper() == "OFF":
        pytest.skip("JAX_HYBRIDEP_CUDA=OFF: a host-only build was asked for")
    nvcc = shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if pathlib.Path("/usr/local/cuda/bin/nvcc").exists() else None
    )
    if nvcc is None:
        pytest.skip("no nvcc on this machine")
    assert native.with_cuda, f"nvcc is at {nvcc} but _hybridep was built without CUDA"
    assert native.cuda_device_count() >= 0  # and it must not raise without a driver


# ---- Routings (R source ranks, T tokens, K slots, E experts) ----


def _routing(name: str, rng: np.random.Generator, R=4, T=24, K=3, E=8) -> np.ndarray:
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


ROUTINGS = (
    "random",
    "all_minus_one",
    "one_expert",
    "duplicates",
    "invalid",
    "empty_rank",
    "many_chunks",
)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _layout_args(idx: np.ndarray, E: int, mode: str):
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
        capacity = _round_up(_round_up(T * R * K, E) // E, pad)
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


def _numpy_layout(
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


def _assert_same(got: dict, want: dict, what: str):
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=f"{what}: {key}")
        assert got[key].dtype == want[key].dtype, f"{what}: {key} dtype"


LAYOUT_CASES = [(r, "dropless") for r in ROUTINGS] + [
    ("random", "capacity"),
    ("one_expert", "capacity"),
    ("duplicates", "capacity"),
    ("many_chunks", "capacity"),
    ("random", "permuted"),
    ("one_expert", "tight_rows"),
    ("random", "tight_rows"),
]


@pytest.mark.parametrize("routing,mode", LAYOUT_CASES)
def test_host_layout_matches_numpy(cuda_build, routing, mode):
    args = _layout_args(_routing(routing, np.random.default_rng(0)), 8, mode)
    _assert_same(native.cuda_selftest_layout(**args, reference=True), _numpy_layout(**args), "host")


@pytest.mark.gpu
@pytest.mark.parametrize("routing,mode", LAYOUT_CASES)
def test_cuda_layout_matches_host(gpu, routing, mode):
    args = _layout_args(_routing(routing, np.random.default_rng(0)), 8, mode)
    want = native.cuda_selftest_layout(**args, reference=True)
    _assert_same(native.cuda_selftest_layout(**args), want, "cuda vs host")
    _assert_same(native.cuda_selftest_layout(**args), want, "cuda rerun")  # deterministic


# ---- Exchange: receive buffers as the write-based protocol of exchange.h fills them ----


def _write_tokens(x: np.ndarray, dest: np.ndarray, row_pos: np.ndarray, weights: np.ndarray):
    """Every destination's receive buffer (§2.1.1: one copy per (token, destination), ascending t).

    x: [R, T, row_bytes] uint8; dest, row_pos, weights: [R, T, K]. Returns per destination
    tokens [R, R, T, row_bytes], token_ids [R, R, T], row_pos and weights [R, R, T, K].
    """
    R, T, K = dest.shape
    tokens = np.zeros((R,) + x.shape, np.uint8)
    ids = np.full((R, R, T), -1, np.int32)
    pos = np.full((R, R, T, K), -1, np.int32)
    w = np.zeros((R, R, T, K), np.float32)
    for src in range(R):
        next_slot = np.zeros(R, np.int64)
        for t in range(T):
            for d in sorted({int(d) for d in dest[src, t] if d >= 0}):
                j = next_slot[d]
                next_slot[d] += 1
                here = dest[src, t] == d
                tokens[d, src, j] = x[src, t]
                ids[d, src, j] = t
                pos[d, src, j] = np.where(here, row_pos[src, t], -1)
                w[d, src, j] = np.where(here, weights[src, t], 0)
    return tokens, ids, pos, w


class Exchange:
    """One routed exchange over R virtual ranks, with receive buffers and expert outputs."""

    def __init__(self, routing: str, dtype: str, hidden: int, seed: int = 0, E: int = 8):
        rng = np.random.default_rng(seed)
        idx = _routing(routing, rng, E=E)
        args = _layout_args(idx, E, "dropless")
        layout = _numpy_layout(**args)
        self.R, self.T, self.K = idx.shape
        self.C, self.dtype, self.hidden = args["rows"], dtype, hidden
        safe = np.clip(idx, 0, E - 1)
        self.dest = np.where(layout["row_pos"] >= 0, args["placement_rank"][safe], -1)
        self.dest = self.dest.astype(np.int32)
        self.topk_weights = rng.standard_normal(idx.shape).astype(np.float32)
        x = _values(rng, (self.R, self.T, hidden), dtype)
        self.x_bytes = x.view(np.uint8).reshape(self.R, self.T, -1)
        self.recv = _write_tokens(self.x_bytes, self.dest, layout["row_pos"], self.topk_weights)
        # Expert outputs of every destination, and its routing weights per row.
        self.y = _values(rng, (self.R, self.C, hidden), dtype)
        self.row_weights = rng.standard_normal((self.R, self.C)).astype(np.float32)

    def y_bytes(self, d: int) -> np.ndarray:
        return self.y[d].view(np.uint8).reshape(self.C, -1)


def _values(rng, shape, dtype: str) -> np.ndarray:
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


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def _numpy_write_partials(ex: Exchange, d: int, weighted: bool) -> np.ndarray:
    """Destination d's partials in every source's buffer, [R, R, T, H] (§2.1.4: ascending k)."""
    out = np.zeros((ex.R, ex.R, ex.T, ex.hidden), DTYPES[ex.dtype])
    _, ids, pos, _ = ex.recv
    for src in range(ex.R):
        for j in range(ex.T):
            t = ids[d, src, j]
            if t < 0:
                continue
            acc = np.zeros(ex.hidden, np.float32)
            for row in pos[d, src, j]:
                if row < 0:
                    continue
                v = ex.y[d, row].astype(np.float32)
                if weighted:
                    v = v * ex.row_weights[d, row]
                acc = acc + v
            with np.errstate(over="ignore"):  # float16 sums may round to inf, as in C++
                out[src, d, t] = acc.astype(DTYPES[ex.dtype])
    return out


def _numpy_reduce(ex: Exchange, partials: np.ndarray, src: int) -> np.ndarray:
    """Source src's output [T, H]: partials of its distinct destinations, ascending, in float32."""
    out = np.zeros((ex.T, ex.hidden), np.float32)
    for t in range(ex.T):
        for d in sorted({int(d) for d in ex.dest[src, t] if d >= 0}):
            out[t] = out[t] + partials[d, t].astype(np.float32)
    with np.errstate(over="ignore"):
        return out.astype(DTYPES[ex.dtype])


def _run_expand(ex: Exchange, d: int, reference: bool):
    tokens, ids, pos, w = ex.recv
    return native.cuda_selftest_expand_rows(
        tokens[d], ids[d], pos[d], w[d], ex.C, reference=reference
    )


def _run_write_partials(ex: Exchange, d: int, weighted: bool, reference: bool) -> np.ndarray:
    _, ids, pos, _ = ex.recv
    weights = ex.row_weights[d] if weighted else None
    raw = native.cuda_selftest_write_partials(
        ex.dtype, d, ex.y_bytes(d), weights, ids[d], pos[d], reference=reference
    )
    return raw.view(DTYPES[ex.dtype]).reshape(ex.R, ex.R, ex.T, ex.hidden)


def _run_reduce(ex: Exchange, partials: np.ndarray, src: int, reference: bool) -> np.ndarray:
    raw = native.cuda_selftest_reduce_partials(
        ex.dtype, _bits(partials).reshape(ex.R, ex.T, -1), ex.dest[src], reference=reference
    )
    return raw.view(DTYPES[ex.dtype]).reshape(ex.T, ex.hidden)


def _combine(ex: Exchange, weighted: bool, reference: bool) -> np.ndarray:
    """Full combine over all ranks with the hooks: [R, T, H] outputs per source."""
    partials = np.zeros((ex.R, ex.R, ex.T, ex.hidden), DTYPES[ex.dtype])  # [src, d, t, h]
    for d in range(ex.R):
        written = _run_write_partials(ex, d, weighted, reference)
        partials[:, d] = written[:, d]
    return np.stack([_run_reduce(ex, partials[s], s, reference) for s in range(ex.R)])


def _numpy_combine(ex: Exchange, weighted: bool) -> np.ndarray:
    partials = np.zeros((ex.R, ex.R, ex.T, ex.hidden), DTYPES[ex.dtype])
    for d in range(ex.R):
        partials[:, d] = _numpy_write_partials(ex, d, weighted)[:, d]
    return np.stack([_numpy_reduce(ex, partials[s], s) for s in range(ex.R)])


def _numpy_expand(ex: Exchange, d: int):
    tokens, ids, pos, w = ex.recv
    out = np.zeros((ex.C, tokens.shape[-1]), np.uint8)
    out_w = np.zeros(ex.C, np.float32)
    for src in range(ex.R):
        for j in range(ex.T):
            if ids[d, src, j] < 0:
                continue
            for kk in range(ex.K):
                row = pos[d, src, j, kk]
                if row >= 0:
                    out[row] = tokens[d, src, j]
                    out_w[row] = w[d, src, j, kk]
    return out, out_w


EXCHANGE_ROUTINGS = ("random", "all_minus_one", "one_expert", "duplicates", "invalid", "empty_rank")


def _assert_bits(got: np.ndarray, want: np.ndarray, what: str):
    assert got.shape == want.shape, what
    np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=what)


@pytest.mark.parametrize("routing", EXCHANGE_ROUTINGS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_host_exchange_matches_numpy(cuda_build, routing, dtype):
    ex = Exchange(routing, dtype, hidden=5)
    for weighted in (False, True):
        _assert_bits(
            _combine(ex, weighted, True),
            _numpy_combine(ex, weighted),
            f"combine weighted={weighted}",
        )
    for d in range(ex.R):
        tokens, weights = _run_expand(ex, d, reference=True)
        want_tokens, want_weights = _numpy_expand(ex, d)
        _assert_bits(tokens, want_tokens, f"expand tokens d={d}")
        _assert_bits(weights, want_weights, f"expand weights d={d}")


@pytest.mark.gpu
@pytest.mark.parametrize("routing", EXCHANGE_ROUTINGS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("weighted", [False, True])
def test_cuda_combine_matches_host(gpu, routing, dtype, weighted):
    ex = Exchange(routing, dtype, hidden=300)  # more columns than threads in a block
    want = _combine(ex, weighted, reference=True)
    _assert_bits(_combine(ex, weighted, reference=False), want, "combine")
    _assert_bits(want, _numpy_combine(ex, weighted), "host vs numpy")


@pytest.mark.gpu
@pytest.mark.parametrize("routing", EXCHANGE_ROUTINGS)
@pytest.mark.parametrize(
    "dtype,hidden",
    [
        ("float32", 3),
        ("float32", 2),
        ("bfloat16", 3),
        ("bfloat16", 24),
        ("float16", 1),
        ("float16", 300),
    ],
)  # row_bytes 12, 8, 6, 48, 2, 600: every copy width from 2 to 16 bytes
def test_cuda_expand_rows_matches_host(gpu, routing, dtype, hidden):
    ex = Exchange(routing, dtype, hidden=hidden)
    for d in range(ex.R):
        want = _run_expand(ex, d, reference=True)
        got = _run_expand(ex, d, reference=False)
        _assert_bits(got[0], want[0], f"tokens d={d}")
        _assert_bits(got[1], want[1], f"weights d={d}")


@pytest.mark.gpu
def test_cuda_expand_rows_odd_row_bytes(gpu):
    # 3-byte rows: the byte-wide copy path.
    rng = np.random.default_rng(3)
    R, T, K, C = 2, 6, 2, 30
    tokens = rng.integers(0, 256, size=(R, T, 3), dtype=np.uint8)
    ids = np.array([[0, 2, 5, -1, -1, -1], [1, 3, -1, -1, -1, -1]], np.int32)
    rows = rng.permutation(C)[: R * T * K].reshape(R, T, K).astype(np.int32)
    rows[:, :, 1][rng.random((R, T)) < 0.5] = -1
    w = rng.standard_normal((R, T, K)).astype(np.float32)
    want = native.cuda_selftest_expand_rows(tokens, ids, rows, w, C, reference=True)
    got = native.cuda_selftest_expand_rows(tokens, ids, rows, w, C)
    _assert_bits(got[0], want[0], "tokens")
    _assert_bits(got[1], want[1], "weights")


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ("random", "duplicates", "one_expert"))
def test_cuda_write_row_values_matches_host(gpu, routing):
    ex = Exchange(routing, "float32", hidden=1)
    _, ids, pos, _ = ex.recv
    for d in range(ex.R):
        want = native.cuda_selftest_write_row_values(
            ex.row_weights[d], ids[d], pos[d], reference=True
        )
        got = native.cuda_selftest_write_row_values(ex.row_weights[d], ids[d], pos[d])
        _assert_bits(got, want, f"d={d}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_cuda_reduce_partials_many_tokens(gpu, dtype):
    # More tokens than the grid has blocks, so blocks loop; K = 6 with repeated destinations.
    rng = np.random.default_rng(5)
    R, T, K, H = 4, 5000, 6, 4
    dest = rng.integers(-1, R, size=(T, K)).astype(np.int32)
    partials = _values(rng, (R, T, H), dtype)
    raw = _bits(partials).reshape(R, T, -1)
    want = native.cuda_selftest_reduce_partials(dtype, raw, dest, reference=True)
    _assert_bits(native.cuda_selftest_reduce_partials(dtype, raw, dest), want, "reduce")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_cuda_combine_nonfinite(gpu, dtype):
    # inf and NaN inputs: same bits everywhere except NaN payloads. A NaN made or propagated by
    # float arithmetic has the platform's own payload (x86: 0xffc00000 for inf - inf; NVIDIA GPUs:
    # canonical 0x7fffffff), so those are compared as "both NaN".
    ex = Exchange("random", dtype, hidden=8)
    ex.y[:, ::3, 0] = np.inf
    ex.y[:, 1::3, 1] = -np.inf
    ex.y[:, ::2, 1] = np.nan
    ex.y[:, 1::4, 2] = DTYPES[dtype](-np.inf)
    ex.y[:, ::4, 2] = DTYPES[dtype](np.inf)
    want = _combine(ex, True, reference=True).astype(np.float32)
    got = _combine(ex, True, reference=False).astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    _assert_bits(got[~nan], want[~nan], "non-NaN values")

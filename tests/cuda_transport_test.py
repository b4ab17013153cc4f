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
from transport_helpers import DTYPES, Round, got_bits
from transport_helpers import bits as _bits

from jax_hybridep import _native

native = _native.testing_module()


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

"""The transport's kernels on one GPU, bit for bit (docs/design.md §2.1; kernels/transport.h).

`cuda_selftest_transport` runs R virtual ranks on one GPU, each with its own window, through the
kernels of the FFI handlers: the slot map, the send, the wide permute, the unpermute, the send
back and the reduce, with nothing but the flags between ranks. Rounds reuse the windows (both
halves, the exchange counters). Every output is compared with the §2.1 model
(tests/transport_helpers.py, itself held to the host kernels by tests/transport_model_test.py)
and the slot map with the reference; FP8 dispatch with the jnp quantisation over every
bfloat16 pattern; a rank tagging its flags with another call site must make its peers report a
mismatch, a silent rank a timeout. The same harness runs on the CPU under the host executor
(tests/host_executor_transport_test.py). Tests marked `gpu` skip without a GPU and fail instead
when JAX_HYBRIDEP_REQUIRE_GPU=1; the last test runs anywhere the module was built with CUDA.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from transport_helpers import (
    DTYPES,
    EXCHANGE_ROUTINGS,
    Round,
    check_round,
    gathered,
    on_every_round,
    run_harness,
    stacked_inputs,
)
from transport_helpers import bits as _bits

from jax_hybridep import fp8
from lab import native_module

native = native_module.testing_module()


def _run(rounds: list[Round], weighted: bool, send_blocks: int, **kw) -> dict:
    return run_harness(native, rounds, weighted, send_blocks=send_blocks, **kw)


@on_every_round
def test_transport_matches_the_model(gpu, ranks, routing, dtype, hidden):
    case = Round(routing, dtype, hidden, R=ranks, T=70)  # T = 70: two chunks, the second partial
    for weighted in (False, True):
        got = _run([case], weighted, send_blocks=3)
        check_round(native, got, 0, case, weighted, f"weighted={weighted}")


@pytest.mark.gpu
@pytest.mark.parametrize("send_blocks", [1, 2, 5])
@pytest.mark.parametrize("hidden", [5, 256])
def test_transport_reuses_windows(gpu, send_blocks, hidden):
    """Five rounds, each with new routing and values, on one set of windows: both halves and the
    exchange counters advance, no round sees another's data."""
    routings = ("random", "duplicates", "one_expert", "random", "empty_rank")
    rounds = [Round(r, "float16", hidden, R=4, seed=n) for n, r in enumerate(routings)]
    got = _run(rounds, True, send_blocks)
    for n, case in enumerate(rounds):
        check_round(native, got, n, case, True, f"round {n} ({routings[n]})")


@pytest.mark.gpu
def test_fp8_dispatch_of_every_bf16_pattern(gpu):
    """The send quantises each token into its wire row (fp8.h), the permute dequantises it: the
    jnp quantisation's bits (docs/design.md §2.1.8) for every bfloat16 pattern, H = 128 in
    pattern order and H = 200 shuffled (short last blocks)."""
    patterns = np.arange(1 << 16, dtype=np.uint16).view(ml_dtypes.bfloat16)
    for hidden, values in ((128, patterns), (200, np.random.default_rng(7).permutation(patterns))):
        ranks, T = 4, -(-patterns.size // (4 * hidden))
        case = Round("random", "bfloat16", hidden, R=ranks, T=T, K=2)
        case.x = np.resize(values, (ranks, T, hidden))
        got = _run([case], True, send_blocks=4, fp8_hidden=hidden)
        flat = case.x.reshape(-1, hidden)
        case.x = np.asarray(fp8.dequantize(*fp8.quantize(flat), case.np_dtype)).reshape(
            case.x.shape
        )
        want = _bits(case.expected(True)["tokens"])
        got_bits = _bits(got["tokens"][0]).reshape(want.shape)
        nan = np.isnan(got["tokens"][0].view(ml_dtypes.bfloat16).astype(np.float32)).reshape(
            want.shape
        )
        np.testing.assert_array_equal(got_bits[~nan], want[~nan])
        assert np.array_equal(nan, np.isnan(case.expected(True)["tokens"].astype(np.float32)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_nonfinite_combine(gpu, dtype):
    """inf and NaN in the expert outputs: the host kernels' bits everywhere but NaN payloads. A
    NaN made or propagated by float arithmetic has the platform's own payload (x86: 0xffc00000
    for inf - inf; NVIDIA GPUs: canonical 0x7fffffff), so those compare as "both NaN"."""
    case = Round("random", dtype, 8, R=4)
    case.y[:, ::3, 0] = np.inf
    case.y[:, 1::3, 1] = -np.inf
    case.y[:, ::2, 1] = np.nan
    case.y[:, 1::4, 2] = DTYPES[dtype](-np.inf)
    case.y[:, ::4, 2] = DTYPES[dtype](np.inf)
    want = native.transport_reference(dtype, case.C, **stacked_inputs([case], True))["combined"][0]
    got = _run([case], True, send_blocks=2)["combined"][0]
    want_rows = want.view(case.np_dtype).astype(np.float32)
    got_rows = got.view(case.np_dtype).astype(np.float32).reshape(want_rows.shape)
    nan = np.isnan(want_rows)
    assert nan.any() and np.isinf(want_rows).any()
    np.testing.assert_array_equal(np.isnan(got_rows), nan)
    np.testing.assert_array_equal(_bits(got_rows[~nan]), _bits(want_rows[~nan]))


@pytest.mark.gpu
def test_flags_of_another_call_site_are_a_mismatch(gpu):
    case = Round("random", "float32", 16, R=4)
    with pytest.raises(ValueError, match="mismatch"):
        _run([case], False, send_blocks=2, mismatch_rank=2, timeout_ms=2000)


@pytest.mark.gpu
def test_silent_rank_times_out(gpu):
    case = Round("random", "float32", 16, R=2)
    with pytest.raises(ValueError, match="timed out"):
        _run([case], False, send_blocks=2, silent_rank=1, timeout_ms=200)


@pytest.mark.gpu
@pytest.mark.parametrize("routing", EXCHANGE_ROUTINGS)
def test_slot_map_kernels_match_the_reference(gpu, routing):
    case = Round(routing, "float32", 4, R=8, T=200, seed=3)
    for r in range(case.R):
        got = native.cuda_slot_map(gathered(case), r, case.C, reference=False)
        want = native.cuda_slot_map(gathered(case), r, case.C, reference=True)
        for key, value in want.items():
            np.testing.assert_array_equal(_bits(got[key]), _bits(value), err_msg=f"{key} {r}")


def test_harness_rejects_bad_inputs(cuda_build):
    case = Round("random", "float32", 4, R=2)
    args = stacked_inputs([case], weighted=False)
    del args["values"]
    with pytest.raises(ValueError, match=r"y: expected shape \(1, 2,"):
        native.cuda_selftest_transport(
            "float32", case.C, **{**args, "y": args["y"][:, :, :3]}, send_blocks=1
        )
    bad = args["dest"].copy()
    bad[0, 0, 0, 0] = 5
    with pytest.raises(ValueError, match="dest has 5, outside"):
        native.cuda_selftest_transport("float32", case.C, **{**args, "dest": bad}, send_blocks=1)
    with pytest.raises(ValueError, match="send_blocks"):
        native.cuda_selftest_transport("float32", case.C, **args, send_blocks=0)

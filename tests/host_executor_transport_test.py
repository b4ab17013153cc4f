"""The GPU transport's own kernels (xla_ffi/cuda/kernels/) on the host executor, bit for bit against
the §2.1 model (docs/design.md §2.1, tests/transport_helpers.py), with the executor's race,
deadlock and misuse detectors watching every access (docs/host_executor.md).

The harness is the GPU's (lab/native/cuda/harness.cc): slot map, dispatch, combine and
redispatch per round, here with rank r on virtual GPU r, its own stream, and the host waiting
only at the end, so every rank's exchanges overlap its peers'. Each configuration runs under a
fixed seed and one that changes daily (tests/host_executor_helpers.py `seeds`); the many-seed
sweep is marked `sweep` (docs/testing.md).
"""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest
from host_executor_helpers import executor, run_transport, seeds
from transport_helpers import CONTRACT_ROUTINGS, Round, bits, check_round, gathered

from jax_hybridep import _native, fp8

pytestmark = pytest.mark.host_executor

# The two kinds of rows the send kernel stages: float32 x 36 = 144 bytes, whole aligned 16-byte
# words that the G2S warp bulk-loads; bfloat16 x 30 = 60 bytes, which its lanes load (stores
# stay bulk, the slot's padding absorbing the rounding up).
ROWS = {"bulk": ("float32", 36), "lanes": ("bfloat16", 30)}
T = 70  # tokens per rank: two chunks of 64 items, the second partial


def _cases():
    """Every routing class of the contract suite, dropless and with a capacity, spread over 2, 3
    and 4 GPUs, both kinds of rows, 1-3 send blocks, combine weighted or not; each under a fixed
    seed and the day's. Two 8-GPU cases, under the day's seed only (they take longest)."""
    cases = []
    for i, routing in enumerate(CONTRACT_ROUTINGS):
        for j, mode in enumerate(("dropless", "capacity")):
            config = (2 + i % 3, routing, mode, ("bulk", "lanes")[(i + j) % 2], 1 + (i + j) % 3)
            cases += [(*config, seed) for seed in seeds(2)]
    cases += [
        (8, "random", "dropless", "bulk", 2, seeds(1)[0]),
        (8, "hot", "capacity", "lanes", 3, seeds(1)[0]),
    ]
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def hx():
    return executor()


def _run_and_check(hx, ranks, routing, mode, rows, send_blocks, seed):
    dtype, hidden = ROWS[rows]
    case = Round(routing, dtype, hidden, R=ranks, T=T, mode=mode, seed=seed % 7)
    weighted = (seed + send_blocks) % 2 == 1
    got = run_transport(hx, [case], weighted, send_blocks=send_blocks, seed=seed)
    check_round(hx, got, 0, case, weighted, f"seed {seed} weighted={weighted}")


@pytest.mark.parametrize(
    "ranks, routing, mode, rows, send_blocks, seed",
    CASES,
    ids=[f"R{c[0]}-{c[1]}-{c[2]}-{c[3]}-seed{c[5]}" for c in CASES],
)
def test_matches_the_model(hx, ranks, routing, mode, rows, send_blocks, seed):
    _run_and_check(hx, ranks, routing, mode, rows, send_blocks, seed)


@pytest.mark.parametrize("hidden", [5, 256])
def test_reuses_windows(hx, hidden):
    """Five rounds (fifteen exchanges) on one set of windows, each with new routing and values:
    both halves and the exchange counters advance, no round sees another's data, and no rank's
    next exchange races its peers' last one."""
    routings = ("random", "duplicates", "one_expert", "hot", "empty_rank")
    rounds = [Round(r, "float16", hidden, R=3, seed=n) for n, r in enumerate(routings)]
    got = run_transport(hx, rounds, True, send_blocks=2, seed=seeds(1)[0])
    for n, case in enumerate(rounds):
        check_round(hx, got, n, case, True, f"round {n} ({routings[n]})")


def test_rows_in_pieces(hx):
    """Rows too large for four whole stages in the block's shared memory travel in pieces: a GPU
    with 8 KiB of opt-in shared memory and 2000-byte rows."""
    case = Round("random", "float32", 500, R=2, T=T)
    got = run_transport(hx, [case], True, send_blocks=2, seed=seeds(1)[0], optin_smem=8192)
    check_round(hx, got, 0, case, True, "pieces")
    plan = _native.module().send_plan(2000, 2, 0, 8192)
    assert plan["pieces"] > 1, plan


def test_fp8_dispatch_of_every_bf16_pattern(hx):
    """The send quantises each token into its wire row, the permute dequantises it: the jnp
    quantisation's bits (docs/design.md §2.1.8) for every bfloat16 pattern, H = 128 in pattern
    order and H = 200 shuffled (a short last block)."""
    patterns = np.arange(1 << 16, dtype=np.uint16).view(ml_dtypes.bfloat16)
    for hidden, values in ((128, patterns), (200, np.random.default_rng(7).permutation(patterns))):
        ranks, tokens = 4, -(-patterns.size // (4 * hidden))
        case = Round("random", "bfloat16", hidden, R=ranks, T=tokens, K=2)
        case.x = np.resize(values, (ranks, tokens, hidden))
        got = run_transport(hx, [case], True, send_blocks=2, fp8_hidden=hidden, seed=1)
        flat = case.x.reshape(-1, hidden)
        case.x = np.asarray(fp8.dequantize(*fp8.quantize(flat), case.np_dtype)).reshape(
            case.x.shape
        )
        want = case.expected(True)["tokens"]
        got_rows = got["tokens"][0].view(ml_dtypes.bfloat16).reshape(want.shape)
        nan = np.isnan(want.astype(np.float32))
        np.testing.assert_array_equal(np.isnan(got_rows.astype(np.float32)), nan)
        np.testing.assert_array_equal(bits(got_rows[~nan]), bits(want[~nan]))


def test_flags_of_another_call_site_are_a_mismatch(hx):
    case = Round("random", "float32", 16, R=4)
    with pytest.raises(ValueError, match="found a flag of another exchange \\(mismatch\\)"):
        run_transport(hx, [case], False, send_blocks=2, mismatch_rank=2, timeout_ms=2000, seed=1)


def test_silent_rank_times_out(hx):
    """A rank that sends nothing: its peers' waits give up after timeout_ms of %globaltimer (the
    executor's virtual clock) and say so."""
    case = Round("random", "float32", 16, R=2)
    with pytest.raises(ValueError, match="waiting for rank 1 block \\d timed out"):
        run_transport(hx, [case], False, send_blocks=2, silent_rank=1, timeout_ms=200, seed=1)


@pytest.mark.parametrize("routing", ["random", "many_chunks", "one_expert", "all_minus_one"])
def test_slot_map_kernels_match_the_reference(hx, routing):
    """The three slot-map kernels alone (count, scan, assign) against the reference, every
    rank of an 8-GPU level with 200 items (four chunks) each, or of 2 GPUs with 1501."""
    hx.configure(seed=seeds(1)[0], gpus=1)
    ranks, items = (2, 1501) if routing == "many_chunks" else (8, 200)
    case = Round(routing, "float32", 4, R=ranks, T=items, seed=3)
    for r in range(case.R):
        got = hx.cuda_slot_map(gathered(case), r, case.C, reference=False)
        want = hx.cuda_slot_map(gathered(case), r, case.C, reference=True)
        for key, value in want.items():
            np.testing.assert_array_equal(bits(got[key]), bits(value), err_msg=f"{key} {r}")


# The sweep: 50 seeds for each level size, the routing, mode, kind of rows and send blocks
# changing with the seed (docs/testing.md says when it runs).
SWEEP = [(ranks, seed) for ranks in (2, 3, 4, 8) for seed in range(50)]


@pytest.mark.sweep
@pytest.mark.parametrize("ranks, seed", SWEEP, ids=[f"R{r}-seed{s}" for r, s in SWEEP])
def test_seed_sweep(hx, ranks, seed):
    configs = list(itertools.product(CONTRACT_ROUTINGS, ("dropless", "capacity"), ROWS))
    routing, mode, rows = configs[(seed * 7 + ranks) % len(configs)]
    _run_and_check(hx, ranks, routing, mode, rows, 1 + seed % 3, 100 + seed)

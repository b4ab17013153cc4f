"""The host executor's model of each primitive the transport's kernels use, against the PTX ISA's
and the CUDA programming guide's semantics, and its reports of misused primitives
(docs/host_executor.md). Probe kernels: lab/host_executor/probes.cu. The module is built from the
working tree on demand (tests/host_executor_helpers.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from host_executor_helpers import executor, run_transport, seeds
from transport_helpers import Round

pytestmark = pytest.mark.host_executor


@pytest.fixture(scope="module")
def hx():
    return executor()


def probe(hx, name, arg=0, **options):
    hx.configure(**{"gpus": 2, **options})
    return np.asarray(hx.run_probe(name, arg), np.int64)


@pytest.mark.parametrize("seed", seeds(3))
def test_warp_shuffles_and_ballots(hx, seed):
    out = probe(hx, "warp_collectives", seed=seed).reshape(64, 8)
    t = np.arange(64)
    lane, warp = t % 32, t // 32
    value = lambda lanes: 100 * warp + lanes  # noqa: E731  the source lane's value, same warp
    np.testing.assert_array_equal(out[:, 0], value((lane + 3) % 32))  # __shfl_sync
    np.testing.assert_array_equal(out[:, 1], value(lane ^ 5))  # __shfl_xor_sync
    np.testing.assert_array_equal(out[:, 2], value(np.where(lane >= 2, lane - 2, lane)))
    np.testing.assert_array_equal(out[:, 3], value(np.where(lane + 3 < 32, lane + 3, lane)))
    np.testing.assert_array_equal(out[:, 4], value((lane & ~7) + 1))  # width 8: lane 1 of 8
    ballot = sum(1 << b for b in range(0, 32, 3))
    np.testing.assert_array_equal(out[:, 5], np.int32(np.uint32(ballot).view(np.int32)))
    half = np.where(lane < 16, sum(1 << b for b in range(1, 16, 2)), -1)
    np.testing.assert_array_equal(out[:, 6], half)  # a half-warp mask
    np.testing.assert_array_equal(out[:, 7], 16)  # __syncthreads_count over the block


@pytest.mark.parametrize("seed", seeds(2))
def test_match_any(hx, seed):
    """__match_any_sync (the layout kernels' per-tile grouping): each lane gets the lanes of its
    mask holding its value."""
    out = probe(hx, "match_any", seed=seed).reshape(64, 2)
    lane = np.arange(64) % 32
    same = lambda key, lanes: np.array(  # noqa: E731
        [sum(1 << o for o in lanes if key(o) == key(lane)) for lane in range(32)]
    )
    whole = same(lambda o: o % 5, range(32)).astype(np.uint32).view(np.int32)
    np.testing.assert_array_equal(out[:, 0], whole[lane])
    half = np.where(lane < 16, same(lambda o: o // 4, range(16))[lane % 16], -1)
    np.testing.assert_array_equal(out[:, 1], half)


def test_block_reductions(hx):
    out = probe(hx, "block_reductions", seed=1).reshape(96, 4)
    np.testing.assert_array_equal(out, np.tile([1, 0, 1, 0], (96, 1)))


@pytest.mark.parametrize("seed", seeds(3))
def test_atomics(hx, seed):
    out = probe(hx, "atomics", seed=seed)
    olds, (added, maximum, cas, exchanged, wide) = out[:128], out[128:]
    assert sorted(olds) == list(range(128))  # every atomicAdd saw a distinct old value
    assert (added, maximum, cas, wide) == (128, 127, 128, 128 << 33)
    assert 1000 <= exchanged < 1128


@pytest.mark.parametrize("seed", seeds(3))
def test_mbarrier_phases_and_parity(hx, seed):
    """Two phases of a 64-arrival mbarrier complete for every thread; waiting for parity 1
    before the first phase returns at once (the phase before the first counts as complete)."""
    out = probe(hx, "mbarrier_phases", seed=seed)
    np.testing.assert_array_equal(out, [2] * 64 + [1] * 64)


@pytest.mark.parametrize("words", [4, 64, 1000])
@pytest.mark.parametrize("copy_probability", [0.0, 0.25, 1.0])
def test_bulk_copies_round_trip(hx, words, copy_probability):
    """cp.async.bulk global -> shared completing on an mbarrier, then shared -> global waited by
    cp.async.bulk.wait_group, whenever the copy engine performs them."""
    out = probe(hx, "bulk_round_trip", words, seed=2, copy_probability=copy_probability)
    np.testing.assert_array_equal(out, 2 * (3 * np.arange(words) - 40))


def test_a_bulk_store_of_unfenced_writes_is_a_race(hx):
    """Lanes' ordinary stores into shared memory reach a bulk store issued after them only
    through fence.proxy.async: without it, the copy's read races with the stores."""
    with pytest.raises(
        RuntimeError,
        match=r"data race on dynamic shared memory \+\d+: the "
        r"cp\.async\.bulk shared->global .* reads it.*"
        r"BulkRoundTrip.* writes it at .*probes\.cu:\d+",
    ):
        probe(hx, "bulk_store_without_proxy_fence", 64, seed=2)


def test_globaltimer_counts_nanosleep(hx):
    assert probe(hx, "timer", 1000)[0] >= 1000
    assert probe(hx, "timer", 50000)[0] >= 50000


def test_a_poll_times_out_through_the_virtual_clock(hx):
    """A wait that nobody answers reaches its timeout in virtual time, fast: with nothing else to
    run the executor lets time pass ever faster (docs/host_executor.md, "Time")."""
    gave_up, waited = probe(hx, "poll_timeout", 10_000_000_000)  # 10 s of %globaltimer
    assert gave_up == 1 and waited > 10_000_000_000
    assert hx.stats()["steps"] < 100_000


@pytest.mark.parametrize("seed", seeds(3))
def test_release_acquire_flag_passes_the_payload(hx, seed):
    out = probe(hx, "flag_release", seed=seed)
    np.testing.assert_array_equal(out, 7 * np.arange(32) + 1)


def test_relaxed_flag_is_a_race(hx):
    """The same message passing with volatile (relaxed) stores and loads orders nothing: the
    payload's read races with its write, on another GPU."""
    with pytest.raises(RuntimeError, match=r"data race on global memory .*Flag.*probes\.cu:\d+"):
        probe(hx, "flag_relaxed", seed=1)


@pytest.mark.parametrize("how, initialised", [(1, "a cudaMemset"), (2, "a kernel's stores")])
def test_written_memory_reads_clean(hx, how, initialised):
    """cudaMalloc'd memory becomes readable once something writes it (here: {initialised})."""
    np.testing.assert_array_equal(probe(hx, "uninitialised_read", how, seed=1), np.zeros(8))


@pytest.mark.parametrize(
    "how, report",
    [
        (0, r"4 of which \(the first at global memory \(32 bytes\) \+\d+ \(GPU 0\)\)"),
        (3, r"4 of which \(the first at global memory \(32 bytes\) \+\d+ \(GPU 0\)\)"),
        (4, r"4 of which \(the first at global memory \(32 bytes\) \+28 \(GPU 0\)\)"),
    ],
    ids=["never-written", "copied-from-never-written", "one-word-left-out"],
)
def test_reading_memory_nothing_wrote_is_reported(hx, how, report):
    """compute-sanitizer's initcheck: a kernel's read of bytes nothing wrote since their
    cudaMalloc (a device-to-device copy carries its source's state along)."""
    with pytest.raises(
        RuntimeError,
        match=r"uninitialised global memory read \(initcheck\): GPU 0 CopyWords block \(0,0,0\) "
        r"thread \d \(warp 0 lane \d\) reads 4 bytes at .*probes_memory\.cu:\d+.*, "
        + report
        + " nothing wrote since their cudaMalloc",
    ):
        probe(hx, "uninitialised_read", how, seed=1)


def test_peer_access_once_enabled(hx):
    np.testing.assert_array_equal(probe(hx, "peer_access", 1, seed=1), np.full(8, 0x01010101))


def test_peer_access_never_enabled_is_reported(hx):
    """A GPU reaches a peer's memory only after cudaDeviceEnablePeerAccess (a GPU faults)."""
    with pytest.raises(
        RuntimeError,
        match=r"peer access not enabled: GPU 1 CopyWords block \(0,0,0\) thread \d .* reads 4 "
        r"bytes at global memory \(32 bytes\) \+\d+ \(GPU 0\) at .*probes_memory\.cu:\d+.*: "
        r"memory of GPU 0, which GPU 1 never enabled with cudaDeviceEnablePeerAccess\(0\)",
    ):
        probe(hx, "peer_access", 0, seed=1)


# Misused primitives: each is reported, naming the kernel, the thread and the source line.
MISUSE = [
    (
        "divergent_barrier",
        r"divergent __syncthreads: GPU 0 DivergentBarrier block \(0,0,0\) "
        r"thread \d+ \(warp 0 lane \d+\) reaches the barrier at "
        r".*probes\.cu:\d+",
    ),
    (
        "shuffle_leaves_out_own_lane",
        r"shuffle mask: .*lane 5\) calls __shfl_sync at "
        r".*probes\.cu:\d+.* with mask 0xffffffdf, which leaves out",
    ),
    (
        "shuffle_reads_outside_mask",
        r"shuffle mask: .* reads lane 1\d in __shfl_sync .*outside "
        r"its mask 0x0000ffff",
    ),
    # Which comes first, the exit or the ballot, is the schedule's: both are this report.
    (
        "ballot_with_exited_lanes",
        r"(shuffle mask: .*__ballot_sync .* names lanes 0xffff0000 "
        r"that have exited|warp collective with an exited lane: "
        r".*BallotWithExitedLanes.* exited while other lanes of its "
        r"mask wait at .*probes\.cu:\d+)",
    ),
    ("tx_underflow", r"mbarrier tx-count underflow: __shared__ bar \+0 received 16 bytes more"),
    ("tx_overflow", r"mbarrier tx-count overflow: .*BulkBytes"),
    ("bulk_size", r"bulk copy misuse: .* 24 bytes, not a positive multiple of 16"),
    ("bulk_alignment", r"bulk copy misuse: .*its shared-memory address is not 16-byte aligned"),
    ("bulk_shared_overrun", r"bulk copy misuse: .*shared memory out of bounds"),
    (
        "arrive_uninitialised",
        r"mbarrier misuse: .* on __shared__ bar \+0, which no "
        r"mbarrier.init initialised",
    ),
    (
        "shared_overrun",
        r"shared memory out of bounds: GPU 0 SharedOverrun block \(0,0,0\) thread "
        r"32 \(warp 1 lane 0\) writes 4 bytes at offset 128 of __shared__ a "
        r"\(128 bytes\) at .*probes\.cu:\d+",
    ),
    (
        "plain_race",
        r"data race on global memory .*PlainRace block \(\d,0,0\) .*writes it at "
        r".*probes\.cu:\d+ \(PlainRace\); .*PlainRace block \(\d,0,0\)",
    ),
    (
        "mbarrier_deadlock",
        r"deadlock: no thread can run.*\n.*MbarrierDeadlock block \(0,0,0\) warp "
        r"0 lanes 0-1: mbarrier.try_wait.parity 0 on __shared__ bar \+0 .*"
        r"\[phase 0 \(parity 0\): 1 of 2 arrivals pending",
    ),
]


@pytest.mark.parametrize("name, report", MISUSE, ids=[m[0] for m in MISUSE])
def test_misuse_is_reported(hx, name, report):
    with pytest.raises(RuntimeError, match=report):
        probe(hx, name, seed=3)


@pytest.mark.parametrize("landed", [False, True])
def test_reading_a_bulk_copy_destination_before_its_barrier(hx, landed):
    """Before the copy landed the read is of poisoned bytes still in flight; after (the reader
    paused), it is a race with the copy, which no mbarrier wait orders. Either way, a report."""
    report = (
        r"data race on dynamic shared memory \+12: .*ReadBeforeWait.* reads it at "
        r".*probes\.cu:\d+ \(ReadBeforeWait\); the cp.async.bulk global->shared of 64 bytes"
        if landed
        else r"read of a bulk copy's destination before the copy completed "
        r"\(before its mbarrier phase completed\): .*ReadBeforeWait"
    )
    with pytest.raises(RuntimeError, match=report):
        probe(hx, "read_before_wait", int(landed), seed=1)


def test_a_run_past_its_step_limit_is_a_hang_report(hx):
    with pytest.raises(
        RuntimeError,
        match=r"(?s)hang: the kernels still run after 2000 "
        r"scheduler steps.*PollTimeout.*__nanosleep",
    ):
        probe(hx, "poll_timeout", 10**18, max_steps=2000)


def test_an_unknown_probe_is_refused(hx):
    with pytest.raises(ValueError, match="no probe named nope"):
        probe(hx, "nope")


def test_same_seed_same_run_another_seed_another(hx):
    """A run is a function of its seed: the same seed twice gives the same schedule (steps,
    switches, virtual time) and outputs; another seed another schedule, the same outputs."""
    case = Round("random", "bfloat16", 30, R=2, T=70)
    runs = []
    for seed in (5, 5, 6):
        out = run_transport(hx, [case], weighted=True, seed=seed)
        runs.append((hx.stats(), {k: np.asarray(v).tobytes() for k, v in out.items()}))
    assert runs[0] == runs[1]
    assert runs[2][0] != runs[0][0] and runs[2][1] == runs[0][1]

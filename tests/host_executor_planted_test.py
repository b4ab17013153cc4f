"""Proof that the host executor fails kernels that are wrong: bugs planted in copies of the
transport's kernel sources, each compiled into a module of its own for this test only
(tests/host_executor_helpers.py `planted`), each caught with the report its class calls for
(docs/host_executor.md). The same configuration runs clean on the working tree's kernels.
"""

from __future__ import annotations

import dataclasses

import pytest
from host_executor_helpers import ROOT, executor, planted, run_transport
from transport_helpers import Round, check_round

pytestmark = pytest.mark.host_executor


@dataclasses.dataclass(frozen=True)
class Bug:
    kernel: str  # the file under xla_ffi/cuda/kernels/ the patch applies to
    old: str  # text found exactly once there
    new: str
    report: str  # what the executor must say (a regex)
    rows: tuple = ("float32", 36)  # the round's dtype and hidden size
    mode: str = "dropless"
    # run_transport's executor and harness settings
    kw: dict = dataclasses.field(default_factory=dict)


BUGS = {
    # The S2G warp stores a stage before the G2S warp's bulk load into it landed.
    "missing_wait_before_reading_a_stage": Bug(
        "send.cu",
        "          BarrierWait(&full[s], (unit / stages) & 1);\n",
        "",
        r"(read of a bulk copy's destination before the copy completed \(before its mbarrier "
        r"phase completed\)|data race on dynamic shared memory).*SendKernel",
    ),
    # The G2S warp refills a stage the S2G warp's bulk store may still be reading (rows its lanes
    # load: plain stores into the stage).
    "stage_reused_without_its_barrier": Bug(
        "send.cu",
        "          BarrierWait(&empty[s], ((unit / stages) & 1) ^ 1);\n",
        "",
        r"data race on dynamic shared memory \+\d+: .*SendKernel.* writes it at "
        r".*send\.cu:\d+.*; the cp\.async\.bulk shared->global .* reads it",
        rows=("bfloat16", 30),
    ),
    # The flag goes up once the bulk stores have read the stages, before their writes into the
    # peers' windows are complete and fenced.
    "flag_before_the_payload_fence": Bug(
        "send.cu",
        "      BulkWaitAll();\n",
        "      BulkWaitRead<0>();\n",
        r"(data race on global memory|read of a bulk copy's destination before the copy "
        r"completed).*PermuteKernel.*cp\.async\.bulk shared->global",
    ),
    # A ring of three stages for three S2G warps: each S2G warp hands a stage back only when it
    # commits its next row, so the loader waits for a stage no warp will release.
    "three_stage_send_plan": Bug(
        "send_plan.cc",
        "  plan.smem_bytes = fixed + plan.stages * plan.stage_bytes;",
        "  plan.stages = std::min<int64_t>(plan.stages, 3);\n"
        "  plan.smem_bytes = fixed + plan.stages * plan.stage_bytes;",
        r"(?s)deadlock: no thread can run.*SendKernel.*warp 0 .*mbarrier\.try_wait\.parity",
    ),
    # Each received (slot, k) mapped one row too far: a copy lands on a row the permute also
    # zeroes as padding, or (the last row) past the output.
    "row_map_off_by_one": Bug(
        "slot_map.cu",
        "      recv_rows[j * K + k] = row;",
        "      recv_rows[j * K + k] = row + 1;",
        r"(global memory out of bounds: .*PermuteKernel.* writes \d+ bytes at offset \d+ of "
        r"global memory|data race on global memory .*PermuteKernel.* writes it at "
        r".*receive\.cu:\d+.*; .*writes it at .*ZeroPadding)",
        mode="tight_rows",
    ),
    # The launch asks for 16 bytes of shared memory fewer than the ring needs.
    "shared_memory_overrun": Bug(
        "send_plan.cc",
        "  plan.smem_bytes = fixed + plan.stages * plan.stage_bytes;",
        "  plan.smem_bytes = fixed + plan.stages * plan.stage_bytes - 16;",
        r"SendKernel.*shared memory out of bounds",
    ),
    # A shuffle whose mask leaves out lane 31, which calls it too.
    "lane_outside_the_shuffle_mask": Bug(
        "receive.cu",
        "      f(__shfl_sync(kAllLanes, e.value[h], __ffs(m) - 1));",
        "      f(__shfl_sync(0x7fffffffu, e.value[h], __ffs(m) - 1));",
        r"shuffle mask: .*lane 31\) calls __shfl_sync at .*receive\.cu:\d+.* with mask "
        r"0x7fffffff, which leaves out its own lane",
    ),
}


def _patched(bug: Bug) -> str:
    source = (ROOT / "xla_ffi" / "cuda" / "kernels" / bug.kernel).read_text()
    assert source.count(bug.old) == 1, f"the planted patch no longer applies to {bug.kernel}"
    return source.replace(bug.old, bug.new)


@pytest.fixture(scope="module")
def modules():
    return planted({name: (bug.kernel, _patched(bug)) for name, bug in BUGS.items()})


def _round(bug: Bug) -> Round:
    dtype, hidden = bug.rows
    return Round("random", dtype, hidden, R=2, T=70, mode=bug.mode)


@pytest.mark.parametrize("name", BUGS)
def test_planted_bug_is_reported(modules, name):
    bug = BUGS[name]
    with pytest.raises(RuntimeError, match=bug.report):
        run_transport(modules[name], [_round(bug)], True, seed=2, **bug.kw)


@pytest.mark.parametrize("name", BUGS)
def test_the_working_tree_passes_the_same_round(name):
    bug = BUGS[name]
    case = _round(bug)
    hx = executor()
    got = run_transport(hx, [case], True, seed=2, **bug.kw)
    check_round(hx, got, 0, case, True, name)


def _mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def test_a_failed_run_gives_back_its_stacks_when_released(modules):
    """A failed run leaves its threads where they stopped; release() frees them and unmaps their
    stacks (a guard page and a stack each). Kept, they pushed CI's pytest process to
    vm.max_map_count and LLVM aborted compiling a later test's program."""
    name = next(iter(BUGS))
    modules[name].release()
    before = _mappings()
    with pytest.raises(RuntimeError, match=BUGS[name].report):
        run_transport(modules[name], [_round(BUGS[name])], True, seed=2, **BUGS[name].kw)
    held = _mappings() - before
    assert held > 200, f"the failed run holds only {held} mappings: it proves nothing"
    modules[name].release()
    assert _mappings() - before < 20

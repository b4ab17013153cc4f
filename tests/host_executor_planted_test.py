"""Proof that the host executor fails kernels that are wrong: bugs planted in copies of the
transport's kernel sources (or of its harness), each compiled into a module of its own for this
test only (tests/host_executor_helpers.py `planted`), each caught with the report its class calls
for, or as a round that differs from the §2.1 model (docs/host_executor.md). The same round runs
clean on the working tree's kernels.

The bugs after the first seven stood in the executor's blind spots before issue 43: each passed
every host_executor test of the tree before it (checked: each patch applied to that tree, its
whole `-m "host_executor and not sweep"` suite passed; row_layout.cu was not built for the
executor at all). Each is caught now by what closed its spot: the configurations of
host_executor_configs_test.py (FP8 from float16, rows of H % 8 != 0, zero_padding=False), the
poison and initcheck of memory the kernels must write, the peer-access check, the layout
kernels on the executor.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from host_executor_helpers import (
    ROOT,
    Config,
    check_config,
    executor,
    planted,
    run_config,
    run_transport,
)
from transport_helpers import Round, check_round, layout_args

pytestmark = pytest.mark.host_executor


@dataclasses.dataclass(frozen=True)
class Bug:
    kernel: str  # the file the patch applies to: under xla_ffi/cuda/kernels/, or SOURCES'
    old: str  # text found exactly once there
    new: str
    report: str  # what the executor must say, or (caught="values") the mismatch (a regex)
    rows: tuple = ("float32", 36)  # the round's dtype and hidden size
    mode: str = "dropless"
    # run_transport's executor and harness settings
    kw: dict = dataclasses.field(default_factory=dict)
    # What runs it instead of a transport round of `rows` and `mode`: a configuration
    # (host_executor_helpers.Config) or "layout" (the layout kernels, _layout_round).
    run: Config | str | None = None
    caught: str = "report"  # "report": the executor's RuntimeError; "values": the model's check


# Planted files that are not kernels (the harness: CMakeLists.txt builds its object alike).
SOURCES = {"harness.cc": "lab/native/cuda/harness.cc"}


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
    # ZeroPadding's zero line rounded down instead of up: the padding rows between the last
    # received row and the line keep what was there (poison here, stale rows on a GPU).
    "zero_line_rounded_down": Bug(
        "receive.cu",
        "static_cast<int64_t>((last + pad - 1) / pad) * pad;",
        "static_cast<int64_t>(last / pad) * pad;",
        r"tokens of rank \d below its zero line",
        run=Config("float32", 36, False, "capacity", False, 2, 2, 2),
        caught="values",
    ),
    # The narrow dequantise (FP8 rows of H % 8 != 0, a byte at a time) reads the next payload
    # byte.
    "narrow_dequantise_byte_off_by_one": Bug(
        "receive.cu",
        "    q[0] = static_cast<uint8_t>(wire[e]);",
        "    q[0] = static_cast<uint8_t>(wire[e + 1]);",
        r"tokens",
        run=Config("float16", 30, True, "dropless", True, 2, 2, 2),
        caught="values",
    ),
    # float16 tokens quantised as if they were bfloat16.
    "float16_quantised_as_bfloat16": Bug(
        "send.cu",
        "    case Dtype::kF16:\n      return Launch<false, Dtype::kF16, true>(peers, a, stream);",
        "    case Dtype::kF16:\n      return Launch<false, Dtype::kBF16, true>(peers, a, stream);",
        r"tokens",
        run=Config("float16", 64, True, "dropless", True, 2, 2, 2),
        caught="values",
    ),
    # The slot map's counters left as cudaMalloc left them: the assign kernel's atomicMax on
    # info[1] (or the permute's read of it) starts from whatever was there.
    "slot_map_info_memset_dropped": Bug(
        "slot_map.cu",
        "  if (s == cudaSuccess) s = cudaMemsetAsync(info, 0, 2 * sizeof(int32_t), stream);\n",
        "",
        r"uninitialised global memory read \(initcheck\): GPU \d (AssignSlotsKernel|PermuteKernel) "
        r".* reads 4 bytes at .*(slot_map|receive)\.cu:\d+",
    ),
    # The harness never enables peer access: the first send into a peer's window faults.
    "peer_access_never_enabled": Bug(
        "harness.cc",
        "        const cudaError_t s = cudaDeviceEnablePeerAccess(static_cast<int>(p), 0);",
        "        const cudaError_t s = cudaSuccess;  // planted: peer access never enabled",
        r"peer access not enabled: .*SendKernel.* writes \d+ bytes at global memory .*: memory "
        r"of GPU \d, which GPU \d never enabled with cudaDeviceEnablePeerAccess",
    ),
    # The assign kernel's leader advances its expert's running count while lanes of the same
    # tile may still read it (no __syncwarp between: lanes are not in lockstep).
    "layout_count_advanced_before_its_reads": Bug(
        "row_layout.cu",
        "      row_pos[i] = -1;\n    }\n    __syncwarp();\n",
        "      row_pos[i] = -1;\n    }\n",
        r"data race on global memory .*AssignChunksKernel.* writes it at .*row_layout\.cu:\d+",
        run="layout",
    ),
}


def _patched(bug: Bug) -> str:
    path = SOURCES.get(bug.kernel, f"xla_ffi/cuda/kernels/{bug.kernel}")
    source = (ROOT / path).read_text()
    assert source.count(bug.old) == 1, f"the planted patch no longer applies to {bug.kernel}"
    return source.replace(bug.old, bug.new)


@pytest.fixture(scope="module")
def modules():
    return planted({name: (bug.kernel, _patched(bug)) for name, bug in BUGS.items()})


def _round(bug: Bug) -> Round:
    dtype, hidden = bug.rows
    return Round("random", dtype, hidden, R=2, T=70, mode=bug.mode)


def _layout_round(module) -> None:
    """The layout kernels on one GPU against the host layout (host_executor_layout_test.py)."""
    module.configure(seed=2, gpus=1, sms=3)
    idx = np.random.default_rng(2).integers(-1, 8, size=(4, 24, 3)).astype(np.int32)
    args = layout_args(idx, 8, "capacity")
    want = module.cuda_selftest_layout(**args, reference=True)
    for key, value in module.cuda_selftest_layout(**args).items():
        np.testing.assert_array_equal(value, want[key], err_msg=key)


def _exercise(module, name: str) -> None:
    """The bug's round on `module`, checked against the model."""
    bug = BUGS[name]
    if bug.run == "layout":
        _layout_round(module)
    elif isinstance(bug.run, Config):
        case, weighted, got = run_config(module, bug.run, seed=2)
        check_config(module, bug.run, case, weighted, got, name)
    else:
        case = _round(bug)
        got = run_transport(module, [case], True, seed=2, **bug.kw)
        check_round(module, got, 0, case, True, name)


@pytest.mark.parametrize("name", BUGS)
def test_planted_bug_is_reported(modules, name):
    bug = BUGS[name]
    caught = RuntimeError if bug.caught == "report" else AssertionError
    with pytest.raises(caught, match=bug.report):
        _exercise(modules[name], name)


@pytest.mark.parametrize("name", BUGS)
def test_the_working_tree_passes_the_same_round(name):
    _exercise(executor(), name)


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

"""The layout step's CUDA kernels on the host executor (docs/host_executor.md): the four kernels
of xla_ffi/cuda/kernels/row_layout.cu that the layout handler launches (PlanGroups, then
AssignRows' count, scan and assign over per-chunk prefix counts), bit for bit against the host
layout (xla_ffi/common/layout.*, every step on the CPU) and the numpy model of §2.1.2-3
(tests/transport_helpers.py), through the hook a GPU runs them by (lab/native/cuda/layout_hooks.cc:
the counts computed on the CPU, as XLA all-gathers them in production). Their outputs and scratch
start as cudaMalloc leaves them: poison the executor reports reading.
"""

from __future__ import annotations

import numpy as np
import pytest
from host_executor_helpers import executor, seeds
from transport_helpers import ROUTINGS, layout_args, numpy_layout, routing

pytestmark = pytest.mark.host_executor

# The CUDA layout tests' cases (tests/cuda_kernels_test.py): every routing dropless, then
# capacities, a permuted placement and too few rows; many_chunks spans three 2048-id chunks.
CASES = [(r, "dropless") for r in ROUTINGS] + [
    ("random", "capacity"),
    ("duplicates", "capacity"),
    ("many_chunks", "capacity"),
    ("random", "permuted"),
    ("one_expert", "tight_rows"),
]
# Only the host layout has these (the GPU gets its counts from XLA).
HOST_ONLY = ("counts", "invalid", "dropped_per_source")


@pytest.fixture(scope="module")
def hx():
    return executor()


def _check(hx, idx, mode, seed):
    hx.configure(seed=seed, gpus=1, sms=3)
    args = layout_args(idx, 8, mode)
    host = hx.cuda_selftest_layout(**args, reference=True)
    model = numpy_layout(**args)
    got = hx.cuda_selftest_layout(**args)
    assert set(got) == set(host) - set(HOST_ONLY)
    for key, value in got.items():
        np.testing.assert_array_equal(value, host[key], err_msg=f"{key}: executor vs host")
        np.testing.assert_array_equal(value, model[key], err_msg=f"{key}: executor vs numpy")
        assert value.dtype == host[key].dtype, key


@pytest.mark.parametrize(
    "name, mode, seed",
    [(*case, seed) for case in CASES for seed in seeds(1)],
    ids=[f"{n}-{m}" for n, m in CASES],
)
def test_layout_kernels_match_the_host(hx, name, mode, seed):
    _check(hx, routing(name, np.random.default_rng(0)), mode, seed)


def test_layout_kernels_on_several_blocks(hx):
    """9000 (t, k) ids of each of two ranks: five chunks, the count and assign kernels on two
    blocks of four warps (one warp a chunk), the fifth chunk's warp alone in its block."""
    idx = np.random.default_rng(4).integers(-1, 8, size=(2, 3000, 3)).astype(np.int32)
    _check(hx, idx, "capacity", seeds(1)[0])

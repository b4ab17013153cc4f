"""The CUDA layout kernels against the host kernels and a numpy model, bit for bit
(docs/design.md §2.1.2-3).

The test module's `cuda_selftest_layout` runs the layout handler's kernels (PlanGroups and
AssignRows over the counts XLA all-gathers in production) on the GPU, or with `reference=True`
every layout step of the host kernels, on the same inputs for R ranks. Tests marked `gpu` compare
the two; they skip without a CUDA build or a GPU, and fail instead when JAX_HYBRIDEP_REQUIRE_GPU=1.
The unmarked tests check the numpy model of §2.1.2-3 against the host kernels, so a GPU run only
tests the kernels. The routings, values and layout model are tests/transport_helpers.py's.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess

import numpy as np
import pytest
from transport_helpers import ROUTINGS, layout_args, numpy_layout, routing

from jax_hybridep import _native
from lab import native_module

native = native_module.testing_module()


def test_built_with_cuda_when_nvcc_present():
    if os.environ.get("JAX_HYBRIDEP_CUDA", "").upper() == "OFF":
        pytest.skip("JAX_HYBRIDEP_CUDA=OFF: a host-only build was asked for")
    nvcc = shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if pathlib.Path("/usr/local/cuda/bin/nvcc").exists() else None
    )
    if nvcc is None:
        pytest.skip("no nvcc on this machine")
    assert _native.module().with_cuda, f"nvcc is at {nvcc} but _hybridep was built without CUDA"
    assert native.with_cuda, "the test module was built without CUDA beside a CUDA _hybridep"
    assert native.cuda_device_count() >= 0  # and it must not raise without a driver


def _cuobjdump() -> str | None:
    """cuobjdump from $CUOBJDUMP, PATH or the CUDA toolkit (not every toolkit install has it)."""
    for candidate in (
        os.environ.get("CUOBJDUMP"),
        shutil.which("cuobjdump"),
        "/usr/local/cuda/bin/cuobjdump",
    ):
        if candidate and pathlib.Path(candidate).is_file():
            return candidate
    return None


def _device_code(tool: str, library: pathlib.Path, listing: str) -> set[str]:
    """The architectures of `library`'s cubins (listing 'elf') or PTX (listing 'ptx')."""
    proc = subprocess.run(
        [tool, f"--list-{listing}", str(library)], capture_output=True, text=True, check=False
    )
    return set(re.findall(r"\.(sm_\d+a?)\.", proc.stdout))


def test_device_code_for_hopper_blackwell_and_ptx(cuda_build):
    """The runtime library (every kernel the handlers launch) and the test module (the harness)
    carry SASS for sm_90a and sm_100a and compute_90 PTX for the rest (CMakeLists.txt); the
    production module carries none of its own."""
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (set CUOBJDUMP, or install nvidia-cuda-cuobjdump)")
    production = pathlib.Path(_native.module().__file__)
    for library in (production.with_name("libhybridep_runtime.so"), pathlib.Path(native.__file__)):
        assert _device_code(tool, library, "elf") == {"sm_90a", "sm_100a"}, library
        assert _device_code(tool, library, "ptx") == {"sm_90"}, library
    assert _device_code(tool, production, "elf") == set()


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


@pytest.mark.parametrize("name,mode", LAYOUT_CASES)
def test_host_layout_matches_numpy(cuda_build, name, mode):
    args = layout_args(routing(name, np.random.default_rng(0)), 8, mode)
    _assert_same(native.cuda_selftest_layout(**args, reference=True), numpy_layout(**args), "host")


@pytest.mark.gpu
@pytest.mark.parametrize("name,mode", LAYOUT_CASES)
def test_cuda_layout_matches_host(gpu, name, mode):
    args = layout_args(routing(name, np.random.default_rng(0)), 8, mode)
    host = native.cuda_selftest_layout(**args, reference=True)
    # The GPU runs what the CUDA layout handler runs; its counts come from XLA in production.
    want = {
        key: host[key] for key in host if key not in ("counts", "invalid", "dropped_per_source")
    }
    _assert_same(native.cuda_selftest_layout(**args), want, "cuda vs host")
    _assert_same(native.cuda_selftest_layout(**args), want, "cuda rerun")  # deterministic

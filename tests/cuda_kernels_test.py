"""The CUDA layout kernels against the host kernels and a numpy model, bit for bit
(docs/design.md §2.1.2-3).

The test module's `cuda_selftest_layout` runs the layout handler's kernels (PlanGroups and
AssignRows over the counts XLA all-gathers in production) on the GPU, or with `reference=True`
every layout step of the host kernels, on the same inputs for R ranks. Tests marked `gpu` compare
the two; they skip without a CUDA build or a GPU, and fail instead when JAX_HYBRIDEP_REQUIRE_GPU=1.
The unmarked tests check the numpy model of §2.1.2-3 against the host kernels, so a GPU run only
tests the kernels. The routings and values here are shared with tests/cuda_transport_test.py.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess

import ml_dtypes
import numpy as np
import pytest

from jax_hybridep import _native

native = _native.testing_module()

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


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
    for candidate in (os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump"),
                      "/usr/local/cuda/bin/cuobjdump"):  # fmt: skip
        if candidate and pathlib.Path(candidate).is_file():
            return candidate
    return None


def _device_code(tool: str, library: pathlib.Path, listing: str) -> set[str]:
    """The architectures of `library`'s cubins (listing 'elf') or PTX (listing 'ptx')."""
    proc = subprocess.run([tool, f"--list-{listing}", str(library)], capture_output=True,
                          text=True, check=False)  # fmt: skip
    return set(re.findall(r"\.(sm_\d+a?)\.", proc.stdout))


def test_device_code_for_hopper_blackwell_and_ptx(cuda_build):
    """The runtime library (every kernel the handlers launch) and the test module (the harness)
    carry SASS for sm_90a and sm_100a and compute_90 PTX for the rest (CMakeLists.txt); the
    production module carries none of its own."""
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (set CUOBJDUMP, or install nvidia-cuda-cuobjdump)")
    testing = pathlib.Path(native.__file__)
    for library in (testing.with_name("libhybridep_runtime.so"), testing):
        assert _device_code(tool, library, "elf") == {"sm_90a", "sm_100a"}, library
        assert _device_code(tool, library, "ptx") == {"sm_90"}, library
    production = pathlib.Path(_native.module().__file__)
    assert _device_code(tool, production, "elf") == set()


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
    host = native.cuda_selftest_layout(**args, reference=True)
    # The GPU runs what the CUDA layout handler runs; its counts come from XLA in production.
    want = {
        key: host[key] for key in host if key not in ("counts", "invalid", "dropped_per_source")
    }
    _assert_same(native.cuda_selftest_layout(**args), want, "cuda vs host")
    _assert_same(native.cuda_selftest_layout(**args), want, "cuda rerun")  # deterministic


# ---- Values shared with tests/cuda_transport_test.py ----


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

"""JAX-level dispatch/combine on real GPUs through the CUDA handlers (tests/gpu_worker.py).

The worker runs in its own process with JAX_PLATFORMS=cuda (this suite's process is pinned to fake
CPU devices): one process driving one GPU (`gpu`), every local GPU as one EP group, or one process
per GPU through jax.distributed with the windows of the other processes opened by CUDA IPC
(`multigpu`). Dispatch outputs must equal the xla backend's bit for bit; combine and gradients
must agree to float32 rounding (XLA:GPU may contract the xla backend's multiply-adds, which the
CUDA kernels never do) and be bitwise reproducible from run to run on reused windows. Skips
without a GPU; fails instead when JAX_HYBRIDEP_REQUIRE_GPU=1.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from mp_launch import free_port
from train_harness import python_path_env

from lab import native_module

WORKER = pathlib.Path(__file__).with_name("gpu_worker.py")
TIMEOUT_S = 300


# Without excess precision XLA rounds 16-bit intermediates as written (docs/design.md §2.1.4).
GPU_ENV = dict(
    JAX_PLATFORMS="cuda",
    XLA_PYTHON_CLIENT_MEM_FRACTION="0.5",
    XLA_FLAGS="--xla_allow_excess_precision=false",
)


def _run_worker(*flags: str, env=GPU_ENV) -> dict:
    proc = subprocess.run(
        [sys.executable, str(WORKER), *flags],
        env=python_path_env(**env),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _local_gpus(at_least: int, even: bool = False) -> int:
    """The visible GPU count; skips the test with fewer (or an odd count when `even`)."""
    count = native_module.testing_module().cuda_device_count()
    if count < at_least or (even and count % 2):
        pytest.skip(
            f"{count} GPU(s) visible; this test needs {'an even number ' if even else ''}"
            f">= {at_least}"
        )
    return count


def _check(result: dict, devices: int, processes: int = 1):
    assert result["devices"] == devices and result["platform"] == "gpu"
    assert result["processes"] == processes
    for name, case in result["cases"].items():
        assert case["ran_cuda"], (name, case)
        assert case["dispatch_bitwise"], (name, case)
        assert case["rerun_bitwise"], (name, case)
        tol = 1e-5 if name.startswith("float32") else 2e-2  # relative to the largest value
        assert case["out_max_diff"] <= tol, (name, case)
        assert case["grad_max_diff"] <= tol, (name, case)
    assert any(c["invalid"] > 0 for c in result["cases"].values())
    assert result["fp8_element_bitwise"]  # XLA quantises on the device below slower levels
    # The transport's kernels quantise (send) and dequantise (permute) every bf16 pattern as jnp.
    assert result["fp8_every_pattern"] == dict(fp8_rows_bitwise=True, rows_bitwise_but_nan=True)
    # Per-site state belongs to the executable: every re-jitted program holds the same number
    # (one per CUDA call site: layout, slot map, dispatch, unpermute, combine) and nothing
    # outlives it.
    states = result["site_states"]
    assert states["per_program"] == [states["per_program"][0]] * 4, states
    assert states["per_program"][0] >= 3 and states["after"] == 0, states
    if result["train"] is not None:  # the example LM trains alike on both backends
        ffi, xla = result["train"]["ffi"], result["train"]["xla"]
        assert ffi["backend"].startswith("ffi") and xla["backend"].startswith("xla")
        # Relative: XLA:GPU compiles, fuses and autotunes the two programs separately, so the
        # rounding differences of each step compound over 8 Adam steps (an H200 run saw losses
        # 1.6e-3 apart); the per-case checks above bound the exchange itself.
        for a, b in zip(ffi["train"], xla["train"], strict=True):
            assert abs(a - b) <= 1e-3 * abs(b), (ffi["train"], xla["train"])


@pytest.mark.gpu
def test_one_gpu(gpu):
    _check(_run_worker("--devices=1", "--train"), 1)


@pytest.mark.gpu
@pytest.mark.multigpu
def test_all_local_gpus_one_process(gpu):
    count = _local_gpus(2)
    _check(_run_worker(f"--devices={count}", "--train"), count)


@pytest.mark.gpu
@pytest.mark.multigpu
def test_hierarchical_on_local_gpus(gpu):
    """(node=2, local=N/2): the node level by XLA all-to-alls, the transport within each half."""
    count = _local_gpus(2, even=True)
    result = _run_worker(f"--devices={count}", "--levels=hier", "--train")
    assert result["levels"] == ["node", "local"]
    _check(result, count)


@pytest.mark.gpu
@pytest.mark.multigpu
def test_one_process_per_gpu(gpu, tmp_path):
    count = _local_gpus(2)
    port = free_port()
    logs = [tmp_path / f"process{i}.log" for i in range(count)]
    procs = []
    for i, log in enumerate(logs):
        # Files, not pipes: a full pipe would stall a worker. The report is stdout's last line.
        with open(log, "w") as out, open(log.with_suffix(".err"), "w") as err:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(WORKER),
                        f"--process_id={i}",
                        f"--num_processes={count}",
                        f"--port={port}",
                    ],
                    env=python_path_env(**GPU_ENV),
                    stdout=out,
                    stderr=err,
                    text=True,
                )
            )
    try:
        for proc in procs:
            proc.wait(timeout=TIMEOUT_S)
    finally:
        for proc in procs:
            proc.kill()
    outputs = [log.read_text() for log in logs]
    errors = [log.with_suffix(".err").read_text() for log in logs]
    assert [p.returncode for p in procs] == [0] * count, "\n".join(e[-3000:] for e in errors)
    results = [json.loads(o.strip().splitlines()[-1]) for o in outputs]
    assert all(r == results[0] for r in results)  # every process gathered the same results
    assert results[0]["single_process"] is False
    _check(results[0], count, processes=count)


def test_worker_runs_on_cpu_devices():
    """The worker itself, on 4 fake CPU devices (node=2, local=2) with the host handlers: checked
    here so a GPU run never finds it broken; whole programs agree bitwise with excess precision
    off, 16-bit ones included."""
    env = dict(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=4 --xla_allow_excess_precision=false",
    )
    result = _run_worker(
        "--devices=4", "--levels=hier", "--tokens=8", "--hidden=16", "--variants=smoke", env=env
    )
    assert result["platform"] == "cpu" and result["levels"] == ["node", "local"]
    assert result["fp8_element_bitwise"]
    assert result["fp8_every_pattern"] == dict(fp8_rows_bitwise=True, rows_bitwise_but_nan=True)
    # No CUDA handler ran: no per-site state (None from a build without CUDA).
    assert result["site_states"] in (None, dict(per_program=[0, 0], after=0))
    for name, case in result["cases"].items():
        assert not case["ran_cuda"], name
        for key in ("dispatch_bitwise", "rerun_bitwise", "out_bitwise", "grads_bitwise"):
            assert case[key], (name, key, case)

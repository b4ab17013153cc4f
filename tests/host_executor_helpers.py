"""Builds and loads the host executor's module (docs/host_executor.md) from the kernel sources in
the working tree, on demand, as scripts/sanitize.sh builds its module: an edited kernel is picked
up by the next test run without reinstalling the package.

`executor()` is the module of the working tree's kernels; `planted(bugs)` builds one module per
planted bug (a patched copy of one kernel file, tests/host_executor_planted_test.py) beside it.
Builds go to build/host_executor (CMake + Ninja from the virtualenv, CUDA off); a lock keeps two
pytest processes from building at once.
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import importlib.util
import pathlib
import shutil
import subprocess
import sys

import numpy as np
from transport_helpers import RECEIVE_ROWS, Round, check_round

ROOT = pathlib.Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "host_executor"
PLANTED = BUILD / "planted"
MODULE = "_hybridep_host_executor"  # every module's init name (module.cc is compiled once)


def _tool(name: str) -> str:
    beside = pathlib.Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        raise RuntimeError(f"host executor build: no {name} (run scripts/setup.sh)")
    return found


def _run(command: list[str]) -> None:
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        log = (proc.stdout + proc.stderr)[-6000:]
        raise RuntimeError(f"host executor build failed: {' '.join(command)}\n{log}")


def build(targets: list[str]) -> None:
    """Configures build/host_executor (every planted bug's directory included) and builds."""
    BUILD.mkdir(parents=True, exist_ok=True)
    with open(BUILD / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _run(
            [
                _tool("cmake"),
                "-S",
                str(ROOT),
                "-B",
                str(BUILD),
                "-G",
                "Ninja",
                f"-DCMAKE_MAKE_PROGRAM={_tool('ninja')}",
                "-DCMAKE_BUILD_TYPE=Release",
                "-DJAX_HYBRIDEP_CUDA=OFF",
                "-DJAX_HYBRIDEP_HOST_EXECUTOR=ON",
                f"-DJAX_HYBRIDEP_PLANTED_DIR={PLANTED}",
                f"-DPython_EXECUTABLE={sys.executable}",
            ]
        )
        _run([_tool("cmake"), "--build", str(BUILD), "--target", *targets])


_LOADED: list = []  # every module loaded, for release()


def load(target: str):
    """The built module of `target` (its init name is MODULE whatever the file's name)."""
    (path,) = BUILD.glob(f"{target}.*.so")
    spec = importlib.util.spec_from_file_location(MODULE, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _LOADED.append(module)
    return module


def release() -> None:
    """Frees every loaded module's last run (tests/conftest.py, after each test): a failed run
    keeps thousands of fiber stacks, two mappings each, and the suite's XLA compiles later in the
    same process failed once the process neared vm.max_map_count (65530 mappings)."""
    for module in _LOADED:
        module.release()


@functools.cache
def executor():
    """The host executor with the working tree's kernels, built if anything changed."""
    build([MODULE])
    return load(MODULE)


def planted(bugs: dict[str, tuple[str, str]]) -> dict[str, object]:
    """One module per bug: {name: (kernel file under xla_ffi/cuda/, its patched text)}."""
    for name, (kernel, text) in bugs.items():
        path = PLANTED / name / kernel
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:  # unchanged files keep their objects
            path.write_text(text)
    build([f"_planted_{name}" for name in bugs])
    return {name: load(f"_planted_{name}") for name in bugs}


def run_transport(
    module,
    rounds,
    weighted: bool,
    send_blocks: int = 2,
    seed: int = 0,
    sms: int = 2,
    optin_smem: int | None = None,
    copy_probability: float = 0.25,
    **kw,
) -> dict:
    """The transport's harness (lab/native/cuda/harness.cc) on the executor: rank r of
    every round on virtual GPU r, its own stream, the host waiting only at the end. `rounds`:
    tests/transport_helpers.py Rounds, one per exchange round on the same windows."""
    from transport_helpers import run_harness

    from jax_hybridep import _native

    if optin_smem is None:  # the opt-in shared memory of an sm_90 block, as the kernels plan it
        optin_smem = _native.limits()["shared_budget"]
    module.configure(
        seed=seed,
        gpus=rounds[0].R,
        sms=sms,
        optin_smem=optin_smem,
        copy_probability=copy_probability,
    )
    return run_harness(
        module,
        rounds,
        weighted,
        send_blocks=send_blocks,
        per_rank_devices=True,
        sync_each_phase=False,
        **kw,
    )


# ---------------------------------------------------------------------------- configurations
# A round of one of the handlers' configurations (tests/host_executor_configs_test.py; the
# planted bugs of its blind spots reuse it).

CONFIG_TOKENS = 70  # tokens per rank: two chunks of 64 items, the second partial
# The layout's pad multiple per mode (tests/transport_helpers.py layout_args): the handlers pass
# the plan's as the permutes' zero_pad_multiple.
PAD = {"dropless": 1, "capacity": 4, "tight_rows": 2}


@dataclasses.dataclass(frozen=True)
class Config:
    dtype: str
    hidden: int
    fp8: bool  # tokens quantised by the send, dequantised by the permute
    mode: str
    zero_padding: bool  # False: zero_pad_multiple = the layout's pad multiple
    ranks: int
    sms: int
    send_blocks: int
    routing: str = "random"

    @property
    def zero_pad_multiple(self) -> int:
        return 0 if self.zero_padding else PAD[self.mode]


def fp8_round_trip(case: Round) -> None:
    """case.x as the FP8 wire brings it: the jnp quantisation, dequantised to its dtype."""
    from jax_hybridep import fp8

    flat = case.x.reshape(-1, case.hidden)
    back = fp8.dequantize(*fp8.quantize(flat), case.np_dtype)
    case.x = np.asarray(back).reshape(case.x.shape)


def run_config(module, config: Config, seed: int, round_seed: int = 0):
    """One round of `config` on `module` (the executor, or a planted bug's): the case as the
    model sees it, the weighting, and the harness's outputs."""
    case = Round(
        config.routing,
        config.dtype,
        config.hidden,
        R=config.ranks,
        T=CONFIG_TOKENS,
        mode=config.mode,
        seed=round_seed,
    )
    weighted = (seed + config.send_blocks) % 2 == 1
    got = run_transport(
        module,
        [case],
        weighted,
        send_blocks=config.send_blocks,
        seed=seed,
        sms=config.sms,
        fp8_hidden=config.hidden if config.fp8 else 0,
        zero_pad_multiple=config.zero_pad_multiple,
    )
    if config.fp8:
        fp8_round_trip(case)
    return case, weighted, got


def check_config(module, config: Config, case: Round, weighted: bool, got: dict, what: str):
    """The round against the model below each rank's zero line; past it, rows nothing wrote."""
    check_round(module, got, 0, case, weighted, what, zero_pad_multiple=config.zero_pad_multiple)
    for r, line in enumerate(case.zero_lines(config.zero_pad_multiple)):
        for key in RECEIVE_ROWS:
            past = got[key][0, r, line:]
            assert (past == 0xFF).all(), f"{what}: {key} of rank {r} written past its line {line}"


def seeds(count: int) -> list[int]:
    """Scheduler seeds for a test: count - 1 fixed ones and one that changes every day, so each
    day's runs try a schedule no run tried before. A failure's report names its seed;
    JAX_HYBRIDEP_EXECUTOR_SEED=<seed> makes it the rotating one, to run that schedule again."""
    import datetime
    import os

    rotating = os.environ.get("JAX_HYBRIDEP_EXECUTOR_SEED")
    day = datetime.date.today().toordinal()
    return list(range(count - 1)) + [int(rotating) if rotating else 1000 + day % 100000]

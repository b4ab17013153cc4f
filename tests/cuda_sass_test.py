"""The transport's kernels as compiled, read without a GPU (docs/design.md §5; docs/gpu.md).

The runtime library's device code (libhybridep_runtime.so, where every kernel the handlers launch
lives) is read with cuobjdump (and nvdisasm for the SASS; both pip packages of the test extras),
for each architecture it carries SASS for (sm_90a and sm_100a; tests/cuda_kernels_test.py checks
that list and the PTX): the send kernels fit their register budget with no stack or spills and
move rows with the bulk-copy engine (UBLKCP: shared -> global stores, global -> shared loads),
their only global stores being the 64-bit system-scope flags; the wide permute, unpermute and
reduce store rows 16 bytes a lane (STG.E.128), nothing narrower, and spill nothing (the staging
plan they launch with: tests/send_plan_test.py). What only a GPU can show (the rates) is owed to
scripts/gpu_check.sh.
"""

from __future__ import annotations

import functools
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from jax_hybridep import _native

pytestmark = pytest.mark.usefixtures("cuda_build")

REGISTERS = 96
KIB = 1024


def _tool(name: str) -> str:
    """cuobjdump or nvdisasm: on PATH, beside nvcc, or from the nvidia-cuda-* pip packages."""
    found = shutil.which(name)
    if found:
        return found
    for root in [pathlib.Path(p) for p in sys.path] + [pathlib.Path("/usr/local/cuda/bin")]:
        for candidate in (root / "nvidia" / "cu13" / "bin" / name, root / name):
            if candidate.is_file():
                return str(candidate)
    pytest.fail(f"{name} not found: install the test extras (nvidia-cuda-cuobjdump/-nvdisasm)")


def _run(*args: str) -> str:
    env = dict(os.environ, PATH=f"{pathlib.Path(_tool('nvdisasm')).parent}:{os.environ['PATH']}")
    runtime = pathlib.Path(_native.module().__file__).with_name("libhybridep_runtime.so")
    proc = subprocess.run(
        [_tool("cuobjdump"), *args, str(runtime)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _architectures() -> tuple[str, ...]:
    """The SASS the build was asked for (scripts/gpu_check.sh builds sm_90a alone)."""
    wanted = os.environ.get("JAX_HYBRIDEP_CUDA_ARCHITECTURES", "90a-real;100a-real;90-virtual")
    return tuple(f"sm_{a.split('-')[0]}" for a in wanted.split(";") if a.endswith("-real"))


@functools.cache
def _resources(arch: str) -> dict[str, dict[str, int]]:
    """Per kernel (mangled name): REG, STACK, SHARED, LOCAL of the arch's SASS."""
    out, name = {}, None
    for line in _run("--dump-resource-usage", "-arch", arch).splitlines():
        if m := re.match(r"\s*Function (\S+):", line):
            name = m.group(1)
        elif name and "REG:" in line:
            out[name] = {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", line)}
    return out


@functools.cache
def _sass(arch: str) -> dict[str, list[tuple[int, str]]]:
    """Per kernel: its (address, instruction) lines."""
    out, name = {}, None
    for line in _run("-sass", "-arch", arch).splitlines():
        if m := re.match(r"\s*Function : (\S+)", line):
            name = m.group(1)
            out[name] = []
        elif name and (m := re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)):
            out[name].append((int(m.group(1), 16), m.group(2).strip()))
    return out


def _kernel(table: dict, pattern: str) -> str:
    names = [n for n in table if re.search(pattern, n)]
    assert len(names) == 1, (pattern, names)
    return names[0]


def _body(code: list[tuple[int, str]]) -> list[str]:
    """The kernel's own instructions: those before the first out-of-line subroutine it calls
    (integer division)."""
    targets = [
        int(t, 16) for _, op in code for t in re.findall(r"CALL\.REL\S*\s+0x([0-9a-f]+)", op)
    ]
    end = min(targets, default=1 << 62)
    return [re.sub(r"^@!?U?P\w+\s+", "", op) for addr, op in code if addr < end]


def _global_stores(ops: list[str]) -> list[str]:
    """The stores to global, local or generic memory (atomics apart)."""
    return [op.split()[0] for op in ops if re.match(r"(STG|ST|STL)\b", op)]


def _row_stores(ops: list[str]) -> set[str]:
    """The stores that can move rows: all but the system-scope ones (flags, the mapped error
    record)."""
    return {op for op in _global_stores(ops) if not op.endswith("STRONG.SYS")}


# Mangled names: SendKernel<kCombine, kDtype, kQuantize>, PermuteKernel<kCopy, kDtype, kFp8,
# kScaled, kWide>, UnpermuteKernel<kDtype, kWide, kWeighted> (Dtype: 0 f32, 1 bf16, 2 f16).
SEND = {
    "dispatch": r"SendKernelILb0ELNS_5DtypeE0ELb0E",
    "combine": r"SendKernelILb1ELNS_5DtypeE0ELb0E",
    "fp8 bf16": r"SendKernelILb0ELNS_5DtypeE1ELb1E",
}
WIDE = {
    "permute": r"PermuteKernelILb1ELNS_5DtypeE0ELb0ELb0ELb1E",
    "fp8 permute bf16": r"PermuteKernelILb0ELNS_5DtypeE1ELb1ELb0ELb1E",
    "scaled permute bf16": r"PermuteKernelILb0ELNS_5DtypeE1ELb0ELb1ELb1E",
    "unpermute bf16": r"UnpermuteKernelILNS_5DtypeE1ELb1ELb1E",
    "reduce bf16": r"ReduceKernelILNS_5DtypeE1ELb1E",
}


@pytest.mark.parametrize("arch", _architectures())
@pytest.mark.parametrize("kind", list(SEND))
def test_send_kernels_are_bulk_copies_within_their_registers(arch, kind):
    name = _kernel(_resources(arch), SEND[kind])
    usage = _resources(arch)[name]
    assert usage["REG"] <= REGISTERS, usage
    assert usage["STACK"] == 0 and usage["LOCAL"] == 0, usage  # no spills
    ops = _body(_sass(arch)[_kernel(_sass(arch), SEND[kind])])
    mnemonics = {op.split()[0] for op in ops}
    assert "UBLKCP.G.S" in mnemonics  # one bulk store per (item, destination GPU)
    assert "UBLKCP.S.G" in mnemonics  # the rows (and row maps) loaded by bulk copies
    # The only global stores are the flags: no row moves through LSU stores.
    assert set(_global_stores(ops)) == {"STG.E.64.STRONG.SYS"}, sorted(set(_global_stores(ops)))


@pytest.mark.parametrize("arch", _architectures())
@pytest.mark.parametrize("kind", list(WIDE))
def test_wide_kernels_store_16_bytes_a_lane(arch, kind):
    name = _kernel(_sass(arch), WIDE[kind])
    assert _row_stores(_body(_sass(arch)[name])) == {"STG.E.128"}
    usage = _resources(arch)[_kernel(_resources(arch), WIDE[kind])]
    assert usage["STACK"] == 0 and usage["LOCAL"] == 0, usage  # no spills

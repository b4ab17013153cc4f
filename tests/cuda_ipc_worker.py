"""Worker of tests/cuda_ipc_test.py: one rank of a two-process transport on one GPU.

`python tests/cuda_ipc_worker.py --rank R --ranks 2 --dir D` publishes its registered window's CUDA
IPC handle through files in D (standing in for the jax.distributed key-value store), opens its
peer's, runs rounds of dispatch, combine, redispatch and row values with the per-rank launchers,
and prints one JSON line: which of its outputs equal the numpy model of §2.1.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
from transport_helpers import Round, got_bits  # noqa: E402

from jax_hybridep import _native  # noqa: E402


def file_exchange(directory: pathlib.Path):
    """A key-value exchange through files: write mine, then wait for every rank's."""

    def exchange(prefix: str, rank: int, mine: bytes, count: int, timeout_ms: int) -> list[bytes]:
        stem = prefix.replace("/", "_")
        tmp = directory / f"{stem}.{rank}.tmp"
        tmp.write_bytes(mine)
        tmp.rename(directory / f"{stem}.{rank}")  # atomic: readers never see half a handle
        deadline = time.monotonic() + timeout_ms / 1000
        values = []
        for r in range(count):
            path = directory / f"{stem}.{r}"
            while not path.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {r} never published {path.name}")
                time.sleep(0.01)
            values.append(path.read_bytes())
        return values

    return exchange


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--dir", required=True)
    args = p.parse_args()
    # Windows come by CUDA IPC through the production module's key-value exchange; the test
    # module's harness runs on the same runtime, so it uses that exchange.
    _native.module().set_kv_exchange(file_exchange(pathlib.Path(args.dir)))
    native = _native.testing_module()
    routings = ("random", "duplicates", "one_expert")
    rounds = [Round(r, "bfloat16", 264, R=args.ranks, seed=n) for n, r in enumerate(routings)]
    per_round = [r.inputs(weighted=True) for r in rounds]
    stacked = {key: np.stack([x[key] for x in per_round]) for key in per_round[0]}
    out = native.cuda_selftest_transport(
        "bfloat16", rounds[0].C, **stacked, send_blocks=1, timeout_ms=60000, ipc_rank=args.rank
    )
    mismatches = []
    for n, case in enumerate(rounds):
        want = case.expected(weighted=True)
        for key, value in want.items():
            got = out[key][n][args.rank]
            if not np.array_equal(*got_bits(got, value[args.rank])):
                mismatches.append(f"round {n}: {key}")
    print(json.dumps(dict(rank=args.rank, pid=os.getpid(), mismatches=mismatches)))


if __name__ == "__main__":
    main()

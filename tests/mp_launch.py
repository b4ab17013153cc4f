"""Launcher for the multi-process tests: runs tests/mp_worker.py as 2 processes on 127.0.0.1.

Each worker is its own `jax.distributed` process with 4 CPU devices; the launcher only picks a
port, starts them with a clean environment, enforces a hard deadline (so a test never hangs),
and returns what each process printed, its exit code, when it exited, and its final JSON line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = Path(__file__).with_name("mp_worker.py")
NUM_PROCESSES = 2


@dataclasses.dataclass
class Proc:
    process_id: int
    returncode: int | None  # None: killed at the deadline
    exit_s: float  # seconds after launch when it exited (or was killed)
    output: str = dataclasses.field(repr=False)  # stdout and stderr, interleaved

    @property
    def result(self) -> dict | None:
        """The worker's last JSON line (its report), or None when it printed none."""
        for line in reversed(self.output.splitlines()):
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    continue
        return None

    def tail(self, chars: int = 4000) -> str:
        return f"--- process {self.process_id} (rc={self.returncode}) ---\n{self.output[-chars:]}"


def free_port() -> int:
    # Bind to port 0 and release it: the coordinator binds it again a moment later. A race with
    # another program is possible but unlikely on a test machine.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env() -> dict[str, str]:
    """The test process's environment minus what would change the workers' device setup."""
    env = dict(os.environ)
    # conftest.py forces 16 host devices through XLA_FLAGS; the workers set 4 each themselves.
    flags = [
        f
        for f in env.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    env["XLA_FLAGS"] = " ".join(flags)
    env["JAX_PLATFORMS"] = "cpu"
    # The worker's --backend flag is what is under test; the global override would mask it.
    env.pop("JAX_HYBRIDEP_BACKEND", None)
    # gRPC honours proxy variables (jax warns that they can hang initialize): the coordinator on
    # 127.0.0.1 must be reached directly.
    for key in list(env):
        if "_proxy" in key.lower():
            del env[key]
    return env


def launch(*args: str, timeout_s: float = 240.0) -> list[Proc]:
    """Runs both workers with `args` and waits for both (killing any still alive at timeout_s)."""
    port = free_port()
    env = worker_env()
    start = time.monotonic()
    procs, logs = [], []
    for i in range(NUM_PROCESSES):
        # Output goes to files, not pipes: a chatty worker can never block on a full pipe.
        log = tempfile.TemporaryFile(mode="w+")
        cmd = [
            sys.executable,
            str(WORKER),
            f"--process_id={i}",
            f"--num_processes={NUM_PROCESSES}",
            f"--port={port}",
            *args,
        ]
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
        logs.append(log)
    exit_s: list[float | None] = [None] * NUM_PROCESSES
    killed = [False] * NUM_PROCESSES
    try:
        # Poll rather than wait on one process: the tests need each process's own exit time.
        while None in exit_s:
            now = time.monotonic() - start
            for i, p in enumerate(procs):
                if exit_s[i] is None and p.poll() is not None:
                    exit_s[i] = now
                elif exit_s[i] is None and now > timeout_s:
                    p.kill()
                    p.wait()
                    exit_s[i], killed[i] = now, True
            time.sleep(0.05)
    finally:
        # An interrupted test (Ctrl-C, pytest timeout) must not leave workers behind.
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    out = []
    for i, (p, log) in enumerate(zip(procs, logs, strict=True)):
        log.seek(0)
        out.append(Proc(i, None if killed[i] else p.returncode, exit_s[i], log.read()))
        log.close()
    return out


def tails(procs: list[Proc]) -> str:
    return "\n".join(p.tail() for p in procs)

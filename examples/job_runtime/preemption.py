"""SIGTERM as a scheduler's preemption (SLURM, Kubernetes: SIGTERM, then SIGKILL after a grace
period): the job finishes the step it is in, commits a checkpoint there and exits with status
143 (128 + SIGTERM) and one line naming the checkpoint; `--resume` continues from it exactly.

`install` (the command line's job, before anything starts) gives SIGTERM a Python handler and
makes the interpreter's C-level handler report every signal on a socket (`signal.set_wakeup_fd`)
that a thread of our own reads: a SIGTERM is seen at once, whichever thread the kernel delivers it
to and even while the main thread is inside native code (a compile, a collective), where the
Python handler itself would run only later. `reclaim` puts the handler back after
`jax.distributed.initialize`, whose preemption notifier installs a native SIGTERM handler of its
own (before this module, a SIGTERM to a job of several processes was caught there and the job
trained on). From the signal on a deadline runs: whatever the job is doing, it exits after
`--stop_timeout_s` (the last committed checkpoint then stands). Without `install` (e.g. `train`
called from a test) SIGTERM keeps its default action.

With several processes the processes must stop after the same step (the checkpoint's save is
collective), whichever of them got the signal: after each step process 0 decides for all
(`Processes.decide`) from its own signal and those the others published in the key-value store,
one round trip per step.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading

from examples.job_runtime.processes import Processes

STATUS = 128 + signal.SIGTERM  # a job ended by SIGTERM, as the shell reports one


class Stopped(Exception):  # noqa: N818  (not an error: how a preempted run ends)
    """`train` stopped at a SIGTERM after committing a checkpoint; the message says where."""


_requested = threading.Event()
# Set by `install`: the deadline (`timeout_s`) and what its line starts with (`prefix`).
_state = {"installed": False, "published": False}


def requested() -> bool:
    """Whether this process got SIGTERM (since `install`)."""
    return _requested.is_set()


def install(timeout_s: float, prefix: str) -> None:
    """Takes SIGTERM from now on (call in the main thread): the first one requests a stop
    (`due`) and starts the `timeout_s` deadline, whose line starts with `prefix` (the job's
    name; `set_prefix` adds the process once it is known); later ones are ignored."""
    if _state["installed"]:
        return
    _state.update(installed=True, timeout_s=timeout_s, prefix=prefix)
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    _state["sockets"] = (reader, writer)  # kept open for the process's life
    reclaim()
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    threading.Thread(target=_take, args=(reader,), daemon=True, name="sigterm").start()


def reclaim() -> None:
    """SIGTERM's handler this module's again (after native code replaced it)."""
    if _state["installed"]:
        signal.signal(signal.SIGTERM, lambda *_: _request())


def set_prefix(prefix: str) -> None:
    """What the deadline's line starts with (the job's name and this process)."""
    _state["prefix"] = prefix


def _take(reader: socket.socket) -> None:
    """Reads the signal numbers the interpreter's C handler writes (from any thread, at once)."""
    while True:
        data = reader.recv(64)
        if not data:
            return
        if signal.SIGTERM in data:
            _request()


def _request() -> None:
    if _requested.is_set():
        return
    _requested.set()
    timer = threading.Timer(_state["timeout_s"], _expire)
    timer.daemon = True
    timer.start()


def _expire() -> None:
    sys.stdout.flush()
    line = (
        f"{_state['prefix']}: stopped by SIGTERM: no checkpoint committed within "
        f"--stop_timeout_s={_state['timeout_s']:g} s; exiting (--resume continues from the last "
        "committed checkpoint)"
    )
    os.write(2, f"{line}\n".encode())
    os._exit(STATUS)


def due(processes: Processes) -> bool:
    """Whether the job stops after this step: a SIGTERM reached this process or (with several)
    any process of the job; the same answer on every process. Call after every step, on every
    process. False without `install`."""
    if not _state["installed"]:
        return False
    if processes.count == 1:
        return requested()
    if requested() and not _state["published"]:
        processes.publish_stop()
        _state["published"] = True
    return bool(processes.decide("stop", lambda: requested() or processes.stop_published()))

"""One job per output directory: a lock that `train` takes before it builds a model.

Two runs writing one `--output_dir` destroy each other's run (each checkpoint save deletes the
other's temporaries and steps). So process 0 of a job holds an exclusive `flock` on
`<output_dir>/.lock` for the whole run, with its job's name, pid, host and start time written in
it; the other processes of a multi-process job share it (they learn process 0's outcome,
`Processes.decide`), and a second job is refused in one line naming the holder. The kernel drops
a `flock` when its process ends however it ends (a crash, SIGKILL), so a lock file left by a dead
job is stale by construction: the next run takes it over and says whose it was. On a filesystem
without working locks (`flock` refused), the pid and host in the file decide: a live pid on this
host, or any other host, holds it (delete the file when that run is gone).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time

from examples.job_runtime.errors import FlagError
from examples.job_runtime.processes import Processes

LOCK_NAME = ".lock"


class OutputLock:
    """The lock of one output directory, held by this process (`release` gives it back)."""

    def __init__(self, path: str, fd: int | None):
        self.path, self._fd = path, fd

    def release(self) -> None:
        """Removes the lock file (while still holding it: no other run can take the file that
        is being removed) and lets go."""
        if self._fd is None:
            return
        try:
            if _same_file(self.path, self._fd):
                os.unlink(self.path)
        finally:
            os.close(self._fd)
            self._fd = None


def _same_file(path: str, fd: int) -> bool:
    try:
        a, b = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _owner(text: str) -> dict:
    try:
        owner = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return owner if isinstance(owner, dict) else {}


def _describe(owner: dict) -> str:
    if not owner:
        return "a run that left no details"
    started = owner.get("started")
    since = (
        f", started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(started))}"
        if (isinstance(started, int | float))
        else ""
    )
    return f"{owner.get('job', 'a run')}, pid {owner.get('pid')} on host {owner.get('host')}{since}"


def _alive(owner: dict) -> bool:
    """Whether the owner may still run: any other host (cannot tell), or a live pid here."""
    if owner.get("host") != socket.gethostname():
        return bool(owner)
    try:
        os.kill(int(owner.get("pid")), 0)
    except (ProcessLookupError, TypeError, ValueError):
        return False
    except PermissionError:
        return True
    return True


def _read(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 65536).decode("utf-8", "replace")


def take(output_dir: str, job: str, processes: int = 1) -> tuple[OutputLock, str | None]:
    """(the lock of `output_dir`, a note when a dead run's lock was taken over); FlagError naming
    the holder when another run holds it. `job`: the name (e.g. "train_moe") a run refused by
    this one is told."""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, LOCK_NAME)
    for _ in range(10):  # a holder may remove the file between our open and our lock
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except BlockingIOError:
            owner = _owner(_read(fd))
            os.close(fd)
            raise FlagError(_refusal(output_dir, owner, path)) from None
        except OSError:  # no locks on this filesystem: the file's word decides
            locked = False
        if not _same_file(path, fd):  # removed by its holder meanwhile: try the new one
            os.close(fd)
            continue
        previous = _owner(_read(fd))
        if not locked and previous and _alive(previous):
            os.close(fd)
            raise FlagError(_refusal(output_dir, previous, path))
        me = dict(
            pid=os.getpid(),
            host=socket.gethostname(),
            job=job,
            processes=processes,
            started=time.time(),
        )
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        note = None
        if previous:
            note = (
                f"{output_dir}: the run that held it before ({_describe(previous)}) is gone; "
                "its lock was taken over"
            )
        return OutputLock(path, fd), note
    raise FlagError(f"--output_dir={output_dir}: cannot take its lock {path} (it keeps changing)")


def _refusal(output_dir: str, owner: dict, path: str) -> str:
    return (
        f"--output_dir={output_dir} is in use by another run ({_describe(owner)}): two runs "
        f"would destroy each other's checkpoints; wait for it to end, stop it, or use another "
        f"--output_dir (its lock: {path})"
    )


def acquire(
    output_dir: str, job: str, processes: Processes
) -> tuple[OutputLock | None, str | None]:
    """Process 0 takes the lock for the whole job; every process raises the same FlagError when
    another run holds it. Returns (the lock on process 0, else None; a takeover note or None)."""
    held = {}

    def on_process_0():
        try:
            held["lock"], note = take(output_dir, job, processes.count)
        except FlagError as err:
            return {"error": str(err)}
        return {"note": note}

    outcome = processes.decide("output dir lock", on_process_0)
    if "error" in outcome:
        raise FlagError(outcome["error"])
    return held.get("lock"), outcome.get("note")

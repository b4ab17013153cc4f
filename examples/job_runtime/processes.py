"""The processes of one training job on `jax.distributed`: agreement, liveness, output.

The main job and the cross-DC job run as one process (all local devices) or as several, one per
host or per local group of devices, joined by JAX's own distributed runtime (`startup.py`
starts and joins them):

* `Processes.agree_on_flags` refuses, on every process and before any model is built, a job whose
  processes were started with different flags (naming the flag and both values).
* `Processes.decide` runs a decision (re-balancing, re-planning) on process 0 only and hands its
  result to every process; `Processes.exchange` gathers one small JSON value from every process.
  Both go through the runtime's key-value store: no device, no compile.
* `Processes.watch` starts a liveness thread: every process publishes a heartbeat each second and
  a process that sees no heartbeat of a peer for `--heartbeat_timeout_s` (or sees the peer's
  published failure, or loses the coordinator) prints one line naming that process and exits
  non-zero, so that no process hangs in a collective whose peer is gone.
* Output: only process 0 prints (`Processes.console`); the others print only their errors, each
  line naming its process (`Processes.error_prefix`).
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable

import jax
from rich.console import Console

from examples.job_runtime.errors import FlagError
from jax_hybridep import compat

KEY = "train_moe"  # prefix of this job's keys in the runtime's key-value store
# Decisions, exchanges and barriers (one or more a step) apart from KEY/, which the liveness
# thread reads whole every second: that read stays the size of the job, not of the run.
SYNC_KEY = f"{KEY}_sync"
DECIDE_TIMEOUT_MS = 600_000  # a decision waits for process 0 (dead peers: the watchdog's job)
LEAVE_WAIT_S = 10  # how long a failing process 0 waits for the others to leave first
COORDINATOR_WAIT_MS = 3_600_000  # one wait of `Processes._watch_coordinator`
FINISH_WAIT_S = 10  # how long `finish` waits for that watch to end


class Processes:
    """This process's place in the job, and what the job's processes share.

    Attributes:
      index, count: this process's index and the number of processes (0 and 1 when alone).
    """

    def __init__(self, index: int = 0, count: int = 1, client=None, heartbeat_timeout_s=30):
        self.index, self.count, self._client = index, count, client
        self._timeout = heartbeat_timeout_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._coordinator_watch: threading.Thread | None = None
        self._decisions = 0  # decisions, exchanges and barriers so far: each key is new

    @property
    def is_main(self) -> bool:
        """Whether this process writes the run's output (process 0)."""
        return self.index == 0

    def error_prefix(self, job: str) -> str:
        """What every error line of the job named `job` starts with: its name and, with several
        processes, this process."""
        return job if self.count == 1 else f"{job} (process {self.index} of {self.count})"

    def console(self) -> Console:
        """Where the run prints: the terminal on process 0, nowhere on the others."""
        if self.is_main:
            return Console(soft_wrap=True)
        return Console(file=open(os.devnull, "w"), soft_wrap=True)  # noqa: SIM115

    # -- what the processes share ---------------------------------------------------------------

    def exchange(self, name: str, value) -> list:
        """Every process's JSON-able `value`, by process index (one call on every process, in
        the same order; `name` says what is exchanged)."""
        self._decisions += 1
        if self.count == 1:
            return [value]
        mine = json.dumps(value, sort_keys=True).encode()
        # A new key each time: a name may come again (the cross-DC job trains several runs).
        got = compat.kv_exchange(
            f"{SYNC_KEY}/exchange/{self._decisions}/{name}",
            self.index,
            mine,
            self.count,
            DECIDE_TIMEOUT_MS,
        )
        return [json.loads(v) for v in got]

    def decide(self, name: str, fn: Callable[[], object]):
        """`fn()` (JSON-able) run on process 0 only; every process gets process 0's result.
        Called in the same order on every process; `name` says what is decided."""
        self._decisions += 1
        if self.count == 1:
            return fn()
        key = f"{SYNC_KEY}/decision/{self._decisions}/{name}"
        if self.is_main:
            value = fn()
            self._client.key_value_set(key, json.dumps(value))
            return value
        return json.loads(self._client.blocking_key_value_get(key, DECIDE_TIMEOUT_MS))

    def barrier(self, name: str) -> None:
        """Waits until every process got here (one call on every process, in the same order)."""
        self._decisions += 1
        if self.count > 1:
            self._client.wait_at_barrier(f"{SYNC_KEY}/barrier/{self._decisions}", DECIDE_TIMEOUT_MS)

    def agree_on_flags(self, values: dict) -> None:
        """FlagError on every process when the processes' `values` (flag -> value) differ,
        naming the first flag that differs and the two values."""
        everyone = self.exchange("flags", values)
        for name in sorted(set().union(*everyone)):
            mine = everyone[0].get(name)
            for i, theirs in enumerate(everyone[1:], start=1):
                if theirs.get(name) != mine:
                    raise FlagError(
                        f"--{name} differs between processes: process 0 has {mine}, process {i} "
                        f"has {theirs.get(name)}; start every process with the same flags"
                    )

    def publish_stop(self) -> None:
        """Tells the job that this process got SIGTERM (`preemption.due`)."""
        self._publish("stop", "1")

    def stop_published(self) -> bool:
        """Whether any process published a SIGTERM (on process 0, for `preemption.due`)."""
        if self.count == 1:
            return False
        return bool(self._client.key_value_dir_get(f"{KEY}/stop/"))

    # -- liveness -------------------------------------------------------------------------------

    def watch(self, job: str) -> None:
        """Starts the liveness thread (with several processes): a heartbeat every second, and an
        exit naming the peer when one goes silent, reports a failure or the coordinator is lost."""
        if self.count == 1 or self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._watch, args=(self.error_prefix(job),), daemon=True
        )
        self._thread.start()
        if not self.is_main:
            self._coordinator_watch = threading.Thread(
                target=self._watch_coordinator, args=(self.error_prefix(job),), daemon=True
            )
            self._coordinator_watch.start()

    def _watch_coordinator(self, prefix: str) -> None:
        """Waits on a key that only `finish` sets: the wait fails the moment the coordinator's
        connection breaks, so that this process names the lost coordinator at once (the
        runtime's own error poll aborts the process natively a fraction of a second later)."""
        while not self._stop.is_set():
            try:
                self._client.blocking_key_value_get(f"{KEY}/done/{self.index}", COORDINATOR_WAIT_MS)
                return
            except Exception as err:  # noqa: BLE001  (the runtime raises its own types)
                if self._stop.is_set():
                    return
                if "DEADLINE_EXCEEDED" in str(err):
                    continue
                self.die(
                    f"{prefix}: lost the coordinator (process 0): {first_line(err)}; "
                    "stopping this process too. --resume continues from the last committed "
                    "checkpoint"
                )

    def _watch(self, prefix: str) -> None:
        last_seen = {i: (None, time.monotonic()) for i in range(self.count) if i != self.index}
        beat = 0
        while not self._stop.is_set():
            beat += 1
            try:
                self._client.key_value_set(f"{KEY}/alive/{self.index}", str(beat), True)
                entries = dict(self._client.key_value_dir_get(f"{KEY}/"))
            except Exception as err:  # noqa: BLE001  (the runtime raises its own types)
                if self._stop.is_set():
                    return
                self.die(
                    f"{prefix}: lost the coordinator (process 0): {first_line(err)}; "
                    "stopping this process too"
                )
            now = time.monotonic()
            for peer, (value, since) in list(last_seen.items()):
                if f"{KEY}/done/{peer}" in entries:
                    del last_seen[peer]  # finished: it beats no more
                    continue
                failure = entries.get(f"{KEY}/failed/{peer}")
                if failure is not None:
                    self.die(
                        f"{prefix}: process {peer} failed ({failure}); stopping this process too"
                    )
                alive = entries.get(f"{KEY}/alive/{peer}")
                if alive != value:
                    last_seen[peer] = (alive, now)
                elif now - since > self._timeout:
                    self.die(
                        f"{prefix}: process {peer} is gone: no sign of life for {self._timeout} s "
                        "(killed, crashed or unreachable); stopping this process too. --resume "
                        "continues from the last committed checkpoint",
                        dead=peer,
                    )
            self._stop.wait(1.0)

    def await_verdict(self) -> None:
        """Waits (at most the heartbeat timeout and a few seconds) while the liveness thread
        decides whether a peer is gone; it ends the process if so."""
        if self._thread is not None:
            self._thread.join(self._timeout + 5)

    def finish(self) -> None:
        """This process finished its part: peers stop watching it, and its watch of the
        coordinator ends (before the runtime's client goes: a thread still waiting in it at
        exit aborts the process)."""
        self._stop.set()
        if self.count > 1:
            self._client.key_value_set(f"{KEY}/done/{self.index}", "1", True)
            if self._coordinator_watch is not None:
                self._coordinator_watch.join(FINISH_WAIT_S)

    def fail(self, message: str) -> None:
        """Tells the peers (best effort) that this process failed and why, so that they exit
        at once instead of waiting for its heartbeat to stop."""
        self._stop.set()
        self._publish("failed", message.splitlines()[0][:300] if message else "no message")

    def die(self, line: str, dead: int | None = None) -> None:
        """Prints `line` as this process's last line and ends it at once.

        Skips the interpreter's shutdown: its barrier would wait for a missing process, and
        late callbacks of the checkpoint reader print noise after the line. Process 0 hosts the
        job's coordination service, whose end makes the runtime abort every process still
        connected (a long native stack dump): it waits (at most `LEAVE_WAIT_S`) until the
        other processes (but `dead`) have left."""
        sys.stdout.flush()
        sys.stderr.flush()
        # From here on other threads' output goes nowhere: `line` stays the last one.
        terminal = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.write(terminal, f"{line}\n".encode())
        self._stop.set()
        self._publish("failed", line)  # the peers stop too (only the first failure counts)
        self._publish("left", "1")
        if self.count > 1 and self.is_main:
            deadline = time.monotonic() + LEAVE_WAIT_S
            while time.monotonic() < deadline:
                try:
                    keys = dict(self._client.key_value_dir_get(f"{KEY}/"))
                except Exception:  # noqa: BLE001
                    break
                others = [
                    i for i in range(1, self.count) if i != dead and f"{KEY}/left/{i}" not in keys
                ]
                gone = [i for i in others if f"{KEY}/done/{i}" in keys]
                if len(others) == len(gone):  # the rest finished (or is dead: then we time out)
                    break
                time.sleep(0.2)
        os._exit(1)

    def _publish(self, what: str, value: str) -> None:
        if self.count == 1:
            return
        try:
            self._client.key_value_set(f"{KEY}/{what}/{self.index}", value, False)
        except Exception:  # noqa: BLE001, S110  (set already, or the coordinator is gone)
            pass


def first_line(err: BaseException) -> str:
    """The error's type and the first line of its message."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def exit_with(processes: Processes, job: str, err: BaseException) -> None:
    """Ends the run on an expected error: one line naming the process, the peers told, exit 1."""
    processes.die(f"{processes.error_prefix(job)}: {err}")


# What a collective says when a peer's connection broke (gloo on CPU, NCCL on GPUs).
_PEER_LOST = re.compile(r"gloo|nccl|connection|unavailable|socket", re.IGNORECASE)


def end_unexpected(processes: Processes, job: str, err: BaseException) -> None:
    """Ends the run on an unexpected error. Alone, the error is raised. With several processes
    the error is not raised (the interpreter's exit would meet the runtime's shutdown barrier,
    where the runtime aborts the process with a native stack dump): a collective that failed
    because a peer died (the peer's socket closed under it) waits for the liveness thread's
    verdict, which names the missing process; any other error prints its traceback (each line
    naming this process) and ends every process with its first line."""
    if processes.count == 1:
        processes.fail(f"{type(err).__name__}: {err}")
        raise err
    if isinstance(err, jax.errors.JaxRuntimeError) and _PEER_LOST.search(str(err)):
        processes.await_verdict()  # exits the process when the watchdog names the peer
    prefix = processes.error_prefix(job)
    for line in "".join(traceback.format_exception(err)).rstrip().splitlines():
        print(f"{prefix}: {line}", file=sys.stderr)
    processes.die(f"{prefix}: {first_line(err)}")

"""Starting the processes of one training job on `jax.distributed`: the process flags, the checks
before the runtime starts, and joining.

`start` joins the job named by `--coordinator_address`, `--num_processes` and `--process_id`, or,
when those are unset and the environment describes a cluster (SLURM, Open MPI, ... as
`jax.distributed.initialize()` detects them), the job the environment describes. On CPU each
process gets `--cpu_devices` fake devices (default 8 / processes when whole), collectives over
gloo. The global device list is ordered by process, so a mesh's first axis of size `processes`
(e.g. "node" in `--mesh=node=2,local=4`) is the process.

The runtime ends a process it cannot start with a native abort (a stack dump, no word of the
address), and a coordinator port that another program holds can crash process 0. So before it
starts, process 0 checks that its port is free and the others wait (at most `--init_timeout_s`)
until something answers at the coordinator's address; while the runtime assembles the job, a
watchdog ends the process with one line naming the address before the runtime's own timeout
aborts it (`_Assembly`). Each failure is one `FlagError` line naming the address.
"""

from __future__ import annotations

import dataclasses
import errno
import logging as py_logging
import os
import socket
import sys
import threading
import time
import warnings
from numbers import Integral

import jax
from absl import flags, logging

from examples.job_runtime import flag_fields, jax_private
from examples.job_runtime.errors import FlagError
from examples.job_runtime.flag_fields import setting
from examples.job_runtime.processes import Processes, first_line

DEFAULT_CPU_DEVICES = 8  # fake CPU devices of the whole job (8 / processes each)
SHUTDOWN_TIMEOUT_S = 30  # how long a finished process waits for the others at exit
RUNTIME_HEARTBEAT_FACTOR = 3  # the runtime's heartbeat timeout: 3 x ours + 10 s (`start`)
RUNTIME_INIT_MARGIN_S = 15  # the runtime's start-up timeout: ours + this (our line comes first)
PROBE_EVERY_S = 0.5  # how often a process knocks at the coordinator's address


@dataclasses.dataclass(frozen=True)
class ProcessConfig:
    """The process flags (as one value tests can build directly), each field with its default
    and its help, its flag's --help (`flag_fields.setting`). `cpu_devices` is ignored on GPUs
    (unset, and 8 / processes not whole: JAX's default); `stop_timeout_s`: `preemption.py`."""

    coordinator_address: str | None = setting(
        None,
        "host:port of process 0 when running several processes (unset: one process, or the "
        "cluster the environment describes: SLURM, Open MPI, ...)",
    )
    num_processes: int | None = setting(None, "processes of the job (with --coordinator_address)")
    process_id: int | None = setting(None, "this process's index, 0 .. num_processes - 1")
    cpu_devices: int | None = setting(
        None, "fake CPU devices per process (default 8 / processes when whole)"
    )
    heartbeat_timeout_s: int = setting(
        30, "a process exits when another has shown no sign of life for this long"
    )
    init_timeout_s: int = setting(
        120,
        "at start-up, a process exits (naming the coordinator's address) when the coordinator "
        "or the job's other processes have not come within this many seconds",
    )
    stop_timeout_s: int = setting(
        120,
        "after SIGTERM (a scheduler's preemption) the job finishes its step, commits a "
        "checkpoint and exits; it exits anyway after this many seconds",
    )

    def check(self) -> None:
        """FlagError naming the first process flag that cannot be used."""
        given = [
            n
            for n in ("coordinator_address", "num_processes", "process_id")
            if getattr(self, n) is not None
        ]
        if given and len(given) < 3:
            missing = sorted({"coordinator_address", "num_processes", "process_id"} - set(given))
            raise FlagError(
                f"--{given[0]}={getattr(self, given[0])} needs --{' and --'.join(missing)} too "
                "(or none of them, to run one process or the cluster the environment describes)"
            )
        for name, low in (
            ("num_processes", 1),
            ("process_id", 0),
            ("cpu_devices", 1),
            ("heartbeat_timeout_s", 2),
            ("init_timeout_s", 1),
            ("stop_timeout_s", 1),
        ):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, Integral) or isinstance(value, bool) or value < low
            ):
                raise FlagError(f"--{name}={value!r} must be an integer >= {low}")
        if given and self.process_id >= self.num_processes:
            raise FlagError(
                f"--process_id={self.process_id} must be below --num_processes={self.num_processes}"
            )
        address = self.coordinator_address
        if address is not None:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise FlagError(f"--coordinator_address={address} must look like 'host:port'")


def define_flags() -> None:
    """The process flags (only when a command runs)."""
    flag_fields.define_flags(ProcessConfig())


def config_from_flags() -> ProcessConfig:
    return ProcessConfig(**flag_fields.parsed_values(ProcessConfig()))


# The process flags every process must share (all but --process_id).
SHARED_FLAGS = tuple(f.name for f in dataclasses.fields(ProcessConfig) if f.name != "process_id")


def command_line_values(names) -> dict:
    """The parsed command-line values of `names` (those defined), for
    `Processes.agree_on_flags`."""
    return {n: flags.FLAGS[n].value for n in names if n in flags.FLAGS}


_current: Processes | None = None  # this process's job, once `start` joined it


def current() -> Processes:
    """The job `start` joined (one process alone when it was not called): what `train` and the
    examples use unless given another."""
    return _current or Processes()


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def check_port_free(address: str) -> None:
    """FlagError when another program listens on the coordinator's port on this host. Bound as
    the coordinator binds it (every interface), with SO_REUSEADDR (a closing connection of an
    earlier run does not count) but without SO_REUSEPORT: gRPC sets it, so a second coordinator
    would share the port with the first instead of failing."""
    _, port = _split(address)
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):  # noqa: S104
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 here
            continue
        with s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # IPv4 too
            try:
                s.bind((host, port))
            except OSError as err:
                if err.errno == errno.EADDRINUSE:
                    raise FlagError(
                        f"--coordinator_address={address}: port {port} is already in use on "
                        "this host (another job's coordinator?); start the job on a free port"
                    ) from None
                continue  # e.g. the address family is not configured
            return


def wait_for_coordinator(address: str, process_id: int, timeout_s: float) -> None:
    """Returns once something accepts connections at `address`; FlagError naming it when
    nothing did within `timeout_s`."""
    host, port = _split(address)
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(PROBE_EVERY_S, 1.0)):
                return
        except OSError as err:
            last = err
        if time.monotonic() >= deadline:
            raise FlagError(
                f"cannot join the job at {address} as process {process_id}: no coordinator "
                f"answered there within {timeout_s:g} s ({last.strerror or last}); is process 0 "
                "running, with this --coordinator_address? is the host reachable from here?"
            )
        time.sleep(PROBE_EVERY_S)


class _Assembly:
    """While the runtime assembles the job (every process registers with the coordinator), ends
    this process with one line naming the address when that takes longer than `timeout_s`: the
    runtime's own timeout, later, aborts with a native stack dump."""

    def __init__(self, line: str, timeout_s: float):
        self._line, self._timeout, self._done = line, timeout_s, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()

    def _watch(self):
        if not self._done.wait(self._timeout):
            sys.stdout.flush()
            os.write(2, f"{self._line}\n".encode())
            os._exit(1)


def start(pc: ProcessConfig, job: str) -> Processes:
    """Joins the job `pc` (or the environment) describes, or runs alone; the result is also
    `current()`. Call before anything touches a jax backend. FlagError naming a process flag
    that cannot be used, or the coordinator's address when the job cannot be joined. `job`: the
    job's name, which starts the line of a start-up that timed out."""
    global _current
    pc.check()
    detected = None
    if pc.num_processes is None:
        try:
            detected = jax_private.detected_cluster()
        except Exception as err:  # noqa: BLE001  (a cluster module's own error)
            raise FlagError(
                f"cannot read the cluster environment: {first_line(err)}; give "
                "--coordinator_address, --num_processes and --process_id"
            ) from None
    count = pc.num_processes or (detected[1] if detected else 1)
    devices = pc.cpu_devices
    if devices is None and DEFAULT_CPU_DEVICES % count == 0:
        devices = DEFAULT_CPU_DEVICES // count
    # Fake CPU devices when there is no GPU; must precede any backend use (ignored on GPUs).
    # Otherwise (a count that does not divide 8) JAX's default: the mesh check names the gap.
    if devices is not None:
        jax.config.update("jax_num_cpu_devices", devices)
    if pc.coordinator_address is None and detected is None:
        _current = Processes()
        return _current
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    address, index = pc.coordinator_address, pc.process_id
    if detected is not None:
        address, index = jax_private.detected_coordinator(pc.init_timeout_s) or (None, None)
    where = address or f"the {detected[0]} environment"
    me = "" if index is None else f" as process {index}"
    if address is not None and index == 0:
        check_port_free(address)
    elif address is not None:
        wait_for_coordinator(address, index, pc.init_timeout_s)
    line = (
        f"{job}{'' if index is None else f' (process {index} of {count})'}: cannot join the "
        f"job at {where}{me}: its {count} processes did not all come within "
        f"{pc.init_timeout_s} s (is every process started, with the same "
        "--coordinator_address and --num_processes?)"
    )
    try:
        with _Assembly(line, pc.init_timeout_s):
            jax.distributed.initialize(
                pc.coordinator_address,
                num_processes=pc.num_processes,
                process_id=pc.process_id,
                initialization_timeout=pc.init_timeout_s + RUNTIME_INIT_MARGIN_S,
                # The runtime's own check is the fallback: the watchdog (`Processes.watch`) names
                # the missing process first. The runtime counts from the peer's last heartbeat,
                # not its death: at twice ours (20 s) it once aborted a process 10.9 s after a
                # kill, before our 10 s watchdog spoke.
                heartbeat_timeout_seconds=RUNTIME_HEARTBEAT_FACTOR * pc.heartbeat_timeout_s + 10,
                shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S,
            )
    except Exception as err:  # the runtime raises its own types
        raise FlagError(f"cannot join the job at {where}{me}: {first_line(err)}") from None
    _quiet_native_stdout()
    processes = Processes(
        jax.process_index(),
        jax.process_count(),
        jax_private.distributed_client(),
        pc.heartbeat_timeout_s,
    )
    if not processes.is_main:  # the others print nothing but errors
        logging.set_verbosity(logging.ERROR)
        py_logging.getLogger("jax").setLevel(py_logging.ERROR)
        warnings.simplefilter("ignore")
    _current = processes
    return processes


def _quiet_native_stdout() -> None:
    """Python keeps the terminal; native code's stdout (gloo prints a line per connection it
    opens, on every process) goes to /dev/null. Errors go to stderr, untouched."""
    sys.stdout.flush()
    terminal = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    sys.stdout = os.fdopen(terminal, "w", buffering=1)


def global_devices():
    """Every device of the job, ordered by process, then id (a mesh's first axis of size
    `processes` is then the process)."""
    return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))

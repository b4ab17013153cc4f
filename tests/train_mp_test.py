"""The main job (`python -m examples.train_moe`) as 2 processes x 4 CPU devices on jax.distributed
(gloo), against the same flags in 1 process x 8 devices, a killed process, a resume, and the
local launcher.

The runs are shared, for CI's time:
* `ffi_chain`: 2 processes (`--mesh=node=2,local=4`, expert re-balancing every 10 steps, a
  checkpoint every 10) under a 30-step schedule; process 1 is SIGKILLed once a checkpoint is
  committed, and process 0 must exit non-zero within 90 s naming process 1. Then
  `scripts/launch_local.sh 2 ... --resume --steps=30` continues from the last committed
  checkpoint. Its metrics.json (the killed run's steps up to its checkpoint, then the resumed
  run's) gives every step's loss against the 1 x 8 run, the rows each process read, the
  re-balancing decisions, and process 1's log shows that it printed nothing.
* `xla_run`: `launch_local.sh 2 --backend=xla`, re-planning at step 10 under a bandwidth drop.
* A job started under a (fake) SLURM environment, JAX's auto-detection joining it, with another
  --seed on process 1 (the main job; the cross-DC job: another --steps): both processes refuse
  before training.
* The launcher with a stand-in module (no jax): the first non-zero status ends the others.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from mp_launch import worker_env
from rich.console import Console
from train_harness import CROSS_DC, ROOT, TRAIN_MOE, config, replace, train_moe

from examples.job_runtime.processes import Processes, end_unexpected

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

LAUNCH = os.path.join(ROOT, "scripts", "launch_local.sh")
STEPS = 30
KILL_LIMIT_S = 90
RTOL, EVAL_TOL = 1e-5, 1e-4
# The model and run both sides train (the command line's defaults otherwise: 4 eval batches).
FLAGS = dict(
    batch=8,
    seq_len=32,
    d_model=32,
    d_ff=32,
    layers=1,
    heads=2,
    mesh="node=2,local=4",
    eval_every=10,
    heartbeat_timeout_s=10,
)
FFI = dict(FLAGS, backend="ffi", redundant_slots=1, rebalance_every=10)
XLA = dict(
    FLAGS,
    backend="xla",
    replan_every=10,
    links="node=100:0.1,local=100:0.1",
    link_schedule="10:node=0.01",
)


def _argv(flags: dict) -> list[str]:
    return [f"--{k}={v}" for k, v in flags.items()]


def _env(**extra) -> dict[str, str]:
    return dict(worker_env(), PYTHON=sys.executable, **extra)


def _one_process(flags: dict, out) -> dict:
    """The 1 process x 8 devices run of `flags` (in this process, the first 8 devices)."""
    names = config.flag_values(train_moe.TrainConfig())  # the main job's (not the process's)
    cfg = replace(
        train_moe.TrainConfig(),
        **{k: v for k, v in flags.items() if k in names},
        steps=STEPS,
        output_dir=str(out),
        progress=False,
    )
    return train_moe.train(cfg, Console(file=io.StringIO()))


def _start(flags: dict, out, port: int) -> list[subprocess.Popen]:
    """2 processes of the main job, each one's output in <out>/p<i>.log."""
    procs = []
    for i in range(2):
        log = open(os.path.join(out, f"p{i}.log"), "w")  # noqa: SIM115  (the child owns it)
        cmd = [
            *TRAIN_MOE,
            *_argv(flags),
            f"--output_dir={out}",
            f"--coordinator_address=127.0.0.1:{port}",
            "--num_processes=2",
            f"--process_id={i}",
        ]
        procs.append(
            subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=_env())
        )
        log.close()
    return procs


def _free_port(low: int = 0) -> int:
    for port in range(low, 65536) if low else [0]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free port")


def _read(path) -> str:
    with open(path) as f:
        return f.read()


def _launch_local(flags: dict, out, *extra) -> subprocess.CompletedProcess:
    cmd = ["bash", LAUNCH, "2", *_argv(flags), f"--output_dir={out}", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)


@pytest.fixture(scope="module")
def ffi_chain(tmp_path_factory):
    out = tmp_path_factory.mktemp("ffi_chain")
    ckpt = os.path.join(out, "checkpoint")
    flags = dict(FFI, steps=1000, schedule_steps=STEPS, checkpoint_every=10)
    procs = _start(flags, out, _free_port())
    try:
        deadline = time.monotonic() + 400
        while not (os.path.isdir(ckpt) and any(n.isdigit() for n in os.listdir(ckpt))):
            assert procs[0].poll() is None and time.monotonic() < deadline, _read(out / "p0.log")
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        try:
            procs[0].wait(timeout=KILL_LIMIT_S + 30)
        except subprocess.TimeoutExpired:
            pass
        detection_s = time.monotonic() - killed_at
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    killed = dict(
        returncode=procs[0].returncode,
        seconds=detection_s,
        log=_read(out / "p0.log"),
        checkpoints=sorted(os.listdir(ckpt)),
    )
    t = time.monotonic()
    resumed = _launch_local(dict(FFI, steps=STEPS), out, "--resume")
    print(f"kill detected in {detection_s:.1f} s; resumed 2 x 4 run {time.monotonic() - t:.1f} s")
    assert resumed.returncode == 0, resumed.stderr[-3000:] + resumed.stdout[-3000:]
    with open(out / "metrics.json") as f:
        metrics = json.load(f)
    return dict(out=out, killed=killed, resumed=resumed, metrics=metrics)


@pytest.fixture(scope="module")
def xla_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("xla_run")
    t = time.monotonic()
    run = _launch_local(dict(XLA, steps=STEPS), out)
    print(f"2 x 4 xla run {time.monotonic() - t:.1f} s")
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    with open(out / "metrics.json") as f:
        return json.load(f)


def _compare(two: dict, one: dict, name: str) -> None:
    """Every step's loss to RTOL, evals to EVAL_TOL; prints whether they are bitwise equal."""
    assert [r["step"] for r in two["train"]] == list(range(STEPS))
    a = np.array([r["loss"] for r in two["train"]])
    b = np.array([r["loss"] for r in one["train"]])
    np.testing.assert_allclose(a, b, rtol=RTOL)
    assert [r["step"] for r in two["eval"]] == [r["step"] for r in one["eval"]]
    np.testing.assert_allclose(
        [r["loss"] for r in two["eval"]], [r["loss"] for r in one["eval"]], rtol=EVAL_TOL
    )
    assert [r["dropped"] for r in two["train"]] == [r["dropped"] for r in one["train"]]
    assert [r["level_rows"] for r in two["train"]] == [r["level_rows"] for r in one["train"]]
    first = int(np.argmax(a != b)) if (a != b).any() else None
    print(
        f"{name}: 2 x 4 vs 1 x 8 over {STEPS} steps: max relative difference "
        f"{float(np.max(np.abs(a - b) / np.abs(b))):.2e}, bitwise equal: {first is None}"
        f"{'' if first is None else f' (first difference at step {first})'}; final eval "
        f"{two['final_eval_loss']:.6f} vs {one['final_eval_loss']:.6f}"
    )


def test_a_killed_process_ends_the_other_naming_it(ffi_chain):
    killed = ffi_chain["killed"]
    assert killed["returncode"] not in (0, None), killed["log"][-3000:]
    assert killed["seconds"] < KILL_LIMIT_S, killed
    last = killed["log"].strip().splitlines()[-1]
    assert last.startswith("train_moe (process 0 of 2): process 1 is gone: no sign of life"), last
    assert any(n.isdigit() for n in killed["checkpoints"]), killed["checkpoints"]


def test_two_processes_train_like_one_and_resume_after_the_kill(ffi_chain, tmp_path):
    metrics = ffi_chain["metrics"]
    start = metrics["start_step"]
    assert start in (10, 20), start  # the last checkpoint the killed run committed
    assert f"resumed from step {start}" in ffi_chain["resumed"].stdout
    assert metrics["processes"] == 2
    one = _one_process(FFI, tmp_path)
    _compare(metrics, one, "ffi, re-balancing, killed and resumed")
    # The same re-balancing decisions, held alike by both processes after each one.
    keys = ("step", "layer", "changed", "moved_experts")
    assert [[e[k] for k in keys] for e in metrics["rebalances"]] == [
        [e[k] for k in keys] for e in one["rebalances"]
    ]
    assert any(e["changed"] for e in metrics["rebalances"])
    for event in metrics["rebalances"]:
        digests = event["placement_digests"]
        assert len(digests) == 2 and digests[0] == digests[1], event


def test_each_process_read_only_its_own_rows(ffi_chain):
    feeding = ffi_chain["metrics"]["feeding"]
    # node=2,local=4 shards the 8 sequences over the 8 devices, process-major: 4 rows each.
    assert feeding["rows"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    steps = STEPS - ffi_chain["metrics"]["start_step"]
    eval_windows = 4 * 4  # 4 eval batches, 4 rows each
    assert feeding["windows_read"] == [steps * 4 + eval_windows] * 2


def test_only_process_0_prints(ffi_chain):
    logs = os.path.join(ffi_chain["out"], "logs")
    assert _read(os.path.join(logs, "process_1.log")) == ""
    text = _read(os.path.join(logs, "process_0.log"))
    assert text.strip().splitlines()[-1].startswith("eval loss: ")
    assert ffi_chain["resumed"].stdout.strip().splitlines()[-1].startswith("eval loss: ")


def test_another_process_count_is_refused_on_resume(ffi_chain, tmp_path, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was built before the checkpoint was refused")

    monkeypatch.setattr(train_moe, "MoETransformer", no_model)
    out = tmp_path / "copy"
    shutil.copytree(ffi_chain["out"], out)
    names = config.flag_values(train_moe.TrainConfig())
    cfg = replace(
        train_moe.TrainConfig(),
        **{k: v for k, v in FFI.items() if k in names},
        steps=40,
        resume=True,
        output_dir=str(out),
        progress=False,
    )
    step_dir = os.path.join(out, "checkpoint", str(STEPS))
    with pytest.raises(train_moe.ResumeError) as err:
        train_moe.train(cfg, Console(file=io.StringIO()))
    assert str(err.value).startswith(
        f"--resume: the checkpoint {step_dir} was written by 2 processes on "
        "--mesh=node=2,local=4; this run has 1 process on --mesh=node=2,local=4: resume with 2 "
        "processes"
    )


def test_xla_with_replanning_across_processes_trains_like_one_process(xla_run, tmp_path):
    one = _one_process(XLA, tmp_path)
    _compare(xla_run, one, "xla, re-planning")
    replans = xla_run["replans"]
    assert [(r["step"], r["changed"]) for r in replans] == [(10, True), (20, False), (30, False)]
    assert [r["layer_domains"] for r in replans] == [r["layer_domains"] for r in one["replans"]]
    for r in replans:  # process 0's decision, run by both
        assert r["domains_per_process"] == [r["layer_domains"]] * 2, r
    assert xla_run["compiles"] == 2


@pytest.mark.parametrize(
    "job,command,flags,flag",
    [("train_moe", TRAIN_MOE, _argv(FLAGS), "seed"), ("cross_dc", CROSS_DC, [], "steps")],
)
def test_mismatched_flags_are_refused_under_an_auto_detected_cluster(
    tmp_path, job, command, flags, flag
):
    # JAX derives the coordinator's port from the job id: 61440 + id % 4096.
    port = _free_port(61440)
    procs = []
    for i in range(2):
        slurm = dict(
            SLURM_JOB_ID=str(port - 61440),
            SLURM_STEP_NODELIST="127.0.0.1",
            SLURM_NTASKS="2",
            SLURM_PROCID=str(i),
            SLURM_LOCALID=str(i),
        )
        cmd = [
            *command,
            *flags,
            f"--{flag}={i + 1}",
            f"--output_dir={tmp_path}",
        ]
        procs.append(
            subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=ROOT,
                env=_env(**slurm),
            )
        )
    outputs = [p.communicate(timeout=240) for p in procs]
    for i, (p, (stdout, stderr)) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 1, stderr[-3000:]
        assert stdout == ""
        assert stderr.strip().splitlines()[-1] == (
            f"{job} (process {i} of 2): --{flag} differs between processes: process 0 has "
            f"1, process 1 has 2; start every process with the same flags"
        )
    assert os.listdir(tmp_path) == []  # refused before anything was written


def test_launcher_stops_the_others_at_the_first_failure(tmp_path):
    t = time.monotonic()
    run = subprocess.run(
        ["bash", LAUNCH, "3", "--steps=5", f"--output_dir={tmp_path}"],
        capture_output=True,
        text=True,
        env=_env(MODULE="launch_probe", PYTHONPATH=os.path.dirname(__file__)),
        timeout=60,
    )
    assert run.returncode == 3, run.stderr
    assert time.monotonic() - t < 30  # not the 120 s the others sleep
    assert "launch_local.sh: process 1 exited with status 3; stopped the others" in run.stderr
    seen = [json.loads(_read(tmp_path / f"probe_{i}.json")) for i in range(3)]
    ports = {s["flags"]["coordinator_address"] for s in seen}
    assert len(ports) == 1 and ports.pop().startswith("127.0.0.1:")
    assert [s["flags"]["process_id"] for s in seen] == ["0", "1", "2"]
    assert all(s["flags"]["num_processes"] == "3" and s["flags"]["steps"] == "5" for s in seen)
    for s in seen:  # every process is gone
        with pytest.raises(ProcessLookupError):
            os.kill(s["pid"], 0)
    assert sorted(os.listdir(tmp_path / "logs")) == [f"process_{i}.log" for i in range(3)]


def _recording_processes(count: int):
    """A Processes of `count` whose exits are recorded instead of taken."""

    class Recording(Processes):
        def __init__(self):
            super().__init__(0, count)
            self.calls = []

        def await_verdict(self):
            self.calls.append("await_verdict")

        def die(self, line, dead=None):
            self.calls.append(("die", line))
            raise SystemExit(1)

        def fail(self, message):
            self.calls.append(("fail", message))

    return Recording()


@pytest.mark.parametrize(
    "count, message, first_call",
    [
        (2, "UNKNOWN: Gloo AllGather failed: Connection reset by peer", "await_verdict"),
        (
            2,
            "INTERNAL: strict mode: 3 rows dropped",
            (
                "die",
                "train_moe (process 0 of 2): "
                "JaxRuntimeError: INTERNAL: strict mode: 3 "
                "rows dropped",
            ),
        ),
        (
            1,
            "UNKNOWN: Gloo AllGather failed",
            ("fail", "JaxRuntimeError: UNKNOWN: Gloo AllGather failed"),
        ),
    ],
)
def test_a_collective_broken_by_a_dead_peer_waits_for_the_watchdog(count, message, first_call):
    """A collective that failed because a peer's connection broke waits for the liveness
    thread's verdict (which names the peer) rather than raising into the runtime's abort at
    exit; any other runtime error ends the run at once with its first line; alone, it raises."""
    import jax

    processes = _recording_processes(count)
    err = jax.errors.JaxRuntimeError(message)
    with pytest.raises((SystemExit, jax.errors.JaxRuntimeError)):
        end_unexpected(processes, "train_moe", err)
    assert processes.calls[0] == first_call
    if first_call == "await_verdict":  # no verdict came: the error's own line ends the run
        assert processes.calls[1][0] == "die" and "Gloo AllGather failed" in processes.calls[1][1]

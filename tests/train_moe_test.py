"""The main job (`python -m examples.train_moe`) end to end at tiny sizes (in-process, first 8
devices).

Covers: a short run writes its plot, checkpoint, metrics and `eval loss:` line with finite losses;
`resume` restores that checkpoint exactly and continues from its step (on another backend, with
another eval cadence: flags that may change), also after a process died while committing a newer
one; training gives the same losses bit for bit with the `xla` and `ffi` dispatch backends
(docs/design.md §2.1.4), drops included; `--replan_every` recompiles on new domains when the link
schedule drops the bandwidth, and only then; every bad flag (an output directory that cannot be
created or written included) fails before a model is built with a message naming it; `--resume`
refuses, before a model is built, a checkpoint written with another value of a flag that shapes
the model, its routing, data or optimizer (naming the flag and both values), and from a missing,
emptied, corrupt or incompatible checkpoint (or metrics file) names the directory and the
problem; the command line ends such errors with one line and nothing after it; `--steps=0`
names only the files it wrote. Multi-process runs: tests/train_mp_test.py.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from rich.console import Console
from train_harness import (
    ROOT,
    TINY,
    TRAIN_MOE,
    checkpoint,
    config,
    job_flags,
    python_path_env,
    replace,
    train_moe,
)
from train_harness import train as _train

from examples.job_runtime import flag_fields
from jax_hybridep import traffic, xdc
from jax_hybridep.xdc.runtime import migrate
from jax_hybridep.xdc.runtime.domains import INNER_SUFFIX

pytestmark = pytest.mark.usefixtures("no_backend_override")


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    cfg = replace(TINY, output_dir=str(tmp_path_factory.mktemp("train_moe")))
    metrics, text = _train(cfg)
    # A copy as the run left it, for the tests that break it (the resume test extends the run).
    shutil.copytree(cfg.output_dir, cfg.output_dir + "_pristine")
    return cfg, metrics, text


def _copy_of_first_run(first_run, tmp_path, **changes):
    cfg = first_run[0]
    out = tmp_path / "run"
    shutil.copytree(cfg.output_dir + "_pristine", out)
    return replace(cfg, output_dir=str(out), **changes)


def test_short_run_writes_its_outputs(first_run):
    cfg, metrics, text = first_run
    assert text.strip().splitlines()[-1] == f"eval loss: {metrics['final_eval_loss']:.4f}"
    assert "backend: ffi" in text  # auto picks the FFI custom calls on CPU
    assert [r["step"] for r in metrics["train"]] == [0, 1, 2]
    assert [r["step"] for r in metrics["eval"]] == [0, 2, 3]
    losses = [r["loss"] for r in metrics["train"]] + [r["loss"] for r in metrics["eval"]]
    assert all(math.isfinite(v) for v in losses)
    assert len(metrics["tokens_per_expert"]) == cfg.model.layers
    # Top-2 over 8 experts: every token lands twice, none dropped (dropless by default).
    assert sum(metrics["tokens_per_expert"][0]) == cfg.batch * cfg.seq_len * cfg.model.top_k
    assert all(r["dropped"] == 0 for r in metrics["train"])
    with open(os.path.join(cfg.output_dir, "train_moe.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(os.path.join(cfg.output_dir, "metrics.json")) as f:
        assert json.load(f)["final_eval_loss"] == metrics["final_eval_loss"]
    assert os.listdir(os.path.join(cfg.output_dir, "checkpoint")) == ["3"]


# Saves step 5 with the main job's own save, in a process that dies just before the rename that
# would commit it.
CRASH_AT_COMMIT = """
import os
import numpy as np
from examples.train_moe import checkpoint
rename = os.rename
def crash(src, dst, *args, **kwargs):
    if os.path.basename(os.fspath(dst)) == "5":
        os._exit(17)
    return rename(src, dst, *args, **kwargs)
os.rename = crash
checkpoint.save({ckpt!r}, 5, dict(w=np.ones(3, np.float32)), dict(steps=5))
"""


def test_resume_continues_from_the_saved_step_after_a_crashed_save(first_run):
    cfg, first, _ = first_run
    # Flags that may change on resume: the steps, the backend (bitwise alike), the eval cadence.
    cfg = replace(cfg, steps=5, resume=True, backend="xla", eval_every=1)
    ckpt = os.path.join(cfg.output_dir, "checkpoint")
    code = CRASH_AT_COMMIT.format(ckpt=ckpt)
    env = python_path_env(JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 17, proc.stderr  # it died at the commit, as arranged
    entries = sorted(os.listdir(ckpt))
    assert entries[0] == "3" and len(entries) == 2, entries  # step 3 and the unfinished save

    metrics, text = _train(cfg)  # the previous checkpoint stands: resumed from step 3
    assert "resumed from step 3" in text
    assert metrics["backend"].startswith("xla")
    assert metrics["start_step"] == 3
    assert [r["step"] for r in metrics["train"]] == [0, 1, 2, 3, 4]
    assert metrics["train"][:3] == first["train"]  # the first run's history is kept
    # The restored state is evaluated again at step 3: an exact restore gives the same loss.
    restored_eval = [r["loss"] for r in metrics["eval"] if r["step"] == 3]
    assert restored_eval == [first["final_eval_loss"]]
    assert [r["step"] for r in metrics["eval"]] == [0, 2, 3, 4, 5]
    assert os.listdir(ckpt) == ["5"]  # committed; step 3 and the crashed save's leftovers gone


def test_xla_and_ffi_backends_train_identically(tmp_path):
    # A capacity that drops rows and a data axis beside EP exercise drops and EP groups too.
    runs = {}
    for backend in ("xla", "ffi"):
        cfg = replace(
            TINY,
            steps=20,
            eval_every=10,
            mesh="data=2,ep=4",
            capacity_factor=1.0,
            backend=backend,
            output_dir=str(tmp_path / backend),
        )
        runs[backend], _ = _train(cfg)
    assert runs["xla"]["backend"].startswith("xla")
    assert runs["ffi"]["backend"].startswith("ffi")
    xla, ffi = ([(r["loss"], r["dropped"]) for r in runs[b]["train"]] for b in ("xla", "ffi"))
    assert sum(d for _, d in xla) > 0  # the comparison covers dropped rows
    assert xla == ffi  # bitwise: both backends sum each token's rows in the same order
    assert runs["xla"]["eval"] == runs["ffi"]["eval"]


def test_expert_domains_train_like_plain_ep_and_move_experts_instead_of_tokens(tmp_path):
    """--domains=dc=2 (cross-DC EP): the same losses as plain EP (values and gradients are
    exact), no token all-to-all across the DC level, and the experts' all-gather and gradient
    reduce-scatter across it; with SR compression the gather shrinks by the ratio."""
    runs = {}
    for name, domains, ratio in (
        ("plain", (), None),
        ("dc", {"dc": 2}, None),
        ("sr", {"dc": 2}, 8.0),
    ):
        cfg = replace(
            TINY,
            steps=4,
            mesh="dc=2,node=2,local=2",
            backend="xla",
            migration=xdc.Migration(domains, ratio),
            output_dir=str(tmp_path / name),
        )
        runs[name], _ = _train(cfg)
    plain, dc, sr = (runs[n] for n in ("plain", "dc", "sr"))
    for a, b in zip(plain["train"], dc["train"], strict=True):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5)
    assert plain["program_traffic"]["dc"]["all-to-all"] > 0
    assert dc["program_traffic"]["dc"]["all-to-all"] == 0
    # One expert per rank (8 experts, 8 ranks), three 32x32 float32 matrices, one layer.
    expert = 3 * 32 * 32 * 4
    assert dc["program_traffic"]["dc"]["all-gather"] == expert
    assert dc["program_traffic"]["dc"]["reduce-scatter"] == expert
    k = math.floor(32 * 32 * 4 / (8.0 * 8))  # SR: k values + k int32 indices per matrix
    assert sr["program_traffic"]["dc"]["all-gather"] == 3 * k * 8
    # The persistent shared expert's refresh all-reduces one expert over the 8 ranks (2 * 4 / 8
    # of it from the other DC); the block's other all-reduce across the pair is its router
    # gate's gradient (32 x 8 float32, summed over the 8 ranks: 2 * 4 / 8 of it too).
    assert sr["program_traffic"]["dc"]["all-reduce"] == 3 * 32 * 32 * 4 + 32 * 8 * 4
    assert all(math.isfinite(r["loss"]) for r in sr["train"])


M = xdc.Migration


def _no_model(*args, **kwargs):
    raise AssertionError("a model was built before the flags were checked")


def test_replan_every_switches_domains_when_the_link_schedule_drops_the_bandwidth(tmp_path):
    # At 100 Gbps with 0.1 ms per message, replicating experts over domains of 4 beats 4 token
    # exchanges (the plan at step 0); at 0.01 Gbps moving the experts costs more: fewer replicas.
    cfg = replace(
        TINY,
        steps=4,
        replan_every=2,
        links="ep=100:0.1",
        link_schedule="2:ep=0.01",
        output_dir=str(tmp_path),
    )
    hlo = []
    metrics = train_moe.train(cfg, Console(file=io.StringIO()), on_compile=hlo.append)
    replans = metrics["replans"]
    assert [(r["step"], r["changed"]) for r in replans] == [(2, True), (4, False)]
    assert replans[0]["gbps"] == {"ep": 0.01}
    (new,) = replans[0]["layer_domains"]
    assert new[0] < 4 and replans[1]["layer_domains"] == [new]
    assert len(hlo) == 2  # one more compile, for the one change
    # What each compiled step all-gathers: the S - 1 other replicas of a rank's one expert.
    expert = 3 * 32 * 32 * 4
    axes = {"ep", "ep" + INNER_SUFFIX}
    gathered = [
        traffic.crossing_bytes(h, axes, op_name=migrate.GATHER_SCOPE)["all-gather"] for h in hlo
    ]
    assert gathered == [3 * expert, (new[0] - 1) * expert]
    assert all(math.isfinite(r["loss"]) for r in metrics["train"])


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(mesh="ep=3"), r"--experts=8 is not divisible by the EP size 3 of --mesh=ep=3"),
        (dict(mesh="ep=32"), r"--mesh=ep=32 needs 32 devices, have 16"),
        (dict(mesh="ep"), r"--mesh must look like 'ep=8'"),
        (dict(mesh="ep=0"), r"--mesh=ep=0 needs a name and a size >= 1 for every axis"),
        (dict(mesh="ep=2,ep=4"), r"--mesh=ep=2,ep=4 names an axis twice"),
        (dict(mesh="data=8"), r"--mesh=data=8 has no EP axis"),
        (
            dict(capacity_factor=0.0),
            r"--capacity_factor=0.0 must be a finite number > 0, or .none.",
        ),
        (dict(capacity_factor=-1.0), r"--capacity_factor=-1.0 must be a finite number > 0"),
        (dict(capacity_factor=math.inf), r"--capacity_factor=inf must be a finite number > 0"),
        (dict(top_k=9), r"--top_k=9 exceeds --experts=8"),
        (dict(heads=3), r"--d_model=32 must split into --heads=3 heads of even size"),
        (dict(batch=0), r"--batch=0 must be an integer >= 1"),
        (dict(steps=-1), r"--steps=-1 must be an integer >= 0"),
        (dict(seed=-1), r"--seed=-1 must be an integer >= 0"),
        (dict(eval_every=0), r"--eval_every=0 must be an integer >= 1"),
        (dict(d_model=2.5), r"--d_model=2.5 must be an integer >= 1"),
        (dict(lr=math.nan), r"--lr=nan must be a finite number > 0"),
        (dict(backend="gpu"), r"--backend='gpu' must be one of auto, xla, ffi"),
        (dict(batch=1, seq_len=31), r"--batch=1 x --seq_len=31 = 31 tokens per step do not split"),
        (dict(seq_len=10**9), r"--seq_len=1000000000 is too long for the \d+-byte training text"),
        (dict(eval_batches=10**6), r"--eval_batches=1000000 x --batch=8 = 8000000 held-out"),
        (dict(migration=M({"dc": 2})), r"--domains=dc=2 on --mesh=ep=8: domain sizes name"),
        (dict(migration=M({"ep": 3})), r"--domains=ep=3 on --mesh=ep=8: domain size 3 at level"),
        (dict(migration=M(compression=8.0)), r"--domain_compression=8.0 needs --domains"),
        (dict(migration=M(grad_compression=4.0)), r"--grad_compression=4.0 needs --domains or --"),
        (dict(memory_limit_mb=-1.0), r"--memory_limit_mb=-1.0 must be a finite number >= 0"),
        (dict(prefetch="yes"), r"--prefetch='yes' must be true or false"),
        (dict(links="ep=10"), r"--links=ep=10 is only used with --replan_every"),
        (dict(replan_every=-1), r"--replan_every=-1 must be an integer >= 0"),
        (dict(replan_every=2), r"--replan_every=2 needs --links"),
        (dict(replan_every=2, links="dc=10"), r"--links=dc=10: .* must name one of the levels"),
        (dict(replan_every=2, links="ep=10", link_schedule="2:dc=1"), r"--link_schedule=2:dc=1"),
        (dict(replan_every=2, links="ep=10", resume=True), r"cannot be combined with --resume"),
    ],
)
def test_bad_flags_fail_before_a_model_is_built(changes, message, tmp_path, monkeypatch):
    monkeypatch.setattr(train_moe, "MoETransformer", _no_model)
    cfg = replace(TINY, output_dir=str(tmp_path / "out"), **changes)
    with pytest.raises(train_moe.FlagError, match=message):
        train_moe.train(cfg)
    assert not os.path.exists(cfg.output_dir)  # nothing written either


@pytest.mark.parametrize(
    "flags,message",
    [
        (dict(domains="ep"), r"--domains=ep must look like 'dc=2'"),
        (dict(domains="ep=0"), r"--domains=ep=0: Migration.domains\['ep'\] must be an int >= 1"),
        (dict(domains="ep=2", domain_compression=0.5), r"--domain_compression=0.5 must be a"),
        (dict(domain_shared="median"), r"--domain_shared='median' must be one of persistent, "),
        (dict(domain_sync_every=0), r"--domain_sync_every=0 must be an integer >= 1"),
        (dict(domains="ep=2", grad_compression=1.0), r"--grad_compression=1.0 must be a finite"),
    ],
)
def test_bad_migration_flags_are_named_when_parsed(flags, message):
    with pytest.raises(train_moe.FlagError, match=message):
        config.parse_migration(**flags)


def test_migration_flags_parse_into_one_value_and_back():
    flags = dict(
        domains="dc=2,node=2",
        domain_compression=8.0,
        domain_shared="mean",
        domain_sync_every=3,
        grad_compression=4.0,
    )
    m = config.parse_migration(**flags)
    assert m == xdc.Migration((("dc", 2), ("node", 2)), 8.0, "mean", 3, 4.0)
    assert config.migration_flags(m) == flags
    assert config.parse_migration() == xdc.Migration()


@pytest.mark.parametrize(
    "where,message",
    [
        ("file", r"--output_dir=.*/file exists and is not a directory"),
        ("file/run", r"--output_dir=.*/file/run cannot be created: .*/file is not a directory"),
        ("/proc/hybridep_out/run", r"--output_dir=/proc/hybridep_out/run cannot be created in "),
    ],
)
def test_output_dir_that_cannot_be_written_is_a_flag_error(tmp_path, monkeypatch, where, message):
    monkeypatch.setattr(train_moe, "MoETransformer", _no_model)
    monkeypatch.setattr(train_moe.ByteData, "load", _no_model)  # checked before the data too
    (tmp_path / "file").write_text("")
    cfg = replace(TINY, output_dir=str(tmp_path / where))
    with pytest.raises(train_moe.FlagError, match=message):
        config.check_config(cfg, [], None)


def test_dropless_is_spelled_none():
    parse = config.parse_capacity_factor
    assert TINY.model.capacity_factor is None and config.TrainConfig().model.capacity_factor is None
    assert parse(None) is None and parse("none") is None and parse("None") is None
    assert parse("1.25") == 1.25
    with pytest.raises(train_moe.FlagError, match=r"--capacity_factor=x must be a number > 0"):
        parse("x")


def test_command_line_flag_error_is_one_line():
    """The issue's example: --mesh=ep=3 on 8 devices ends with the library-style message."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [*TRAIN_MOE, "--mesh=ep=3", "--output_dir=/nonexistent/never/made"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "train_moe: --experts=8 is not divisible by the EP size 3 of --mesh=ep=3 (EP axes "
        "('ep',): every axis but 'data'); each EP rank holds experts / EP of them"
    )


def test_resume_without_a_checkpoint_names_the_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(train_moe, "MoETransformer", _no_model)  # found on disk, first
    cfg = replace(TINY, output_dir=str(tmp_path / "never_ran"), resume=True)
    ckpt = os.path.join(cfg.output_dir, "checkpoint")
    with pytest.raises(train_moe.ResumeError, match=f"no checkpoint directory {ckpt} "):
        train_moe.train(cfg)


def test_resume_from_an_emptied_step_directory(first_run, tmp_path, monkeypatch):
    monkeypatch.setattr(train_moe, "MoETransformer", _no_model)  # found on disk, first
    cfg = _copy_of_first_run(first_run, tmp_path, resume=True, steps=5)
    step_dir = os.path.join(cfg.output_dir, "checkpoint", "3")
    shutil.rmtree(step_dir)
    os.mkdir(step_dir)
    with pytest.raises(train_moe.ResumeError, match=f"the checkpoint {step_dir} is empty"):
        train_moe.train(cfg)


def test_resume_from_a_corrupt_checkpoint(first_run, tmp_path):
    cfg = _copy_of_first_run(first_run, tmp_path, resume=True, steps=5)
    step_dir = os.path.join(cfg.output_dir, "checkpoint", "3")
    for root, _, files in os.walk(os.path.join(step_dir, "state")):
        for name in files:
            with open(os.path.join(root, name), "wb") as f:
                f.write(b"\x00garbage")
    with pytest.raises(train_moe.ResumeError, match=f"the checkpoint {step_dir} is corrupt"):
        train_moe.train(cfg)


@pytest.mark.parametrize(
    "changes,flag,theirs,ours",
    [
        (dict(heads=4), "heads", "2", "4"),
        (dict(top_k=1), "top_k", "2", "1"),
        (dict(d_model=64), "d_model", "32", "64"),
        (dict(capacity_factor=1.0), "capacity_factor", "(unset)", "1.0"),
        (dict(wire_dtype="float8_e4m3fn"), "wire_dtype", "(unset)", "float8_e4m3fn"),
        (dict(redundant_slots=1), "redundant_slots", "0", "1"),
        (dict(charge_sync=False), "charge_sync", "true", "false"),
        (dict(seed=1), "seed", "0", "1"),
        (dict(lr=1e-3), "lr", "0.003", "0.001"),
        (dict(batch=16), "batch", "8", "16"),
        (dict(migration=xdc.Migration((("ep", 2),))), "domains", "(unset)", "ep=2"),
        (dict(prefetch=True), "prefetch", "false", "true"),
    ],
)
def test_resume_refuses_a_checkpoint_of_another_model(
    first_run, tmp_path, monkeypatch, changes, flag, theirs, ours
):
    monkeypatch.setattr(train_moe, "MoETransformer", _no_model)  # refused from the meta, first
    cfg = _copy_of_first_run(first_run, tmp_path, resume=True, steps=5, **changes)
    step_dir = os.path.join(cfg.output_dir, "checkpoint", "3")
    with pytest.raises(train_moe.ResumeError) as excinfo:
        train_moe.train(cfg)
    message = str(excinfo.value)
    assert message.startswith(
        f"--resume: the checkpoint {step_dir} was written with --{flag}={theirs}, this run has "
        f"--{flag}={ours}: resume with --{flag}={theirs} (only --steps, --schedule_steps, "
    ), message
    assert "\n" not in message


def test_resume_refuses_another_mesh(first_run, tmp_path, monkeypatch):
    monkeypatch.setattr(train_moe, "MoETransformer", _no_model)
    cfg = _copy_of_first_run(first_run, tmp_path, resume=True, steps=5, mesh="node=2,local=4")
    step_dir = os.path.join(cfg.output_dir, "checkpoint", "3")
    with pytest.raises(
        train_moe.ResumeError,
        match=(
            f"^--resume: the checkpoint {step_dir} was written by 1 process on --mesh=ep=8; "
            "this run has 1 process on --mesh=node=2,local=4: resume with 1 process and "
            "--mesh=ep=8, or run"
        ),
    ):
        train_moe.train(cfg)


def test_restore_names_the_flags_of_a_state_that_does_not_fit(first_run):
    """The state's own check, behind the flags' (a checkpoint whose meta lacks a flag)."""
    cfg = first_run[0]
    ckpt = os.path.join(cfg.output_dir + "_pristine", "checkpoint")
    saved = checkpoint.read_saved(ckpt, 3)
    meta = dict(saved.meta, d_model=64)
    target = dict(params=dict(w=np.zeros(3, np.float32)))
    with pytest.raises(train_moe.ResumeError) as excinfo:
        checkpoint.restore(ckpt, 3, target, saved, meta, train_moe.MODEL_FLAGS)
    message = str(excinfo.value)
    assert message.startswith(f"--resume: the checkpoint {ckpt}/3 does not fit this run's model: ")
    assert "it was written with --d_model=32 (this run: 64)" in message


def test_steps_zero_names_only_what_it_wrote(tmp_path):
    cfg = replace(TINY, steps=0, output_dir=str(tmp_path / "out"))
    metrics, text = _train(cfg)
    lines = text.strip().splitlines()
    assert lines[-2] == f"wrote metrics.json to {cfg.output_dir}"
    assert lines[-1] == f"eval loss: {metrics['final_eval_loss']:.4f}"
    assert os.listdir(cfg.output_dir) == ["metrics.json"]


def test_command_line_corrupt_checkpoint_is_one_last_line(first_run, tmp_path):
    """A truncated state manifest: the "corrupt" line, then nothing (no thread traceback of the
    checkpoint reader at shutdown)."""
    cfg = _copy_of_first_run(first_run, tmp_path)
    step_dir = os.path.join(cfg.output_dir, "checkpoint", "3")
    with open(os.path.join(step_dir, "state", "manifest.ocdbt"), "r+b") as f:
        f.truncate(7)
    flags = [
        f"--{k}={config.flag_values(cfg)[k]}"
        for k in ("batch", "seq_len", "d_model", "d_ff", "layers", "heads", "mesh", "eval_every")
    ]
    proc = subprocess.run(
        [
            *TRAIN_MOE,
            *flags,
            "--steps=5",
            "--resume",
            f"--output_dir={cfg.output_dir}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"train_moe: --resume: the checkpoint {step_dir} is corrupt: its metadata cannot be "
        "read (ValueError); run without --resume to start afresh"
    ), proc.stderr
    assert "Traceback" not in proc.stderr and "Event loop" not in proc.stderr


def test_resume_help_lists_the_flags_that_may_change():
    from absl import flags  # noqa: PLC0415

    if "resume" not in flags.FLAGS:
        job_flags.define_flags()
    text = flags.FLAGS["resume"].help
    for name in config.RESUMABLE_FLAGS:
        assert f"--{name}" in text and name in flags.FLAGS, (name, text)


def test_every_flag_is_its_field_and_reads_back_as_the_config(monkeypatch):
    """One source per setting: each flag has its field's default and help (the model's fields
    among them, under their own names), the parsed defaults read back as `TrainConfig()`, a
    changed flag lands in its field, and a checkpoint records exactly the flags (and the two
    fields without one)."""
    from absl import flags  # noqa: PLC0415

    if "resume" not in flags.FLAGS:
        job_flags.define_flags()
    defaults = config.TrainConfig()
    made = flag_fields.flag_fields(defaults)
    assert {f.name for f, _ in made} >= {"d_model", "heads", "backend", "wire_dtype", "seed"}
    for field, default in made:
        if field.name not in job_flags.CUSTOM:
            flag = flags.FLAGS[field.name]
            assert flag.default == default and flag.help.endswith(field.metadata["help"]), (
                field.name
            )
    assert flags.FLAGS["capacity_factor"].default == config.DROPLESS
    assert job_flags.config_from_flags() == defaults
    monkeypatch.setattr(flags.FLAGS["d_model"], "value", 64)
    monkeypatch.setattr(flags.FLAGS["capacity_factor"], "value", "1.5")
    monkeypatch.setattr(flags.FLAGS["domains"], "value", "ep=2")
    got = job_flags.config_from_flags()
    assert got == replace(
        defaults, d_model=64, capacity_factor=1.5, migration=xdc.Migration((("ep", 2),))
    )
    migration = set(config.migration_flags(xdc.Migration()))
    recorded = set(config.flag_values(defaults))
    assert (
        recorded - {"eval_batches", "progress"}
        == {f.name for f, _ in made} - {"migration"} | migration
    )
    assert all(name in flags.FLAGS for name in recorded - {"eval_batches", "progress"})


def test_a_setting_is_changed_by_its_flag_name():
    assert replace(TINY, heads=4, steps=9).model.heads == 4
    assert replace(TINY, heads=4).model == dataclasses.replace(TINY.model, heads=4)
    with pytest.raises(TypeError, match="TrainConfig has no field nope"):
        replace(TINY, nope=1)


def test_resume_with_a_corrupt_metrics_file(first_run, tmp_path, monkeypatch):
    monkeypatch.setattr(train_moe, "MoETransformer", _no_model)  # found on disk, first
    cfg = _copy_of_first_run(first_run, tmp_path, resume=True, steps=5)
    path = os.path.join(cfg.output_dir, "metrics.json")
    with open(path, "w") as f:
        f.write('{"train": [')
    with pytest.raises(train_moe.ResumeError, match=f"--resume: {path} cannot be read"):
        train_moe.train(cfg)

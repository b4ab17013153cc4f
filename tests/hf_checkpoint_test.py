"""nn.hf.checkpoint with checkpoint directories as untrusted input: an index names only the
directory's own shards (no path outside it, no FIFO, no subdirectory; the HF cache's symlinks
fine), files are known by what was opened (a file rewritten at the same path is read anew), a
tensor in two shards is an error naming both, and every damaged file (truncated, lying header,
empty, garbage, unreadable config.json or index) is an error naming it."""

import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from harness import make_mesh
from safetensors.numpy import save_file

import jax_hybridep as hep
from jax_hybridep import nn as hnn
from jax_hybridep.nn import hf
from jax_hybridep.nn.hf import checkpoint as ckpt_module

PREFIX = "model.layers.0.block_sparse_moe"
CONFIG = dict(
    model_type="mixtral",
    hidden_size=8,
    intermediate_size=8,
    num_local_experts=8,
    num_experts_per_tok=2,
    num_hidden_layers=1,
)


def block():
    mesh = make_mesh((4,), ("ep",))
    topology = hep.Topology.from_mesh(mesh, ("ep",))
    return hnn.MoEBlock(**hf.block_kwargs(CONFIG), mesh=mesh, topology=topology, rngs=nnx.Rngs(0))


def tensors(seed=0):
    shapes = hf.tensor_shapes(block(), PREFIX, "mixtral")
    rng = np.random.default_rng(seed)
    return {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}


def params(b):
    return {"/".join(map(str, p)): np.asarray(v) for p, v in nnx.to_flat_state(nnx.state(b))}


def write_sharded(directory, values, files=("a.safetensors", "b.safetensors")):
    """values split over `files` (every other tensor), with an index and config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    where = {name: files[i % len(files)] for i, name in enumerate(sorted(values))}
    for file in files:
        save_file({n: v for n, v in values.items() if where[n] == file}, str(directory / file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": where}))
    (directory / "config.json").write_text(json.dumps(CONFIG))
    return where


def with_index_entry(directory, where, entry):
    """The index with the first tensor's file replaced by `entry`."""
    name = sorted(where)[0]
    index = {"weight_map": {**where, name: entry}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return name


@pytest.fixture
def opened(monkeypatch):
    """Every path the loader opens (os.open and open), to prove what it did not touch."""
    seen = []
    real_open, real_os_open = open, os.open

    def record_open(file, *args, **kwargs):
        seen.append(os.fspath(file) if isinstance(file, str | os.PathLike) else file)
        return real_open(file, *args, **kwargs)

    def record_os_open(path, *args, **kwargs):
        seen.append(os.fspath(path))
        return real_os_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", record_open)
    monkeypatch.setattr(os, "open", record_os_open)
    return seen


@pytest.mark.parametrize(
    "entry",
    [
        "../../../../../../../etc/passwd",
        "sub/a.safetensors",
        "..",
        "",
        "a.safetensors/../../x.safetensors",
    ],
)
def test_an_index_entry_outside_the_directory_is_refused_before_opening_it(tmp_path, entry, opened):
    where = write_sharded(tmp_path / "ckpt", tensors())
    (tmp_path / "ckpt" / "sub").mkdir()
    name = with_index_entry(tmp_path / "ckpt", where, entry)
    b = block()
    before = params(b)
    with pytest.raises(ValueError, match=f"model.safetensors.index.json.*{name}.*{entry!r}"):
        hf.load_checkpoint(str(tmp_path / "ckpt"), [b])
    assert not [p for p in opened if isinstance(p, str) and p.endswith(".safetensors")], opened
    for key, value in params(b).items():
        np.testing.assert_array_equal(value, before[key], err_msg=key)


def test_an_absolute_index_entry_to_another_checkpoint_is_refused(tmp_path):
    """Before: the other checkpoint's weights loaded without a word."""
    where = write_sharded(tmp_path / "ckpt", tensors(0))
    other = tmp_path / "other" / "a.safetensors"
    write_sharded(tmp_path / "other", tensors(1))
    index = {"weight_map": {n: str(other) for n in where}}
    (tmp_path / "ckpt" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="is not a file name inside"):
        hf.load_checkpoint(str(tmp_path / "ckpt"), [block()])


# Feeds garbage to a FIFO whenever a reader opens it, so that a loader that opens one fails
# instead of blocking the test forever (a process: the reader may hold the GIL while it waits).
WRITER = """
import os, sys, time
while True:
    try:
        fd = os.open(sys.argv[1], os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # no reader yet
        time.sleep(0.01)
        continue
    try:
        os.write(fd, b"\\xff" * 64)
    except OSError:
        pass
    os.close(fd)
"""


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_a_fifo_is_never_opened(tmp_path, where, opened):
    values = tensors()
    if where == "outside":  # named by the index
        wmap = write_sharded(tmp_path / "ckpt", values)
        fifo = tmp_path / "pipe.safetensors"
        os.mkfifo(fifo)
        entry = "../pipe.safetensors"
        with_index_entry(tmp_path / "ckpt", wmap, entry)
        match = "is not a file name inside"
    else:  # a directory without an index: its *.safetensors
        (tmp_path / "ckpt").mkdir()
        save_file(values, str(tmp_path / "ckpt" / "a.safetensors"))
        fifo = tmp_path / "ckpt" / "b.safetensors"
        os.mkfifo(fifo)
        match = "b.safetensors.*is not a regular file"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(fifo)])
    try:
        with pytest.raises(ValueError, match=match):
            hf.load_checkpoint(str(tmp_path / "ckpt"), {PREFIX: block()})
    finally:
        writer.kill()
        writer.wait()
    assert str(fifo) not in opened and not any("pipe" in str(p) for p in opened)


def test_the_hf_cache_layout_of_symlinks_loads(tmp_path):
    """snapshots/<rev>/ holds symlinks into ../../blobs: the directory's own entries, fine."""
    values = tensors()
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    blobs.mkdir()
    snap.mkdir(parents=True)
    save_file(values, str(blobs / "0123abcd"))
    (blobs / "cfg").write_text(json.dumps(CONFIG))
    (blobs / "idx").write_text(
        json.dumps({"weight_map": {n: "./model.safetensors" for n in values}})
    )
    for name, blob in (
        ("model.safetensors", "0123abcd"),
        ("config.json", "cfg"),
        ("model.safetensors.index.json", "idx"),
    ):
        os.symlink(os.path.join("..", "..", "blobs", blob), snap / name)
    b, want = block(), block()
    hf.load_checkpoint(str(snap), [b])
    hf.load_block(want, values, PREFIX)
    for key, value in params(want).items():
        np.testing.assert_array_equal(params(b)[key], value, err_msg=key)


def fp8_file(path, scale):
    """A DeepSeek-style float8 weight and its scale at `path`; returns the dequantized value."""
    rng = np.random.default_rng(int(scale * 100))
    weight = rng.normal(size=(4, 3)).astype(ml_dtypes.float8_e4m3fn)
    # A tensor before it (its size changes with `scale`) moves the weight's offsets.
    pad = np.zeros(int(scale * 10), np.float32)
    save_file(
        {
            "a.pad": pad,
            "w.weight": weight,
            "w.weight_scale_inv": np.full((1, 1), scale, np.float32),
        },
        str(path),
    )
    return weight.astype(np.float32) * scale


def test_a_file_rewritten_at_the_same_path_is_read_anew(tmp_path):
    """Before: the safetensors header was cached by path, so the second load read the new file's
    float8 bytes at the old file's offsets."""
    path = tmp_path / "model.safetensors"
    first = fp8_file(path, 0.5)
    got = ckpt_module.Checkpoint([str(path)])["w.weight"][...]
    np.testing.assert_array_equal(got.astype(np.float32) * 0.5, first)
    second = fp8_file(path, 2.0)
    got = ckpt_module.Checkpoint([str(path)])["w.weight"][...]
    np.testing.assert_array_equal(got.astype(np.float32) * 2.0, second)


def test_a_file_changed_after_it_was_opened_is_an_error(tmp_path):
    path = tmp_path / "model.safetensors"
    fp8_file(path, 0.5)
    opened_checkpoint = ckpt_module.Checkpoint([str(path)])
    with open(path, "r+b") as f:  # rewritten in place: the same inode, another size
        f.write(b"\x00" * 4)
        f.seek(0, 2)
        f.write(b"\x00" * 8)
    with pytest.raises(OSError, match=f"{path}.*changed since it was opened"):
        opened_checkpoint["w.weight"][...]


def test_a_tensor_in_two_shards_without_an_index_names_both(tmp_path):
    """Before: whichever file sorted last won."""
    values = tensors()
    (tmp_path / "ckpt").mkdir()
    name = sorted(values)[0]
    save_file(values, str(tmp_path / "ckpt" / "a.safetensors"))
    save_file({name: values[name] + 1}, str(tmp_path / "ckpt" / "b.safetensors"))
    with pytest.raises(ValueError, match=f"{name}.*a.safetensors.*b.safetensors"):
        hf.load_checkpoint(str(tmp_path / "ckpt"), {PREFIX: block()})


def test_with_an_index_the_index_says_which_copy(tmp_path):
    """HF's loader reads each tensor from the file the index names; a stray copy elsewhere is
    not read."""
    values = tensors()
    where = write_sharded(tmp_path / "ckpt", values)
    name = sorted(values)[0]
    other = "b.safetensors" if where[name] == "a.safetensors" else "a.safetensors"
    rest = {n: v for n, v in values.items() if where[n] == other}
    save_file({**rest, name: values[name] + 1}, str(tmp_path / "ckpt" / other))
    b, want = block(), block()
    hf.load_checkpoint(str(tmp_path / "ckpt"), [b])
    hf.load_block(want, values, PREFIX)
    for key, value in params(want).items():
        np.testing.assert_array_equal(params(b)[key], value, err_msg=key)


def damage(path, how):
    data = path.read_bytes()
    header = int.from_bytes(data[:8], "little")
    if how == "truncated":
        path.write_bytes(data[: len(data) - 40])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "garbage":
        path.write_bytes(os.urandom(200))
    elif how == "header_too_long":  # says its header is longer than the file
        path.write_bytes((len(data) * 2).to_bytes(8, "little") + data[8:])
    elif how == "lying_offsets":  # one tensor's data said to end past the file
        meta = json.loads(data[8 : 8 + header])
        name = next(n for n in meta if n != "__metadata__")
        begin, end = meta[name]["data_offsets"]
        meta[name]["data_offsets"] = [begin, end + 10**6]
        text = json.dumps(meta).encode()
        path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + header :])
    elif how == "lying_shape":  # a shape that does not fit its bytes
        meta = json.loads(data[8 : 8 + header])
        name = next(n for n in meta if n != "__metadata__")
        meta[name]["shape"] = [3, 3]
        text = json.dumps(meta).encode()
        path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + header :])
    elif how == "header_not_json":
        path.write_bytes(header.to_bytes(8, "little") + b"{" * header + data[8 + header :])
    elif how == "header_not_object":
        text = b"[1, 2]"
        path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + header :])


@pytest.mark.parametrize(
    "how",
    [
        "truncated",
        "empty",
        "garbage",
        "header_too_long",
        "lying_offsets",
        "lying_shape",
        "header_not_json",
        "header_not_object",
    ],
)
def test_a_damaged_shard_is_an_error_naming_it(tmp_path, how):
    write_sharded(tmp_path / "ckpt", tensors())
    shard = tmp_path / "ckpt" / "b.safetensors"
    damage(shard, how)
    b = block()
    before = params(b)
    with pytest.raises(ValueError, match=f"{shard}"):
        hf.load_checkpoint(str(tmp_path / "ckpt"), [b])
    for key, value in params(b).items():
        np.testing.assert_array_equal(value, before[key], err_msg=key)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"\xff\xfe", None])
def test_an_unreadable_config_or_index_is_an_error_naming_it(tmp_path, name, content):
    write_sharded(tmp_path / "ckpt", tensors())
    path = tmp_path / "ckpt" / name
    if content is None:  # a directory where the file should be
        path.unlink()
        path.mkdir()
    else:
        path.write_bytes(content)
    with pytest.raises((ValueError, OSError), match=str(path)):
        hf.load_checkpoint(str(tmp_path / "ckpt"), [block()])


@pytest.mark.parametrize("weight_map", [None, [], {"x": 3}, {"x": None}, {3: "a.safetensors"}])
def test_an_index_whose_weight_map_is_not_names_to_files_is_named(tmp_path, weight_map):
    write_sharded(tmp_path / "ckpt", tensors())
    index = tmp_path / "ckpt" / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map} if weight_map is not None else {}))
    with pytest.raises(ValueError, match=f"{index}.*weight_map"):
        hf.load_checkpoint(str(tmp_path / "ckpt"), [block()])


def test_an_index_naming_a_missing_shard_names_it(tmp_path):
    where = write_sharded(tmp_path / "ckpt", tensors())
    name = with_index_entry(tmp_path / "ckpt", where, "c.safetensors")
    with pytest.raises(ValueError, match=f"{name}.*'c.safetensors'.*no such file"):
        hf.load_checkpoint(str(tmp_path / "ckpt"), [block()])


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(path=3), TypeError, "path must be"),
        (dict(path=[3]), TypeError, "path must be"),
        (dict(blocks=3), TypeError, "blocks must be"),
        (dict(blocks={PREFIX: "block"}), TypeError, r"blocks\['model.layers.0.block_sparse_moe'\]"),
        (dict(blocks={3: None}), TypeError, "blocks must be"),
        (dict(blocks=["block"]), TypeError, "blocks\\[0\\] must be"),
        (dict(config=[("model_type", "mixtral")]), TypeError, "config must be"),
        (dict(ignore_extra="no"), TypeError, "ignore_extra must be a bool"),
    ],
)
def test_load_checkpoint_arguments_of_the_wrong_type_are_named(tmp_path, kwargs, error, match):
    write_sharded(tmp_path / "ckpt", tensors())
    args = dict(path=str(tmp_path / "ckpt"), blocks={PREFIX: block()})
    args.update(kwargs)
    path, blocks = args.pop("path"), args.pop("blocks")
    with pytest.raises(error, match=match):
        hf.load_checkpoint(path, blocks, **args)

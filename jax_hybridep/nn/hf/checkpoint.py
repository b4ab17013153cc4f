"""HuggingFace safetensors checkpoints for `nn.MoEBlock`: lazy tensors over the files and
`load_checkpoint`, which loads every given MoE layer.

A checkpoint directory comes with a downloaded model and is read as untrusted input:

* The index (`model.safetensors.index.json`) may name only the directory's own shards: plain
  file names (after normalisation, so "./a.safetensors" is fine), regular files once symlinks are
  followed (the HF cache's snapshot directories are symlinks into its blobs). Anything else (a
  path outside the directory, an absolute path, a subdirectory, a FIFO, a missing file) is
  refused before any shard is opened, naming the entry.
* Each file is opened once and read from that descriptor (`safetensors_file`): a file rewritten
  at the same path is a new file for the next `Checkpoint`, and one changed under an open
  `Checkpoint` is an error, never read at the old offsets.
* A tensor in two files is an error naming both, unless the index says which file holds it.
* Every damaged file (truncated, a header that lies, empty, garbage, unreadable config.json or
  index) is a ValueError or OSError naming it.

A tensor is read when sliced, so `load_block`'s per-shard reads pull only the experts each
process holds from disk.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from jax_hybridep.nn.hf import block_fp8, configs, loader
from jax_hybridep.nn.hf.safetensors_file import SafetensorsFile, open_regular, read_json
from jax_hybridep.values import short

INDEX = "model.safetensors.index.json"
CONFIG = "config.json"


class _LazyTensor:
    """A safetensors tensor read on slicing (`[...]` reads all of it)."""

    def __init__(self, file: SafetensorsFile, name: str):
        self._file, self._name = file, name
        _, self.dtype, self.shape, _, _ = file.tensors[name]

    def __getitem__(self, index):
        return self._file.read(self._name, index)


class Checkpoint(Mapping):
    """Tensor name -> lazy tensor over a set of safetensors files (numpy, no torch).

    Args:
      files: the safetensors files (regular files).
      weight_map: the index's tensor name -> file name (in the files' directory); a tensor it
        names is read from that file only.
      index: the index's path, for messages.
    """

    def __init__(
        self,
        files: Sequence[str],
        weight_map: Mapping[str, str] | None = None,
        index: str | None = None,
    ):
        self._index = index or "the index"
        self._files: list[SafetensorsFile] = []
        try:
            for path in files:
                self._files.append(SafetensorsFile(os.fspath(path)))
            self._where = self._locate(weight_map)
        except BaseException:
            self.close()
            raise

    def _locate(self, weight_map) -> dict[str, SafetensorsFile]:
        where, also = {}, {}
        for file in self._files:
            for name in file.tensors:
                if name in where:
                    also.setdefault(name, [where[name]]).append(file)
                else:
                    where[name] = file
        by_name = {os.path.basename(f.path): f for f in self._files}
        for name, entry in (weight_map or {}).items():
            file = by_name.get(os.path.normpath(entry))
            if file is None or name not in file.tensors:
                raise ValueError(
                    f"{self._index}: its weight_map maps {name!r} to {entry!r}, which does not "
                    "hold it"
                )
            where[name] = file
            also.pop(name, None)
        for name, files in also.items():
            paths = " and ".join(f.path for f in files)
            raise ValueError(
                f"tensor {name!r} is in {paths}: which one is meant? (an index, "
                f"{INDEX}, would say; remove the stray copy)"
            )
        return where

    def __getitem__(self, name):
        return _LazyTensor(self._where[name], name)

    def __contains__(self, name):
        return name in self._where

    def __iter__(self):
        return iter(self._where)

    def __len__(self):
        return len(self._where)

    def close(self) -> None:
        """Closes the files (tensors read so far stay valid)."""
        for file in self._files:
            file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _shard_name(directory: str, entry) -> str:
    """`entry` of the index as the path of one of `directory`'s own files; ValueError otherwise."""
    name = os.path.normpath(entry) if isinstance(entry, str) and entry else None
    if (
        name is None
        or "\0" in name
        or os.path.isabs(name)
        or os.path.basename(name) != name
        or name in (".", "..")
    ):
        raise ValueError(f"{entry!r} is not a file name inside {directory}")
    return os.path.join(directory, name)


def _index(directory: str) -> tuple[list[str], dict[str, str]]:
    """(shard paths, weight map) of the directory's index, every entry checked before any shard
    is opened."""
    path = os.path.join(directory, INDEX)
    index = read_json(path, "index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if (
        not isinstance(weight_map, dict)
        or not weight_map
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items())
    ):
        raise ValueError(
            f"index {path}: its weight_map must be an object of tensor names to shard file "
            f"names, got {short(weight_map)}"
        )
    files = {}
    for tensor, entry in weight_map.items():
        if entry in files:
            continue
        try:
            shard = _shard_name(directory, entry)
            os.close(open_regular(shard, "shard"))
        except ValueError as err:
            raise ValueError(
                f"index {path} maps tensor {tensor!r} to {entry!r}: {err} (an index names the "
                "directory's own shards only)"
            ) from None
        files[entry] = shard
    return sorted(set(files.values())), weight_map


def _files(path) -> tuple[list[str], dict | None, dict | None]:
    """(safetensors files, index weight_map, config.json) for a path."""
    if isinstance(path, str | os.PathLike) and os.path.isdir(path):
        directory = os.fspath(path)
        config = None
        if os.path.lexists(os.path.join(directory, CONFIG)):
            config = read_json(os.path.join(directory, CONFIG), CONFIG)
            if not isinstance(config, dict):
                raise ValueError(f"{CONFIG} {os.path.join(directory, CONFIG)} is not a JSON object")
        if os.path.lexists(os.path.join(directory, INDEX)):
            files, weight_map = _index(directory)
            return files, weight_map, config
        files = sorted(
            os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".safetensors")
        )
        if not files:
            raise ValueError(f"no .safetensors files in {directory!r}")
        return files, None, config
    if isinstance(path, str | os.PathLike):
        files = [os.fspath(path)]
    elif isinstance(path, Sequence) and all(isinstance(p, str | os.PathLike) for p in path):
        files = [os.fspath(p) for p in path]
    else:
        raise TypeError(
            "path must be a checkpoint directory, a .safetensors file or a list of them, got "
            f"{type(path).__name__} {short(path)}"
        )
    for file in files:
        if not os.path.exists(file):
            raise ValueError(f"no such safetensors file: {file!r}")
    return files, None, None


def _blocks(blocks, config, model_type) -> dict:
    """{prefix: MoEBlock} from load_checkpoint's `blocks`, checked."""
    from jax_hybridep.nn.moe import MoEBlock  # noqa: PLC0415  (nn imports this package)

    if isinstance(blocks, Mapping):
        if not all(isinstance(k, str) for k in blocks):
            raise TypeError(
                f"blocks must be {{layer prefix (str): MoEBlock}}, got keys {short(list(blocks))}"
            )
        named = dict(blocks)
    elif isinstance(blocks, Sequence) and not isinstance(blocks, str):
        named = None
    else:
        raise TypeError(
            "blocks must be {layer prefix: MoEBlock} or a list of MoEBlocks, got "
            f"{type(blocks).__name__} {short(blocks)}"
        )
    items = named.items() if named is not None else enumerate(blocks)
    for key, block in items:
        if not isinstance(block, MoEBlock):
            raise TypeError(f"blocks[{key!r}] must be an nn.MoEBlock, got {type(block).__name__}")
    if named is not None:
        return named
    if config is None:
        raise ValueError(
            "blocks given as a list need a config (for the layer prefixes): "
            "pass config= or a directory with config.json"
        )
    names = configs.layer_prefixes(config)
    if len(names) != len(blocks):
        raise ValueError(
            f"{len(blocks)} blocks for the {len(names)} MoE layers of this "
            f"{model_type} config ({names[:3]}...)"
        )
    return dict(zip(names, blocks, strict=True))


def load_checkpoint(
    path, blocks, *, config: Mapping | None = None, ignore_extra: bool = False
) -> dict[str, str]:
    """Loads MoE blocks from a HuggingFace safetensors checkpoint.

    Every block's tensors are checked (names, shapes, dtypes, scales, tensors under a layer that
    its block cannot hold) before any block is set; each block is then set whole or, when a read
    fails, not at all.

    Args:
      path: a checkpoint directory (its *.safetensors, model.safetensors.index.json and
        config.json), one .safetensors file, or a list of them.
      blocks: {layer prefix: MoEBlock}, or the blocks of the model's MoE layers in order (their
        prefixes from the config: `hf.layer_prefixes`).
      config: the parsed config.json (default: the directory's).
      ignore_extra: leave tensors under a layer's prefix that its block cannot hold unread
        (default: an error naming them).

    Returns:
      {prefix: layout read}.
    """
    if config is not None and not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict (a parsed config.json), got {short(config)}")
    if not isinstance(ignore_extra, bool):
        raise TypeError(f"ignore_extra must be a bool, got {short(ignore_extra)}")
    files, weight_map, found = _files(path)
    index = os.path.join(os.fspath(path), INDEX) if weight_map is not None else None
    config = config if config is not None else found
    model_type = configs.model_type(config) if config is not None else None
    blocks = _blocks(blocks, config, model_type)
    fp8_block = block_fp8.block_size(config)
    with Checkpoint(files, weight_map, index) as tensors:
        plans, problems = {}, []
        for prefix, block in blocks.items():
            try:
                plans[prefix] = loader.plan_block(
                    block,
                    tensors,
                    prefix,
                    model_type=model_type,
                    fp8_block=fp8_block,
                    ignore_extra=ignore_extra,
                )
            except ValueError as err:
                problems.append(str(err))
        if problems:
            raise ValueError("; ".join(problems))
        return {prefix: loader.apply(plan) for prefix, plan in plans.items()}

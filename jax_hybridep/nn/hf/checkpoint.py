"""HuggingFace safetensors checkpoints for `nn.MoEBlock`: lazy tensors over the files (the
`safetensors` numpy API, no torch) and `load_checkpoint`, which loads every given MoE layer.

A tensor is read when sliced, so `load_block`'s per-shard reads pull only the experts each
process holds from disk.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence

import ml_dtypes  # numpy learns "bfloat16" for BF16 slices; the float8 types
import numpy as np

from jax_hybridep.nn.hf import block_fp8, configs, prefixes
from jax_hybridep.nn.hf.loader import load_block

_FLOAT8 = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


class _LazyTensor:
    """A safetensors tensor read on slicing (`[...]` reads all of it). float8 tensors (which the
    safetensors numpy API cannot read) are read from a memory map of the file."""

    def __init__(self, handle, name, path):
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())
        self._path, self._name = path, name
        float8 = _FLOAT8.get(self._slice.get_dtype())
        self.dtype = getattr(ml_dtypes, float8) if float8 else None

    def __getitem__(self, index):
        if self.dtype is None:
            return self._slice[index]
        entry, start = _header(self._path)
        begin, end = entry[self._name]["data_offsets"]
        raw = np.memmap(self._path, np.uint8, "r", offset=start + begin, shape=(end - begin,))
        return np.asarray(raw.view(self.dtype).reshape(self.shape)[index])


@functools.lru_cache(maxsize=64)
def _header(path) -> tuple[dict, int]:
    """(safetensors header, offset of its data) of a file."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(size)), 8 + size


class Checkpoint(Mapping):
    """Tensor name -> lazy tensor over a set of safetensors files (numpy API, no torch)."""

    def __init__(self, files: Sequence[str], weight_map: Mapping[str, str] | None = None):
        from safetensors import safe_open  # noqa: PLC0415  (optional dependency: extra "hf")

        self._handles = {}
        self._where = {}
        for path in files:
            handle = safe_open(path, framework="numpy")
            self._handles[path] = handle
            for name in handle.keys():  # noqa: SIM118  (a safe_open handle, not a dict)
                self._where[name] = path
        if weight_map is not None:
            base = os.path.dirname(files[0]) if files else ""
            for name, file in weight_map.items():
                if self._where.get(name) != os.path.join(base, file):
                    raise ValueError(f"the index maps {name!r} to {file!r}, not found there")

    def __getitem__(self, name):
        path = self._where[name]
        return _LazyTensor(self._handles[path], name, path)

    def __contains__(self, name):
        return name in self._where

    def __iter__(self):
        return iter(self._where)

    def __len__(self):
        return len(self._where)


def _files(path) -> tuple[list[str], dict | None, dict | None]:
    """(safetensors files, index weight_map, config.json) for a path."""
    if isinstance(path, str | os.PathLike) and os.path.isdir(path):
        path = os.fspath(path)
        config = None
        if os.path.exists(os.path.join(path, "config.json")):
            with open(os.path.join(path, "config.json")) as f:
                config = json.load(f)
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted({os.path.join(path, file) for file in weight_map.values()})
            return files, weight_map, config
        files = sorted(
            os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")
        )
        if not files:
            raise ValueError(f"no .safetensors files in {path!r}")
        return files, None, config
    files = (
        [os.fspath(path)] if isinstance(path, str | os.PathLike) else [os.fspath(p) for p in path]
    )
    for file in files:
        if not os.path.isfile(file):
            raise ValueError(f"no such safetensors file: {file!r}")
    return files, None, None


def load_checkpoint(path, blocks, *, config: Mapping | None = None) -> dict[str, str]:
    """Loads MoE blocks from a HuggingFace safetensors checkpoint.

    Args:
      path: a checkpoint directory (its *.safetensors, model.safetensors.index.json and
        config.json), one .safetensors file, or a list of them.
      blocks: {layer prefix: MoEBlock}, or the blocks of the model's MoE layers in order (their
        prefixes from the config: `hf.layer_prefixes`).
      config: the parsed config.json (default: the directory's).

    Returns:
      {prefix: layout read}.
    """
    files, weight_map, found = _files(path)
    config = config if config is not None else found
    model_type = configs.model_type(config) if config is not None else None
    if not isinstance(blocks, Mapping):
        blocks = list(blocks)
        if config is None:
            raise ValueError(
                "blocks given as a list need a config (for the layer prefixes): "
                "pass config= or a directory with config.json"
            )
        names = prefixes.layer_prefixes(config)
        if len(names) != len(blocks):
            raise ValueError(
                f"{len(blocks)} blocks for the {len(names)} MoE layers of this "
                f"{model_type} config ({names[:3]}...)"
            )
        blocks = dict(zip(names, blocks, strict=True))
    tensors = Checkpoint(files, weight_map)
    fp8_block = block_fp8.block_size(config)
    return {
        prefix: load_block(block, tensors, prefix, model_type=model_type, fp8_block=fp8_block)
        for prefix, block in blocks.items()
    }

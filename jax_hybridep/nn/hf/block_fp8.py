"""Block-scaled FP8 checkpoints (DeepSeek-V3/R1's released files, and the FP8 releases of
GLM-4.5 and Qwen3 in the same format): a linear weight `{name}` stored as float8 [..., out, in]
with `{name}_scale_inv` float32 [..., ceil(out / b0), ceil(in / b1)], one scale per b0 x b1
block (config.json's `quantization_config.weight_block_size`, 128 x 128 in those releases); the
weight is the float8 value times its block's scale.

`dequantizing(tensors, block)` is the mapping `load_block` reads: every weight with a scale
reads as its float32 value, the scales are consumed (not left over as tensors the block cannot
hold), and a float8 tensor without a scale is an error rather than values off by their scales.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from jax_hybridep.values import is_int, short

SCALE_SUFFIX = "_scale_inv"
DEFAULT_BLOCK = (128, 128)


def is_float8(dtype) -> bool:
    return dtype is not None and np.dtype(dtype).name.startswith("float8")


def scale_shape(weight_shape: Sequence[int], block: Sequence[int]) -> tuple[int, ...]:
    """The scales' shape of a weight [..., out, in] in b0 x b1 blocks."""
    *lead, out, inp = weight_shape
    return (*lead, -(-out // block[0]), -(-inp // block[1]))


def dequantize(weight, scale, block: Sequence[int]) -> np.ndarray:
    """float8 [..., out, in] x float32 [..., ceil(out / b0), ceil(in / b1)] -> float32."""
    weight = np.asarray(weight).astype(np.float32)
    scale = np.asarray(scale, np.float32)
    *_, out, inp = weight.shape
    b0, b1 = block
    want = scale_shape(weight.shape, block)
    if scale.shape != want:
        raise ValueError(
            f"a float8 weight {weight.shape} in {b0} x {b1} blocks has scales of shape {want}, "
            f"not {scale.shape} (config.json's quantization_config.weight_block_size?)"
        )
    full = np.repeat(np.repeat(scale, b0, axis=-2), b1, axis=-1)[..., :out, :inp]
    return weight * full


class _Scaled:
    """A float8 weight and its scales, read as the float32 weight (all of it, then indexed)."""

    dtype = np.dtype(np.float32)

    def __init__(self, weight, scale, block):
        self._weight, self._scale, self._block = weight, scale, block
        self.shape = tuple(int(d) for d in weight.shape)

    def __getitem__(self, index):
        return dequantize(self._weight[...], self._scale[...], self._block)[index]


class _Dequantizing(Mapping):
    def __init__(self, tensors: Mapping, block: Sequence[int]):
        self._tensors, self._block = tensors, tuple(int(b) for b in block)

    def __getitem__(self, name):
        if name.endswith(SCALE_SUFFIX):
            raise KeyError(name)
        tensor = self._tensors[name]
        scale = name + SCALE_SUFFIX
        if scale in self._tensors:
            scales = self._tensors[scale]
            shape = tuple(int(d) for d in tensor.shape)
            want = scale_shape(shape, self._block) if len(shape) >= 2 else None
            got = tuple(int(d) for d in scales.shape)
            if got != want:
                b0, b1 = self._block
                raise ValueError(
                    f"{scale!r} has shape {got}, but {name!r} {shape} in {b0} x {b1} blocks "
                    f"needs {want} (config.json's quantization_config.weight_block_size?)"
                )
            return _Scaled(tensor, scales, self._block)
        if is_float8(getattr(tensor, "dtype", None)):
            raise ValueError(
                f"{name!r} is {np.dtype(tensor.dtype).name} without {scale!r}: the values "
                "alone are not the weight"
            )
        return tensor

    def __contains__(self, name):
        return not name.endswith(SCALE_SUFFIX) and name in self._tensors

    def __iter__(self):
        return (n for n in self._tensors if not n.endswith(SCALE_SUFFIX))

    def __len__(self):
        return sum(1 for _ in self)


def dequantizing(tensors: Mapping, block: Sequence[int] = DEFAULT_BLOCK) -> Mapping:
    """`tensors` with every `{name}` that has a `{name}_scale_inv` read dequantized, the scales
    hidden; a float8 tensor without scales, or scales of another shape than its blocks', raises
    ValueError when looked up (before anything is read)."""
    if len(block) != 2 or any(int(b) < 1 for b in block):
        raise ValueError(f"weight_block_size={list(block)} must be two block sizes >= 1")
    return _Dequantizing(tensors, block)


def block_size(config: Mapping | None) -> tuple[int, int]:
    """config.json's FP8 block (quantization_config.weight_block_size: two ints >= 1), else
    128 x 128; a ValueError naming the field when it is anything else."""
    quant = (config or {}).get("quantization_config")
    if quant is None:
        return DEFAULT_BLOCK
    if not isinstance(quant, Mapping):
        raise ValueError(f"config.json: quantization_config={short(quant)} is not a JSON object")
    size = quant.get("weight_block_size")
    if size is None:
        return DEFAULT_BLOCK
    if (
        not isinstance(size, list | tuple)
        or len(size) != 2
        or not all(is_int(b) and b >= 1 for b in size)
    ):
        raise ValueError(
            f"config.json: quantization_config.weight_block_size={short(size)} is not two block "
            "sizes (ints >= 1), e.g. [128, 128]"
        )
    return int(size[0]), int(size[1])

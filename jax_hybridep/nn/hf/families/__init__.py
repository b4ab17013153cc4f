"""The registered HuggingFace families: `FAMILIES`, model_type -> `Family`, the one registry; every
other part of `nn.hf` finds a family through it (`family(model_type)`).

A family file of this folder defines `FAMILIES`, the tuple of its `nn.hf.family.Family` (one per
`model_type` it describes: its config mapping, field aliases, layer prefixes and tensor layouts);
the registry is those tuples, file after file. Adding a family is one new file here, imported
below and appended to `_registry(...)` (docs/families.md, "Adding a family").
"""

from __future__ import annotations

from types import ModuleType

from jax_hybridep.nn.hf.families import (
    dbrx,
    deepseek,
    gpt_oss,
    granitemoe,
    jamba,
    llama4,
    mixtral,
    nllb_moe,
    olmoe,
    qwen_moe,
    switch_transformers,
)
from jax_hybridep.nn.hf.family import Family
from jax_hybridep.nn.hf.tensor_layouts import TensorLayout


def _registry(*files: ModuleType) -> dict[str, Family]:
    """model_type -> Family over the family files' `FAMILIES`, in their order; a file given twice
    or a model_type two files register is an error at import."""
    registry: dict[str, Family] = {}
    for file in files:
        if files.count(file) > 1:
            raise ValueError(f"the registry lists {file.__name__} more than once")
        for found in file.FAMILIES:
            if found.model_type in registry:
                raise ValueError(f"model_type {found.model_type!r} is registered twice")
            registry[found.model_type] = found
    return registry


# The registry. Its order is the order in which `load_block` without a model_type tries the
# layouts (of layouts that fit a block alike, the first one is reported): append.
FAMILIES: dict[str, Family] = _registry(
    mixtral,
    qwen_moe,
    deepseek,
    olmoe,
    jamba,
    dbrx,
    granitemoe,
    llama4,
    gpt_oss,
    switch_transformers,
    nllb_moe,
)


def family(model_type) -> Family:
    """The family registered for `model_type`; a ValueError naming the known ones otherwise."""
    found = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if found is None:
        raise ValueError(
            f"unknown model_type {model_type!r}: jax_hybridep.nn.hf knows {sorted(FAMILIES)}"
        )
    return found


# Every family's layouts, each once (families share some), in the registry's order.
ALL_LAYOUTS: tuple[TensorLayout, ...] = tuple(
    {id(layout): layout for found in FAMILIES.values() for layout in found.layouts}.values()
)

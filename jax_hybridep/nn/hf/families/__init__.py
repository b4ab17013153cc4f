"""The registered HuggingFace families: `MODULES` is the one table, naming each family file of
this folder once; every other part of `nn.hf` finds a family through it (`BY_MODEL_TYPE`).

A family file defines `FAMILIES`, a tuple of `nn.hf.family.Family` (one per `model_type` it
describes: its config mapping, field aliases, layer prefixes and tensor layouts). Adding a family
is one new file here and its name in `MODULES` (docs/families.md, "Adding a family").
"""

from __future__ import annotations

import importlib

from jax_hybridep.nn.hf.family import Family
from jax_hybridep.nn.hf.tensor_layouts import TensorLayout

# The one table. Its order is hf.FAMILIES' order and the order in which `load_block` without a
# model_type tries the layouts (of layouts that fit a block alike, the first one is reported).
MODULES = (
    "mixtral",
    "qwen_moe",
    "deepseek",
    "olmoe",
    "jamba",
    "dbrx",
    "granitemoe",
    "llama4",
    "gpt_oss",
    "switch_transformers",
    "nllb_moe",
)

REGISTERED: tuple[Family, ...] = tuple(
    family for name in MODULES for family in importlib.import_module(f"{__name__}.{name}").FAMILIES
)
BY_MODEL_TYPE: dict[str, Family] = {family.model_type: family for family in REGISTERED}


def family(model_type) -> Family:
    """The family registered for `model_type`; a ValueError naming the known ones otherwise."""
    found = BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    if found is None:
        raise ValueError(
            f"unknown model_type {model_type!r}: jax_hybridep.nn.hf knows {sorted(BY_MODEL_TYPE)}"
        )
    return found


# Every family's layouts, each once (families share some), in the table's order.
ALL_LAYOUTS: tuple[TensorLayout, ...] = tuple(
    {id(layout): layout for family in REGISTERED for layout in family.layouts}.values()
)

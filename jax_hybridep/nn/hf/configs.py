"""HuggingFace `config.json` -> MoE block settings and MoE layer prefixes, through the family its
`model_type` names (`nn.hf.families`).

Each family's mapping (its file under `nn.hf.families`) reads the fields its modeling code reads
and says, in settings of `RouterConfig` and `ExpertConfig`, the MoE block of that family as HF's
`model.eval()` runs it. Every field is read by its type and range under any name the family's HF
config class accepts (`config_fields`, with the family's aliases); fields a family may set that
change the block in a way the layer cannot follow raise a ValueError naming them; training-only
randomness (router jitter, token dropout in training) is not modelled (docs/families.md says what
differs in training).
"""

from __future__ import annotations

from collections.abc import Mapping

from jax_hybridep.nn.hf.config_fields import Config
from jax_hybridep.nn.hf.families import family


def model_type(config: Mapping) -> str:
    """config["model_type"], checked against the known families."""
    if not isinstance(config, Mapping):
        raise TypeError(
            f"config must be a dict (a parsed config.json), got {type(config).__name__}"
        )
    return family(config.get("model_type")).model_type


def _read(config: Mapping):
    """(the config's family, its Config reader under the family's aliases)."""
    found = family(model_type(config))
    return found, Config(config, found.model_type, aliases=found.aliases)


def settings(config: Mapping) -> dict:
    """{"d_model": H, "router": RouterConfig fields, "experts": ExpertConfig fields}."""
    family, c = _read(config)
    return family.settings(c)


def layer_prefixes(config: Mapping) -> list[str]:
    """The tensor-name prefixes of the family's MoE layers, in model order (as in its
    safetensors files: e.g. "model.layers.3.mlp")."""
    family, c = _read(config)
    return family.layer_prefixes(c)

"""What one HuggingFace family's file defines (`Family`), and the pieces family files share.

A family file under `nn.hf.families` describes one `model_type` (or a few that share code) as
`FAMILIES = (Family(...), ...)`: its config mapping, the field aliases of its HF config class,
its MoE layers' tensor-name prefixes and its checkpoints' tensor layouts. The registry
(`nn.hf.families.FAMILIES`, which imports each file) is the one place that lists the files;
nothing else names a family.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jax_hybridep.nn.hf.config_fields import Config
from jax_hybridep.nn.hf.tensor_layouts import TensorLayout


@dataclasses.dataclass(frozen=True)
class Family:
    """One `model_type`: every part is given (a family without aliases says `aliases=()`).

    Attributes:
      model_type: config.json's `model_type`.
      settings: the config mapping, Config -> {"d_model": H, "router": RouterConfig fields,
        "experts": ExpertConfig fields} (`settings` below builds it): the fields its modeling code
        reads, the block as HF's `model.eval()` runs it; a field the block cannot follow is a
        `Config.fail` naming it.
      layer_prefixes: Config -> the tensor-name prefixes of its MoE layers, in model order
        (`layers` below), by its modeling code's rule for which layers are sparse.
      layouts: its checkpoints' tensor layouts (`nn.hf.tensor_layouts`): its hub files' first, then
        transformers' in-memory stacked one where it has one (`tensor_shapes` writes the first).
      aliases: the field names its HF config class accepts for one field (transformers 5's
        `attribute_map`: an alias is stored, and written back to config.json, under its target),
        as groups of equal names; the first is the one `settings` and `layer_prefixes` ask for.
    """

    model_type: str
    settings: Callable[[Config], dict]
    layer_prefixes: Callable[[Config], list[str]]
    layouts: tuple[TensorLayout, ...]
    aliases: tuple[tuple[str, ...], ...]


GATED_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu"}
PLAIN_ACTIVATIONS = {
    "relu": "relu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
}


def settings(d_model, router: dict, experts: dict) -> dict:
    return {"d_model": d_model, "router": router, "experts": experts}


def experts_and_top_k(c: Config, experts_key: str, top_k_key: str = "num_experts_per_tok"):
    """(E, k): the expert count and the experts per token, 1 <= k <= E."""
    num_experts = c.integer(experts_key)
    return num_experts, c.integer(top_k_key, high=num_experts)


def softmax_family(c: Config, *, experts_key, ff_key, normalize) -> dict:
    """Softmax top-k routing over SwiGLU experts (Mixtral and the families built like it)."""
    num_experts, top_k = experts_and_top_k(c, experts_key)
    return settings(
        c.integer("hidden_size"),
        dict(num_experts=num_experts, top_k=top_k, normalize=normalize),
        dict(
            d_ff=c.integer(ff_key),
            activation=c.activation("hidden_act", "silu", GATED_ACTIVATIONS),
        ),
    )


def layers(c: Config, template: str, keep: Callable[[int], bool], count_key: str) -> list[str]:
    """`template` ({i}: the layer) of every layer i < config[count_key] that `keep(i)`."""
    return [template.format(i=i) for i in range(c.integer(count_key, low=0)) if keep(i)]


def every_layer(template: str, count_key: str = "num_hidden_layers") -> Callable[[Config], list]:
    """A family's layer_prefixes when every one of config[count_key] layers is an MoE layer."""
    return lambda c: layers(c, template, lambda i: True, count_key)

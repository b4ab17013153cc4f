"""HuggingFace MoE families for `nn.MoEBlock`: config mapping, checkpoint loading, aux loss.

* `block_kwargs(config)`: a parsed `config.json` -> the `MoEBlock` keyword arguments of that
  family's MoE layer (`d_model`, `router`, `experts`); `layer_prefixes(config)`: where its MoE
  layers' tensors live.
* `load_block(block, tensors, prefix)` / `load_checkpoint(path, blocks)`: the family's tensors
  (per-expert or fused layouts, as stored in its safetensors files) into the block's parameters,
  sharded as the block's are (`nn.hf.loader`, `nn.hf.checkpoint`).
* `load_balancing_loss(auxes, top_k)`: HF's auxiliary loss, pooled over layers.

A downloaded model's config.json, index and shards are untrusted input: fields are read by type
and range under every alias HF's config classes accept (`config_fields`), shards only from the
checkpoint's own directory and checked against their headers (`safetensors_file`), and a block is
loaded whole or not at all, tensors it cannot hold named (`ignore_extra=True` leaves them).
Each family (config mapping, field aliases, layer prefixes, tensor layouts) is one file under
`nn.hf.families`, in the one registry `FAMILIES` (model_type -> `Family`, from
`nn.hf.families`); docs/families.md lists the families, what each maps to and how to add one;
docs/errors.md what is checked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax.numpy as jnp

from jax_hybridep.nn.hf.checkpoint import Checkpoint, load_checkpoint
from jax_hybridep.nn.hf.configs import layer_prefixes, model_type, settings
from jax_hybridep.nn.hf.families import FAMILIES
from jax_hybridep.nn.hf.loader import load_block, tensor_shapes

__all__ = [
    "FAMILIES",
    "Checkpoint",
    "block_kwargs",
    "layer_prefixes",
    "load_balancing_loss",
    "load_block",
    "load_checkpoint",
    "model_type",
    "tensor_shapes",
]


def block_kwargs(config: Mapping, **experts) -> dict:
    """`MoEBlock` keyword arguments for the MoE layer of a HuggingFace config.

    Args:
      config: the parsed config.json (`model_type` picks the family).
      **experts: extra `ExpertConfig` fields (e.g. dtype=jnp.bfloat16).

    Returns:
      {"d_model": H, "router": RouterConfig, "experts": ExpertConfig}: add the topology,
      dispatch and rngs, e.g. `MoEBlock(**block_kwargs(cfg), topology=..., rngs=...)`.

    Raises:
      ValueError: an unknown model_type, a missing field, or a setting the block cannot follow.
    """
    from jax_hybridep.nn.experts import ExpertConfig  # noqa: PLC0415  (nn imports this package)
    from jax_hybridep.nn.router import RouterConfig  # noqa: PLC0415

    s = settings(config)
    name = config["model_type"]
    try:
        router = RouterConfig(**s["router"])
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"config.json of model_type {name!r} describes a router the block cannot build: {err}"
        ) from None
    try:
        experts = ExpertConfig(**s["experts"], **experts)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"config.json of model_type {name!r} (with {sorted(experts)}) describes experts the "
            f"block cannot build: {err}"
        ) from None
    return {"d_model": s["d_model"], "router": router, "experts": experts}


def load_balancing_loss(auxes: Sequence, top_k: int):
    """HuggingFace's `load_balancing_loss_func` over the given layers' `MoEAux`.

    HF pools every layer's tokens: with f_e the fraction of (token, layer, k) choices that went
    to expert e and P_e the mean routing probability of e over every (token, layer),
    `E * top_k * sum_e f_e * P_e`; for one layer it is `top_k` times `MoEAux.aux_loss` computed
    over the whole batch (the block's own aux_loss averages per-shard losses instead). Multiply
    by HF's `router_aux_loss_coef`. For families without a group capacity (every choice counted).
    """
    if not auxes:
        raise ValueError("load_balancing_loss needs at least one layer's MoEAux")
    counts = sum(aux.tokens_per_expert.astype(jnp.float32) for aux in auxes)
    probs = sum(aux.router_probs for aux in auxes) / len(auxes)
    fraction = counts / jnp.sum(counts)
    return counts.shape[0] * top_k * jnp.sum(fraction * probs)

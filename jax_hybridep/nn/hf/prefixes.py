"""Where a HuggingFace MoE model's MoE layers are: the tensor-name prefix of each, per family
(its modeling code's rule for which layers are sparse, and its module names)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from jax_hybridep.nn.hf.config_fields import Config
from jax_hybridep.nn.hf.configs import model_type, text_config


def _layers(c: Config, template: str, keep: Callable[[int], bool], count_key: str) -> list[str]:
    return [template.format(i=i) for i in range(c.integer(count_key, low=0)) if keep(i)]


def layer_prefixes(config: Mapping) -> list[str]:
    """The tensor-name prefixes of the family's MoE layers, in model order (as in its
    safetensors files: e.g. "model.layers.3.mlp")."""
    name = model_type(config)
    c = Config(config, name)
    layers = "model.layers.{i}."
    if name in ("mixtral", "granitemoe"):
        return _layers(c, layers + "block_sparse_moe", lambda i: True, "num_hidden_layers")
    if name in ("qwen2_moe", "qwen3_moe"):
        step, dense = c.integer("decoder_sparse_step", 1), set(c.integers("mlp_only_layers", []))
        return _layers(
            c, layers + "mlp", lambda i: i not in dense and (i + 1) % step == 0, "num_hidden_layers"
        )
    if name in ("deepseek_v2", "deepseek_v3", "glm4_moe"):
        # HF's default differs between these families: deepseek_v2's is 0, the others' not.
        first = c.integer("first_k_dense_replace", *((0,) if name == "deepseek_v2" else ()), low=0)
        freq = c.integer("moe_layer_freq", 1)
        return _layers(
            c, layers + "mlp", lambda i: i >= first and i % freq == 0, "num_hidden_layers"
        )
    if name in ("olmoe", "gpt_oss"):
        return _layers(c, layers + "mlp", lambda i: True, "num_hidden_layers")
    if name == "jamba":
        period = c.integer("expert_layer_period")
        offset = c.integer("expert_layer_offset", low=0, high=period - 1)
        sparse = c.integer("num_experts") > 1  # one expert: every layer is a dense MLP
        return _layers(
            c, layers + "feed_forward", lambda i: sparse and i % period == offset,
            "num_hidden_layers",
        )  # fmt: skip
    if name == "dbrx":
        return _layers(c, "transformer.blocks.{i}.ffn", lambda i: True, "n_layers")
    if name in ("llama4", "llama4_text"):
        # As configs.py reads it: llama4's text settings in text_config, or (flat) at the top.
        text = text_config(c) if name == "llama4" else c
        step = text.integer("interleave_moe_layer_step", 1)
        moe = text.integers("moe_layers", None) if text.has("moe_layers") else None
        if moe is None:  # HF's default: every step-th layer, the last of each step
            moe = range(step - 1, text.integer("num_hidden_layers", low=0), step)
        moe = set(moe)
        base = "language_model.model.layers.{i}." if name == "llama4" else layers
        return _layers(text, base + "feed_forward", lambda i: i in moe, "num_hidden_layers")
    if name == "switch_transformers":

        def sparse(step):
            return lambda i: step > 0 and (step == 1 or i % step == 1)

        return _layers(
            c,
            "encoder.block.{i}.layer.1.mlp",
            sparse(c.integer("encoder_sparse_step", low=0)),
            "num_layers",
        ) + _layers(
            c,
            "decoder.block.{i}.layer.2.mlp",
            sparse(c.integer("decoder_sparse_step", low=0)),
            "num_decoder_layers",
        )
    # nllb_moe

    def sparse_nllb(step):
        return lambda i: step > 0 and (i + 1) % step == 0

    return _layers(
        c,
        "model.encoder.layers.{i}.ffn",
        sparse_nllb(c.integer("encoder_sparse_step", low=0)),
        "encoder_layers",
    ) + _layers(
        c,
        "model.decoder.layers.{i}.ffn",
        sparse_nllb(c.integer("decoder_sparse_step", low=0)),
        "decoder_layers",
    )

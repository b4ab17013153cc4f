"""nn.hf's reading of config.json as untrusted input: every field typed and range-checked by
family (nothing coerced: "8", 8.7 and true are not 8, "false" is not False), a zero layer step
refused instead of dividing by zero, every alias of HF's config classes (`attribute_map`)
honoured, and every error naming the field."""

import json

import numpy as np
import pytest
from flax import nnx
from harness import make_mesh
from safetensors.numpy import save_file

import jax_hybridep as hep
from examples.hf_moe_layer import TINY
from jax_hybridep import nn as hnn
from jax_hybridep.nn import hf


def changed(name, **fields):
    return {**TINY[name], **fields}


def without(name, *fields):
    return {k: v for k, v in TINY[name].items() if k not in fields}


def renamed(config, old, new):
    """config with field `old` spelled `new` (its value kept)."""
    return {(new if k == old else k): v for k, v in config.items()}


# (config, the field its error must name): values of the wrong type, never coerced.
COERCED = [
    *[(changed("Mixtral", hidden_size=bad), "hidden_size") for bad in ("8", 8.7, True, 8.0)],
    (changed("Qwen3-MoE", norm_topk_prob="false"), "norm_topk_prob"),
    (changed("Qwen2-MoE", norm_topk_prob=0), "norm_topk_prob"),
    (changed("OLMoE", norm_topk_prob="true"), "norm_topk_prob"),
    (changed("DeepSeek-V3", norm_topk_prob="false"), "norm_topk_prob"),
    (changed("DeepSeek-V2", norm_topk_prob="yes"), "norm_topk_prob"),
    (changed("Mixtral", num_local_experts="8"), "num_local_experts"),
    (changed("Mixtral", num_experts_per_tok=2.0), "num_experts_per_tok"),
    (changed("Qwen3-MoE", moe_intermediate_size="8"), "moe_intermediate_size"),
    (changed("Qwen2-MoE", shared_expert_intermediate_size="16"), "shared_expert_intermediate_size"),
    (changed("DeepSeek-V3", n_shared_experts="1"), "n_shared_experts"),
    (changed("DeepSeek-V3", routed_scaling_factor="2.5"), "routed_scaling_factor"),
    (changed("DeepSeek-V3", routed_scaling_factor=True), "routed_scaling_factor"),
    (changed("DeepSeek-V3", n_group="4"), "n_group"),
    (changed("DeepSeek-V2", topk_method=["greedy"]), "topk_method"),
    (changed("Mixtral", hidden_act=["silu"]), "hidden_act"),
    (changed("GPT-OSS", swiglu_limit="7"), "swiglu_limit"),
    (changed("Switch", router_bias="false"), "router_bias"),
    (changed("Switch", expert_capacity=2.5), "expert_capacity"),
    (changed("NLLB-MoE", router_bias=1), "router_bias"),
    (changed("NLLB-MoE", moe_token_dropout="0.2"), "moe_token_dropout"),
    (changed("NLLB-MoE", batch_prioritized_routing="false"), "batch_prioritized_routing"),
    (changed("DBRX", d_model="8"), "d_model"),
    (
        changed("DBRX", ffn_config={**TINY["DBRX"]["ffn_config"], "moe_top_k": "2"}),
        "ffn_config.moe_top_k",
    ),
    (
        changed(
            "DBRX", ffn_config={**TINY["DBRX"]["ffn_config"], "moe_normalize_expert_weights": True}
        ),
        "ffn_config.moe_normalize_expert_weights",
    ),
    (changed("DBRX", ffn_config="moe"), "ffn_config"),
    (changed("Llama-4", text_config=[1, 2]), "text_config"),
]

# Values of the right type out of range: named, not passed on to fail later or run another model.
OUT_OF_RANGE = [
    (changed("Mixtral", hidden_size=0), "hidden_size"),
    (changed("Mixtral", num_experts_per_tok=9), "num_experts_per_tok"),
    (changed("Mixtral", num_experts_per_tok=0), "num_experts_per_tok"),
    (changed("DeepSeek-V3", n_group=3), "n_group"),  # does not divide 8 experts
    (changed("DeepSeek-V3", topk_group=5), "topk_group"),  # more than n_group=4
    (changed("DeepSeek-V3", routed_scaling_factor=float("nan")), "routed_scaling_factor"),
    (changed("DeepSeek-V3", n_shared_experts=-1), "n_shared_experts"),
    (changed("GPT-OSS", swiglu_limit=-1.0), "swiglu_limit"),
    (changed("NLLB-MoE", moe_token_dropout=1.5), "moe_token_dropout"),
    (changed("Switch", expert_capacity=0), "expert_capacity"),
]


@pytest.mark.parametrize("config,field", COERCED + OUT_OF_RANGE)
def test_a_field_of_the_wrong_type_or_range_is_named(config, field):
    with pytest.raises(ValueError, match=f"{field}="):
        hf.block_kwargs(config)


# Layer rules: a zero step divided by zero (or made range() fail) before.
LAYERS = [
    (changed("Qwen2-MoE", decoder_sparse_step=0), "decoder_sparse_step"),
    (changed("Qwen3-MoE", decoder_sparse_step="1"), "decoder_sparse_step"),
    (changed("DeepSeek-V3", moe_layer_freq=0), "moe_layer_freq"),
    (changed("DeepSeek-V3", first_k_dense_replace="1"), "first_k_dense_replace"),
    (changed("Jamba", expert_layer_period=0), "expert_layer_period"),
    (changed("Jamba", expert_layer_offset=2), "expert_layer_offset"),  # not below the period
    (
        changed(
            "Llama-4",
            text_config={**TINY["Llama-4"]["text_config"], "interleave_moe_layer_step": 0},
        ),
        "text_config.interleave_moe_layer_step",
    ),
    (
        changed("Llama-4", text_config={**TINY["Llama-4"]["text_config"], "moe_layers": "0"}),
        "text_config.moe_layers",
    ),
    (changed("Qwen2-MoE", mlp_only_layers=["1"]), "mlp_only_layers"),
    (changed("Mixtral", num_hidden_layers=2.0), "num_hidden_layers"),
    (changed("DBRX", n_layers="1"), "n_layers"),
    (changed("Switch", encoder_sparse_step=-1), "encoder_sparse_step"),
    (changed("NLLB-MoE", decoder_layers="2"), "decoder_layers"),
]


@pytest.mark.parametrize("config,field", LAYERS)
def test_layer_rules_name_a_bad_field(config, field):
    with pytest.raises(ValueError, match=f"{field}="):
        hf.layer_prefixes(config)


def test_model_type_of_another_type_is_named():
    for bad in (["mixtral"], 3, None):
        with pytest.raises(ValueError, match="model_type"):
            hf.block_kwargs({**TINY["Mixtral"], "model_type": bad})


# Every alias of each family's HF config class (its attribute_map, transformers 5): the spelling
# the config.json may use instead of the one the mapping reads.
ALIASES = [
    ("Mixtral", "num_local_experts", "num_experts"),
    ("Qwen3-MoE", "num_experts", "num_local_experts"),  # transformers 5 writes this one
    ("DeepSeek-V2", "n_routed_experts", "num_experts"),
    ("DeepSeek-V3", "n_routed_experts", "num_local_experts"),
    ("GLM-4.5", "n_routed_experts", "num_local_experts"),
    ("OLMoE", "num_experts", "num_local_experts"),
    ("Jamba", "num_experts", "num_local_experts"),
    ("DBRX", "d_model", "hidden_size"),
    ("DBRX", "n_layers", "num_hidden_layers"),
    ("GPT-OSS", "num_local_experts", "num_experts"),
    ("GPT-OSS", "num_experts_per_tok", "experts_per_token"),
    ("Switch", "d_model", "hidden_size"),
    ("Switch", "num_layers", "num_hidden_layers"),
    ("NLLB-MoE", "d_model", "hidden_size"),
    ("NLLB-MoE", "encoder_layers", "num_hidden_layers"),
]


@pytest.mark.parametrize("name,field,alias", ALIASES)
def test_every_alias_of_hf_config_classes_is_honoured(name, field, alias):
    config = renamed(TINY[name], field, alias)
    assert hf.block_kwargs(config) == hf.block_kwargs(TINY[name])
    assert hf.layer_prefixes(config) == hf.layer_prefixes(TINY[name])
    both = {**TINY[name], alias: TINY[name][field]}  # both spellings, one value: fine
    assert hf.block_kwargs(both) == hf.block_kwargs(TINY[name])
    with pytest.raises(ValueError, match=f"{field}=.*{alias}=|{alias}=.*{field}="):
        config = {**TINY[name], alias: TINY[name][field] + 1}
        hf.block_kwargs(config)
        hf.layer_prefixes(config)


def test_a_missing_field_names_its_aliases():
    with pytest.raises(ValueError, match="lacks 'num_experts' \\(or 'num_local_experts'\\)"):
        hf.block_kwargs(without("Qwen3-MoE", "num_experts"))


def test_gpt_oss_swiglu_alpha_is_read_not_assumed():
    assert hf.block_kwargs(TINY["GPT-OSS"])["experts"].glu_alpha == pytest.approx(1.702)
    assert hf.block_kwargs(changed("GPT-OSS", swiglu_alpha=2.0))["experts"].glu_alpha == 2.0


@pytest.mark.parametrize("size", ["43", [4], [4, 3, 1], [4, "3"], [4, 0], [True, 3], 128, None])
def test_fp8_weight_block_size_of_another_shape_is_named(size, tmp_path):
    """quantization_config.weight_block_size: two ints >= 1 (a string was split into digits)."""
    config = changed("DeepSeek-V3", quantization_config={"weight_block_size": size})
    if size is None:  # null: the default 128 x 128, as HF's quantizer reads it
        config["quantization_config"] = {"quant_method": "fp8"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    mesh = make_mesh((4,), ("ep",))
    topology = hep.Topology.from_mesh(mesh, ("ep",))
    block = hnn.MoEBlock(**hf.block_kwargs(config), mesh=mesh, topology=topology, rngs=nnx.Rngs(0))
    prefix = hf.layer_prefixes(config)[0]
    rng = np.random.default_rng(0)
    shapes = hf.tensor_shapes(block, prefix, "deepseek_v3")
    save_file(
        {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()},
        str(tmp_path / "model.safetensors"),
    )
    if size is None:
        hf.load_checkpoint(str(tmp_path), {prefix: block})
        return
    with pytest.raises(ValueError, match="quantization_config.weight_block_size="):
        hf.load_checkpoint(str(tmp_path), {prefix: block})

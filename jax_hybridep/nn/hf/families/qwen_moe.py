"""Qwen2-MoE (`qwen2_moe`) and Qwen3-MoE (`qwen3_moe`): softmax top-k routing over SwiGLU experts
of moe_intermediate_size, normalised when norm_topk_prob; Qwen2-MoE adds a shared expert behind a
sigmoid gate. One file: both place their sparse layers by the same rule (decoder_sparse_step,
mlp_only_layers) and store transformers' common per-expert and stacked layouts."""

from __future__ import annotations

from jax_hybridep.nn.hf.family import Family, layers, softmax_family
from jax_hybridep.nn.hf.tensor_layouts import PER_EXPERT, STACKED


def _qwen3_moe(c):
    return softmax_family(
        c,
        experts_key="num_experts",
        ff_key="moe_intermediate_size",
        normalize=c.flag("norm_topk_prob", False),
    )


def _qwen2_moe(c):
    s = _qwen3_moe(c)
    shared = c.integer("shared_expert_intermediate_size", low=0)
    if shared:
        s["experts"].update(shared_ff=shared, shared_gate=True)
    return s


def _layer_prefixes(c):
    step, dense = c.integer("decoder_sparse_step", 1), set(c.integers("mlp_only_layers", []))
    return layers(
        c,
        "model.layers.{i}.mlp",
        lambda i: i not in dense and (i + 1) % step == 0,
        "num_hidden_layers",
    )


FAMILIES = (
    Family(
        model_type="qwen2_moe",
        settings=_qwen2_moe,
        layer_prefixes=_layer_prefixes,
        layouts=(PER_EXPERT, STACKED),
        aliases=(),
    ),
    Family(
        model_type="qwen3_moe",
        settings=_qwen3_moe,
        layer_prefixes=_layer_prefixes,
        layouts=(PER_EXPERT, STACKED),
        aliases=(("num_experts", "num_local_experts"),),  # transformers 5 writes the second
    ),
)

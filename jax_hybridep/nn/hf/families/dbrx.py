"""DBRX (`dbrx`): softmax top-k routing, L1-normalised or not (moe_normalize_expert_weights),
over SwiGLU experts fused as w1/v1/w2 [E * F, H], its MoE settings nested in `ffn_config`."""

from __future__ import annotations

from jax_hybridep.nn.hf.family import (
    GATED_ACTIVATIONS,
    Family,
    every_layer,
    experts_and_top_k,
    settings,
)
from jax_hybridep.nn.hf.tensor_layouts import Fused, TensorLayout, in_out


def _fused(name):
    return Fused(
        f"experts.mlp.{name}",
        lambda e, d: (e * d["F"], d["H"]),
        # w1, v1 rows are [F, H] per expert ([out, in]); w2's are [F, H] as the block keeps them.
        (lambda a, d: a.reshape(-1, d["F"], d["H"]))
        if name == "w2"
        else (lambda a, d: in_out(a.reshape(-1, d["F"], d["H"]))),
        rows=lambda d: d["F"],
    )


DBRX = TensorLayout(
    "fused w1/v1/w2 [E*F, H]",
    "router.layer.weight",
    {"w_gate": _fused("w1"), "w_up": _fused("v1"), "w_down": _fused("w2")},
)


def _dbrx(c):
    ffn = c.nested("ffn_config")
    p = ffn.config.get("moe_normalize_expert_weights", 1)  # null: no normalisation
    if isinstance(p, bool) or p not in (None, 1, 1.0):
        ffn.fail("moe_normalize_expert_weights", "is not 1 or None (only the L1 norm is offered)")
    num_experts, top_k = experts_and_top_k(ffn, "moe_num_experts", "moe_top_k")
    return settings(
        c.integer("d_model"),
        dict(num_experts=num_experts, top_k=top_k, normalize=p is not None),
        dict(
            d_ff=ffn.integer("ffn_hidden_size"),
            activation=ffn.activation("ffn_act_fn", {"name": "silu"}, GATED_ACTIVATIONS),
        ),
    )


FAMILIES = (
    Family(
        model_type="dbrx",
        settings=_dbrx,
        layer_prefixes=every_layer("transformer.blocks.{i}.ffn", "n_layers"),
        layouts=(DBRX,),
        aliases=(("d_model", "hidden_size"), ("n_layers", "num_hidden_layers")),
    ),
)

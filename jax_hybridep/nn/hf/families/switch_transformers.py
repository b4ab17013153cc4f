"""Switch Transformers (`switch_transformers`): top-1 softmax routing with an optional router
bias and a per-sequence expert capacity, over non-gated experts (wi/wo) in the encoder's and
decoder's sparse blocks."""

from __future__ import annotations

from jax_hybridep.nn.hf.family import PLAIN_ACTIVATIONS, Family, layers, settings
from jax_hybridep.nn.hf.tensor_layouts import PerExpert, TensorLayout

SWITCH = TensorLayout(
    "per-expert wi/wo",
    "router.classifier.weight",
    {
        "w_up": PerExpert("experts.expert_{i}.wi.weight"),
        "w_down": PerExpert("experts.expert_{i}.wo.weight"),
    },
    logit_bias="router.classifier.bias",
)


def _switch(c):
    return settings(
        c.integer("d_model"),
        dict(
            num_experts=c.integer("num_experts"),
            top_k=1,
            normalize=False,
            logit_bias=c.flag("router_bias", False),
            group_capacity=c.integer("expert_capacity"),
            token_group="sequence",
        ),
        dict(
            d_ff=c.integer("d_ff"),
            activation=c.activation("dense_act_fn", "relu", PLAIN_ACTIVATIONS),
        ),
    )


def _sparse(step):
    """Every block when step is 1, else those with i % step == 1; none when step is 0."""
    return lambda i: step > 0 and (step == 1 or i % step == 1)


def _layer_prefixes(c):
    return layers(
        c,
        "encoder.block.{i}.layer.1.mlp",
        _sparse(c.integer("encoder_sparse_step", low=0)),
        "num_layers",
    ) + layers(
        c,
        "decoder.block.{i}.layer.2.mlp",
        _sparse(c.integer("decoder_sparse_step", low=0)),
        "num_decoder_layers",
    )


FAMILIES = (
    Family(
        model_type="switch_transformers",
        settings=_switch,
        layer_prefixes=_layer_prefixes,
        layouts=(SWITCH,),
        aliases=(("d_model", "hidden_size"), ("num_layers", "num_hidden_layers")),
    ),
)

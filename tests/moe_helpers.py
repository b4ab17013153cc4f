"""A dense MoE block written out (no dispatch): what the Flax block's tests hold it to."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_hybridep import nn as hnn


def dense_block(params, x, router_cfg, shared=None):
    """Every token through its top-k experts by einsum (no dispatch), same router."""
    t = x.reshape(-1, x.shape[-1])
    r = hnn.route(t @ params["gate"], params["bias"], router_cfg)
    out = 0.0
    for k in range(router_cfg.top_k):
        e = r.topk_idx[:, k]
        h = jax.nn.silu(jnp.einsum("nh,nhf->nf", t, params["w_gate"][e]))
        h = h * jnp.einsum("nh,nhf->nf", t, params["w_up"][e])
        out = out + r.topk_weights[:, k : k + 1] * jnp.einsum("nf,nfh->nh", h, params["w_down"][e])
    if shared is not None:
        out = out + hnn.swiglu(t, *shared)
    return out.reshape(x.shape)


def block_params(block):
    """The block's router and expert weights by name, as `dense_block` takes them."""
    return dict(
        gate=block.router.gate[...],
        bias=block.router.bias[...],
        w_gate=block.w_gate[...],
        w_up=block.w_up[...],
        w_down=block.w_down[...],
    )

"""Dense references of each HuggingFace MoE family's block, written from the family's published
definition (its modeling code's router, experts, biases, gates and shared expert), in JAX on the
family's own tensor names and layouts -- independent of jax_hybridep.nn.hf's name tables.

Every reference runs every expert on every token (experts stacked on a leading axis) and weights
by the routing (0 off the top-k), so values and gradients come from one plain program. `t` maps
names relative to the layer's MoE module to arrays; `x` is [N, H] with tokens in order.
Returns (y [N, H], ids [N, K] int32 with -1 where a capacity dropped the choice).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def lin(x, w, b=None):
    """torch.nn.Linear: x @ w.T (+ b); w [out, in]."""
    y = x @ w.T
    return y if b is None else y + b


def elin(x, w, b=None):
    """A Linear per expert: x [N, in] with w [E, out, in] (+ b [E, out]) -> [E, N, out]."""
    y = jnp.einsum("ni,eoi->eno", x, w)
    return y if b is None else y + b[:, None, :]


def stack(t, template, count):
    return jnp.stack([t[template.format(e=e)] for e in range(count)])


def swiglu_mlp(x, t, name):
    gate, up = lin(x, t[f"{name}.gate_proj.weight"]), lin(x, t[f"{name}.up_proj.weight"])
    return lin(jax.nn.silu(gate) * up, t[f"{name}.down_proj.weight"])


def combine(ids, weights, expert_out):
    """sum_e (weight of e for each token) * expert_out[e]: ids, weights [N, K]; [E, N, H]."""
    gates = jnp.sum(
        jnp.where(ids[..., None] == jnp.arange(expert_out.shape[0]), weights[..., None], 0.0), 1
    )
    return jnp.einsum("ne,enh->nh", gates, expert_out)


def softmax_topk(logits, k, normalize):
    p = jax.nn.softmax(logits, axis=-1)
    w, ids = jax.lax.top_k(p, k)
    if normalize:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return ids, w


def per_expert_swiglu(t, x, count, gate, up, down):
    """Experts stored one Linear per expert (names with {e})."""
    h = jax.nn.silu(elin(x, stack(t, gate, count))) * elin(x, stack(t, up, count))
    return jnp.einsum("enf,ehf->enh", h, stack(t, down, count))


def qwen_experts(t, x, count):
    return per_expert_swiglu(
        t,
        x,
        count,
        "experts.{e}.gate_proj.weight",
        "experts.{e}.up_proj.weight",
        "experts.{e}.down_proj.weight",
    )


def mixtral(t, x, cfg):
    ids, w = softmax_topk(lin(x, t["gate.weight"]), cfg["num_experts_per_tok"], True)
    e = cfg["num_local_experts"]
    out = per_expert_swiglu(
        t, x, e, "experts.{e}.w1.weight", "experts.{e}.w3.weight", "experts.{e}.w2.weight"
    )
    return combine(ids, w, out), ids


def qwen_moe(t, x, cfg):
    ids, w = softmax_topk(
        lin(x, t["gate.weight"]), cfg["num_experts_per_tok"], cfg.get("norm_topk_prob", False)
    )
    y = combine(ids, w, qwen_experts(t, x, cfg["num_experts"]))
    if "shared_expert.gate_proj.weight" in t:  # Qwen2-MoE: a sigmoid-gated shared expert
        gate = jax.nn.sigmoid(lin(x, t["shared_expert_gate.weight"]))
        y = y + gate * swiglu_mlp(x, t, "shared_expert")
    return y, ids


def olmoe(t, x, cfg):
    ids, w = softmax_topk(
        lin(x, t["gate.weight"]), cfg["num_experts_per_tok"], cfg.get("norm_topk_prob", False)
    )
    return combine(ids, w, qwen_experts(t, x, cfg["num_experts"])), ids


def jamba(t, x, cfg):
    ids, w = softmax_topk(lin(x, t["router.weight"]), cfg["num_experts_per_tok"], False)
    return combine(ids, w, qwen_experts(t, x, cfg["num_experts"])), ids


def group_mask(group_score, topk_group, per_group):
    n = group_score.shape[0]
    _, groups = jax.lax.top_k(group_score, topk_group)
    keep = jnp.zeros_like(group_score, bool).at[jnp.arange(n)[:, None], groups].set(True)
    return jnp.repeat(keep, per_group, axis=1)


def deepseek_v2(t, x, cfg):
    """DeepSeek-V2 gate: softmax; greedy or group-limited greedy (groups by their max score);
    the top-k weights normalised (k > 1 and norm_topk_prob) or else scaled."""
    scores = jax.nn.softmax(lin(x, t["gate.weight"]), axis=-1)
    k, n, e = cfg["num_experts_per_tok"], x.shape[0], cfg["n_routed_experts"]
    if cfg["topk_method"] == "group_limited_greedy":
        group_max = scores.reshape(n, cfg["n_group"], -1).max(axis=-1)
        mask = group_mask(group_max, cfg["topk_group"], e // cfg["n_group"])
        w, ids = jax.lax.top_k(jnp.where(mask, scores, 0.0), k)
    else:
        w, ids = jax.lax.top_k(scores, k)
    if k > 1 and cfg.get("norm_topk_prob", False):
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    else:
        w = w * cfg["routed_scaling_factor"]
    y = combine(ids, w, qwen_experts(t, x, e))
    return y + swiglu_mlp(x, t, "shared_experts"), ids


def deepseek_v3(t, x, cfg):
    """DeepSeek-V3 / GLM-4.5 gate: sigmoid; selection by score + e_score_correction_bias, groups
    ranked by the sum of their top-2; weights the raw scores, normalised, times the factor."""
    scores = jax.nn.sigmoid(lin(x, t["gate.weight"]))
    choice = scores + t["gate.e_score_correction_bias"]
    k, n, e = cfg["num_experts_per_tok"], x.shape[0], cfg["n_routed_experts"]
    if cfg["n_group"] > 1:
        grouped = choice.reshape(n, cfg["n_group"], -1)
        top2 = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
        choice = jnp.where(
            group_mask(top2, cfg["topk_group"], e // cfg["n_group"]), choice, -jnp.inf
        )
    _, ids = jax.lax.top_k(jax.lax.stop_gradient(choice), k)
    w = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.get("norm_topk_prob", True):
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    w = w * cfg["routed_scaling_factor"]
    y = combine(ids, w, qwen_experts(t, x, e))
    return y + swiglu_mlp(x, t, "shared_experts"), ids


def dbrx(t, x, cfg):
    """DBRX: softmax, top-k, weights / their L1 norm; experts in fused [E * F, H] w1, v1, w2."""
    ffn = cfg["ffn_config"]
    e, f = ffn["moe_num_experts"], ffn["ffn_hidden_size"]
    p = jax.nn.softmax(lin(x, t["router.layer.weight"]), axis=-1)
    w, ids = jax.lax.top_k(p, ffn["moe_top_k"])
    w = w / jnp.sum(jnp.abs(w), axis=-1, keepdims=True)
    w1, v1, w2 = (t[f"experts.mlp.{n}"].reshape(e, f, -1) for n in ("w1", "v1", "w2"))
    h = jax.nn.silu(elin(x, w1)) * elin(x, v1)  # x @ w1[e].T
    return combine(ids, w, jnp.einsum("enf,efh->enh", h, w2)), ids  # @ w2[e]


def granitemoe(t, x, cfg):
    """Granite-MoE: top-k of the logits, softmax over the k; input_linear [E, 2F, H] chunked
    (gate first), output_linear [E, H, F]."""
    top, ids = jax.lax.top_k(lin(x, t["router.layer.weight"]), cfg["num_experts_per_tok"])
    w = jax.nn.softmax(top, axis=-1)
    f = cfg["intermediate_size"]
    h = elin(x, t["input_linear.weight"])
    out = elin_h(jax.nn.silu(h[..., :f]) * h[..., f:], t["output_linear.weight"])
    return combine(ids, w, out), ids


def elin_h(h, w):
    """Per-expert Linear on per-expert inputs: h [E, N, in], w [E, out, in] -> [E, N, out]."""
    return jnp.einsum("eni,eoi->eno", h, w)


def llama4(t, x, cfg):
    """Llama-4: top-k of the logits, sigmoid of those; the score scales each expert's input;
    experts gate_up_proj [E, H, 2F] (gate first), down_proj [E, F, H]; plus a shared expert."""
    text = cfg.get("text_config", cfg)
    top, ids = jax.lax.top_k(lin(x, t["router.weight"]), text["num_experts_per_tok"])
    e, f = text["num_local_experts"], text["intermediate_size"]
    scores = jnp.sum(
        jnp.where(ids[..., None] == jnp.arange(e), jax.nn.sigmoid(top)[..., None], 0.0), 1
    )
    routed_in = scores.T[..., None] * x[None]  # [E, N, H]: every expert's own scaled input
    gate_up = jnp.einsum("enh,ehf->enf", routed_in, t["experts.gate_up_proj"])
    h = gate_up[..., f:] * jax.nn.silu(gate_up[..., :f])
    out = jnp.einsum("enf,efh->nh", h, t["experts.down_proj"])
    return out + swiglu_mlp(x, t, "shared_expert"), ids


def gpt_oss(t, x, cfg):
    """GPT-OSS: logits with a bias, top-k, softmax over the k; experts with interleaved gate/up
    columns and biases, gate clamped above, up clamped both sides, (up + 1) * g * sigmoid(a g)."""
    limit, alpha = cfg.get("swiglu_limit", 7.0), 1.702
    logits = lin(x, t["router.weight"], t["router.bias"])
    top, ids = jax.lax.top_k(logits, cfg["num_experts_per_tok"])
    w = jax.nn.softmax(top, axis=-1)
    gate_up = jnp.einsum("nh,ehf->enf", x, t["experts.gate_up_proj"])
    gate_up = gate_up + t["experts.gate_up_proj_bias"][:, None, :]
    gate = jnp.minimum(gate_up[..., 0::2], limit)
    up = jnp.clip(gate_up[..., 1::2], -limit, limit)
    glu = gate * jax.nn.sigmoid(gate * alpha)
    out = jnp.einsum("enf,efh->enh", (up + 1) * glu, t["experts.down_proj"])
    return combine(ids, w, out + t["experts.down_proj_bias"][:, None, :]), ids


ACTS = {
    "relu": jax.nn.relu,
    "gelu": lambda h: jax.nn.gelu(h, approximate=False),
    "gelu_new": lambda h: jax.nn.gelu(h, approximate=True),
}


def switch(t, x, cfg, seq_len):
    """Switch Transformers: softmax, top-1; per sequence an expert takes tokens in order up to
    expert_capacity (the rest get no expert); weight = the top-1 probability."""
    e = cfg["num_experts"]
    p = jax.nn.softmax(lin(x, t["router.classifier.weight"], t.get("router.classifier.bias")))
    ids = jnp.argmax(p, axis=-1)
    onehot = jax.nn.one_hot(ids, e, dtype=jnp.int32).reshape(-1, seq_len, e)
    priority = jnp.cumsum(onehot, axis=1).reshape(-1, e)
    kept = jnp.take_along_axis(priority, ids[:, None], axis=1)[:, 0] <= cfg["expert_capacity"]
    ids = jnp.where(kept, ids, -1)[:, None].astype(jnp.int32)
    w = jnp.max(p, axis=-1, keepdims=True)
    act = ACTS[cfg.get("dense_act_fn", "relu")]
    h = act(elin(x, stack(t, "experts.expert_{e}.wi.weight", e)))
    return combine(ids, w, elin_h(h, stack(t, "experts.expert_{e}.wo.weight", e))), ids


def nllb_moe(t, x, cfg, groups):
    """NLLB-MoE top-2 router over each group of tokens: top-1 by probability, top-2 by logit among
    the rest; the second choices queue after every first choice (locations2 += sum(mask1)); an
    expert keeps locations below its capacity; the kept probabilities are renormalised; the
    output is scaled by 1 - moe_token_dropout (eval)."""
    e = cfg["num_experts"]
    logits = lin(x, t["router.classifier.weight"], t.get("router.classifier.bias"))
    h = jax.nn.relu(
        elin(
            x,
            stack(t, "experts.expert_{e}.fc1.weight", e),
            stack(t, "experts.expert_{e}.fc1.bias", e),
        )
    )
    out = elin_h(h, stack(t, "experts.expert_{e}.fc2.weight", e))
    out = out + stack(t, "experts.expert_{e}.fc2.bias", e)[:, None, :]
    all_ids, all_w = [], []
    for g_logits in jnp.split(logits, groups):
        n = g_logits.shape[0]
        p = jax.nn.softmax(g_logits, axis=-1)
        top1 = jnp.argmax(p, axis=-1)
        mask1 = jax.nn.one_hot(top1, e, dtype=jnp.int32)
        top2 = jnp.argmax(jnp.where(mask1 > 0, -jnp.inf, g_logits), axis=-1)
        mask2 = jax.nn.one_hot(top2, e, dtype=jnp.int32)
        loc1 = jnp.cumsum(mask1, axis=0) - 1
        loc2 = jnp.cumsum(mask2, axis=0) - 1 + jnp.sum(mask1, axis=0, keepdims=True)
        capacity = cfg.get("expert_capacity") or 2 * -(-n // e)
        mask1 = mask1 * (loc1 < capacity)
        mask2 = mask2 * (loc2 < capacity)
        p1, p2 = jnp.sum(p * mask1, axis=1), jnp.sum(p * mask2, axis=1)
        denom = jnp.maximum(p1 + p2, jnp.finfo(jnp.float32).eps)
        all_ids.append(
            jnp.stack(
                [jnp.where(mask1.sum(1) > 0, top1, -1), jnp.where(mask2.sum(1) > 0, top2, -1)], 1
            ).astype(jnp.int32)
        )
        all_w.append(jnp.stack([p1 / denom, p2 / denom], axis=1))
    ids, w = jnp.concatenate(all_ids), jnp.concatenate(all_w)
    return combine(ids, w, out) * (1 - cfg.get("moe_token_dropout", 0.0)), ids

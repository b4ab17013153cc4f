"""Dense references of each HuggingFace MoE family's block, written from the family's published
definition (its modeling code's router, experts, biases, gates and shared expert), in JAX on the
family's own tensor names and layouts -- independent of jax_hybridep.nn.hf's name tables.

Every reference runs every expert on every token and weights by the routing (0 off the top-k), so
values and gradients come from one plain program. `t` maps names relative to the layer's MoE
module to arrays; `x` is [N, H] with tokens in order (N = groups x tokens per group).
Returns (y [N, H], ids [N, K] int32 with -1 where a capacity dropped the choice).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def lin(x, w, b=None):
    """torch.nn.Linear: x @ w.T (+ b); w [out, in]."""
    y = x @ w.T
    return y if b is None else y + b


def swiglu_mlp(x, t, name):
    return lin(
        jax.nn.silu(lin(x, t[f"{name}.gate_proj.weight"])) * lin(x, t[f"{name}.up_proj.weight"]),
        t[f"{name}.down_proj.weight"],
    )


def weighted_sum(x, ids, weights, num_experts, expert):
    """sum_e (weight of e for each token) * expert(e, x): the dense MoE."""
    out = jnp.zeros_like(x)
    for e in range(num_experts):
        w_e = jnp.sum(jnp.where(ids == e, weights, 0.0), axis=1)
        out = out + w_e[:, None] * expert(e, x)
    return out


def softmax_topk(logits, k, normalize):
    p = jax.nn.softmax(logits, axis=-1)
    w, ids = jax.lax.top_k(p, k)
    if normalize:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return ids, w


def per_expert_swiglu(gate, up, down):
    """Experts stored per expert as linears: names with {e}."""

    def expert(t):
        return lambda e, x: lin(
            jax.nn.silu(lin(x, t[gate.format(e=e)])) * lin(x, t[up.format(e=e)]),
            t[down.format(e=e)],
        )

    return expert


QWEN_EXPERT = per_expert_swiglu(
    "experts.{e}.gate_proj.weight", "experts.{e}.up_proj.weight", "experts.{e}.down_proj.weight"
)


def mixtral(t, x, cfg):
    ids, w = softmax_topk(lin(x, t["gate.weight"]), cfg["num_experts_per_tok"], True)
    expert = per_expert_swiglu(
        "experts.{e}.w1.weight", "experts.{e}.w3.weight", "experts.{e}.w2.weight"
    )(t)
    return weighted_sum(x, ids, w, cfg["num_local_experts"], expert), ids


def qwen_moe(t, x, cfg):
    ids, w = softmax_topk(
        lin(x, t["gate.weight"]), cfg["num_experts_per_tok"], cfg.get("norm_topk_prob", False)
    )
    y = weighted_sum(x, ids, w, cfg["num_experts"], QWEN_EXPERT(t))
    if "shared_expert.gate_proj.weight" in t:  # Qwen2-MoE: a sigmoid-gated shared expert
        y = y + jax.nn.sigmoid(lin(x, t["shared_expert_gate.weight"])) * swiglu_mlp(
            x, t, "shared_expert"
        )
    return y, ids


def olmoe(t, x, cfg):
    ids, w = softmax_topk(
        lin(x, t["gate.weight"]), cfg["num_experts_per_tok"], cfg.get("norm_topk_prob", False)
    )
    return weighted_sum(x, ids, w, cfg["num_experts"], QWEN_EXPERT(t)), ids


def jamba(t, x, cfg):
    ids, w = softmax_topk(lin(x, t["router.weight"]), cfg["num_experts_per_tok"], False)
    return weighted_sum(x, ids, w, cfg["num_experts"], QWEN_EXPERT(t)), ids


def deepseek_v2(t, x, cfg):
    """DeepSeek-V2 gate: softmax; greedy or group-limited greedy (groups by their max score);
    the top-k weights normalised (k > 1 and norm_topk_prob) or else scaled."""
    scores = jax.nn.softmax(lin(x, t["gate.weight"]), axis=-1)
    k, n = cfg["num_experts_per_tok"], x.shape[0]
    if cfg["topk_method"] == "group_limited_greedy":
        group_max = scores.reshape(n, cfg["n_group"], -1).max(axis=-1)
        _, groups = jax.lax.top_k(group_max, cfg["topk_group"])
        keep = jnp.zeros_like(group_max, bool).at[jnp.arange(n)[:, None], groups].set(True)
        mask = jnp.repeat(keep, cfg["n_routed_experts"] // cfg["n_group"], axis=1)
        w, ids = jax.lax.top_k(jnp.where(mask, scores, 0.0), k)
    else:
        w, ids = jax.lax.top_k(scores, k)
    if k > 1 and cfg.get("norm_topk_prob", False):
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    else:
        w = w * cfg["routed_scaling_factor"]
    y = weighted_sum(x, ids, w, cfg["n_routed_experts"], QWEN_EXPERT(t))
    return y + swiglu_mlp(x, t, "shared_experts"), ids


def deepseek_v3(t, x, cfg):
    """DeepSeek-V3 / GLM-4.5 gate: sigmoid; selection by score + e_score_correction_bias, groups
    ranked by the sum of their top-2; weights the raw scores, normalised, times the factor."""
    scores = jax.nn.sigmoid(lin(x, t["gate.weight"]))
    choice = scores + t["gate.e_score_correction_bias"]
    k, n = cfg["num_experts_per_tok"], x.shape[0]
    if cfg["n_group"] > 1:
        grouped = choice.reshape(n, cfg["n_group"], -1)
        group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
        _, groups = jax.lax.top_k(group_score, cfg["topk_group"])
        keep = jnp.zeros_like(group_score, bool).at[jnp.arange(n)[:, None], groups].set(True)
        mask = jnp.repeat(keep, cfg["n_routed_experts"] // cfg["n_group"], axis=1)
        choice = jnp.where(mask, choice, -jnp.inf)
    _, ids = jax.lax.top_k(jax.lax.stop_gradient(choice), k)
    w = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.get("norm_topk_prob", True):
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    w = w * cfg["routed_scaling_factor"]
    y = weighted_sum(x, ids, w, cfg["n_routed_experts"], QWEN_EXPERT(t))
    return y + swiglu_mlp(x, t, "shared_experts"), ids


def dbrx(t, x, cfg):
    """DBRX: softmax, top-k, weights / their L1 norm; experts in fused [E * F, H] w1, v1, w2."""
    ffn = cfg["ffn_config"]
    e_count, f = ffn["moe_num_experts"], ffn["ffn_hidden_size"]
    p = jax.nn.softmax(lin(x, t["router.layer.weight"]), axis=-1)
    w, ids = jax.lax.top_k(p, ffn["moe_top_k"])
    w = w / jnp.sum(jnp.abs(w), axis=-1, keepdims=True)
    w1, v1, w2 = (t[f"experts.mlp.{n}"].reshape(e_count, f, -1) for n in ("w1", "v1", "w2"))

    def expert(e, x):
        return (jax.nn.silu(x @ w1[e].T) * (x @ v1[e].T)) @ w2[e]

    return weighted_sum(x, ids, w, e_count, expert), ids


def granitemoe(t, x, cfg):
    """Granite-MoE: top-k of the logits, softmax over the k; input_linear [E, 2F, H] chunked
    (gate first), output_linear [E, H, F]."""
    top, ids = jax.lax.top_k(lin(x, t["router.layer.weight"]), cfg["num_experts_per_tok"])
    w = jax.nn.softmax(top, axis=-1)
    f = cfg["intermediate_size"]

    def expert(e, x):
        h = lin(x, t["input_linear.weight"][e])
        return lin(jax.nn.silu(h[:, :f]) * h[:, f:], t["output_linear.weight"][e])

    return weighted_sum(x, ids, w, cfg["num_local_experts"], expert), ids


def llama4(t, x, cfg):
    """Llama-4: top-k of the logits, sigmoid of those; the score scales each expert's input;
    experts gate_up_proj [E, H, 2F] (gate first), down_proj [E, F, H]; plus a shared expert."""
    text = cfg.get("text_config", cfg)
    logits = lin(x, t["router.weight"])
    top, ids = jax.lax.top_k(logits, text["num_experts_per_tok"])
    f = text["intermediate_size"]
    out = swiglu_mlp(x, t, "shared_expert")
    for e in range(text["num_local_experts"]):
        score = jnp.sum(jnp.where(ids == e, jax.nn.sigmoid(top), 0.0), axis=1)
        gate_up = (x * score[:, None]) @ t["experts.gate_up_proj"][e]
        out = out + (gate_up[:, f:] * jax.nn.silu(gate_up[:, :f])) @ t["experts.down_proj"][e]
    return out, ids


def gpt_oss(t, x, cfg):
    """GPT-OSS: logits with a bias, top-k, softmax over the k; experts with interleaved gate/up
    columns and biases, gate clamped above, up clamped both sides, (up + 1) * g * sigmoid(a g)."""
    limit, alpha = cfg.get("swiglu_limit", 7.0), 1.702
    top, ids = jax.lax.top_k(
        lin(x, t["router.weight"], t["router.bias"]), cfg["num_experts_per_tok"]
    )
    w = jax.nn.softmax(top, axis=-1)

    def expert(e, x):
        gate_up = x @ t["experts.gate_up_proj"][e] + t["experts.gate_up_proj_bias"][e]
        gate = jnp.minimum(gate_up[:, 0::2], limit)
        up = jnp.clip(gate_up[:, 1::2], -limit, limit)
        glu = gate * jax.nn.sigmoid(gate * alpha)
        return ((up + 1) * glu) @ t["experts.down_proj"][e] + t["experts.down_proj_bias"][e]

    return weighted_sum(x, ids, w, cfg["num_local_experts"], expert), ids


ACTS = {
    "relu": jax.nn.relu,
    "gelu": lambda h: jax.nn.gelu(h, approximate=False),
    "gelu_new": lambda h: jax.nn.gelu(h, approximate=True),
}


def switch(t, x, cfg, seq_len):
    """Switch Transformers: softmax, top-1; per sequence an expert takes tokens in order up to
    expert_capacity (the rest get no expert); weight = the top-1 probability."""
    p = jax.nn.softmax(lin(x, t["router.classifier.weight"], t.get("router.classifier.bias")))
    ids = jnp.argmax(p, axis=-1)
    onehot = jax.nn.one_hot(ids, cfg["num_experts"], dtype=jnp.int32).reshape(
        -1, seq_len, cfg["num_experts"]
    )
    priority = jnp.cumsum(onehot, axis=1).reshape(-1, cfg["num_experts"])
    kept = jnp.take_along_axis(priority, ids[:, None], axis=1)[:, 0] <= cfg["expert_capacity"]
    ids = jnp.where(kept, ids, -1)[:, None].astype(jnp.int32)
    w = jnp.max(p, axis=-1, keepdims=True)
    act = ACTS[cfg.get("dense_act_fn", "relu")]

    def expert(e, x):
        return lin(
            act(lin(x, t[f"experts.expert_{e}.wi.weight"])), t[f"experts.expert_{e}.wo.weight"]
        )

    return weighted_sum(x, ids, w, cfg["num_experts"], expert), ids


def nllb_moe(t, x, cfg, groups):
    """NLLB-MoE top-2 router over each group of tokens: top-1 by probability, top-2 by logit among
    the rest; the second choices queue after every first choice (locations2 += sum(mask1)); an
    expert keeps locations below its capacity; the kept probabilities are renormalised; the
    output is scaled by 1 - moe_token_dropout (eval)."""
    e_count = cfg["num_experts"]
    logits = lin(x, t["router.classifier.weight"], t.get("router.classifier.bias"))
    out_ids, out_y = [], []
    for g_logits, g_x in zip(jnp.split(logits, groups), jnp.split(x, groups), strict=True):
        n = g_x.shape[0]
        p = jax.nn.softmax(g_logits, axis=-1)
        top1 = jnp.argmax(p, axis=-1)
        mask1 = jax.nn.one_hot(top1, e_count, dtype=jnp.int32)
        top2 = jnp.argmax(jnp.where(mask1 > 0, -jnp.inf, g_logits), axis=-1)
        mask2 = jax.nn.one_hot(top2, e_count, dtype=jnp.int32)
        loc1 = jnp.cumsum(mask1, axis=0) - 1
        loc2 = jnp.cumsum(mask2, axis=0) - 1 + jnp.sum(mask1, axis=0, keepdims=True)
        if cfg.get("expert_capacity") is not None:
            capacity = cfg["expert_capacity"]
        else:
            capacity = 2 * -(-n // e_count)
        mask1 = mask1 * (loc1 < capacity)
        mask2 = mask2 * (loc2 < capacity)
        p1, p2 = jnp.sum(p * mask1, axis=1), jnp.sum(p * mask2, axis=1)
        denom = jnp.maximum(p1 + p2, jnp.finfo(jnp.float32).eps)
        ids = jnp.stack(
            [jnp.where(mask1.sum(1) > 0, top1, -1), jnp.where(mask2.sum(1) > 0, top2, -1)], 1
        )
        w = jnp.stack([p1 / denom, p2 / denom], axis=1)

        def expert(e, x):
            h = jax.nn.relu(
                lin(x, t[f"experts.expert_{e}.fc1.weight"], t[f"experts.expert_{e}.fc1.bias"])
            )
            return lin(h, t[f"experts.expert_{e}.fc2.weight"], t[f"experts.expert_{e}.fc2.bias"])

        y = weighted_sum(g_x, ids, w, e_count, expert) * (1 - cfg.get("moe_token_dropout", 0.0))
        out_ids.append(ids.astype(jnp.int32))
        out_y.append(y)
    return jnp.concatenate(out_y), jnp.concatenate(out_ids)

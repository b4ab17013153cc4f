"""nn.hf without compiling a block's program: config.json -> block settings per family, where
the MoE layers are, safetensors checkpoints (sharded index, bf16, transformers' in-memory
stacked layout, a replica placement), per-shard reads, one error naming every problem, and HF's
pooled load-balancing loss against its definition."""

import json
import types

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from harness import make_mesh
from safetensors.numpy import save_file

import jax_hybridep as hep
from examples.hf_moe_layer import TINY
from jax_hybridep import balance
from jax_hybridep import nn as hnn
from jax_hybridep.nn import hf

# What each family's tiny config maps to (the fields that differ from the defaults).
EXPECTED = {
    "Mixtral": ({"top_k": 2}, {}),
    "Qwen2-MoE": ({"normalize": False}, {"shared_ff": 16, "shared_gate": True}),
    "Qwen3-MoE": ({"top_k": 3}, {}),
    "DeepSeek-V2": (
        {
            "num_groups": 4,
            "topk_groups": 2,
            "group_score": "max",
            "normalize": False,
            "routed_scale": 2.5,
        },
        {"shared_ff": 16},
    ),
    "DeepSeek-V2-Lite": ({"top_k": 3, "normalize": False, "num_groups": None}, {"shared_ff": 16}),
    "DeepSeek-V3": (
        {
            "score_fn": "sigmoid",
            "num_groups": 4,
            "topk_groups": 2,
            "group_score": "top2_sum",
            "routed_scale": 2.5,
        },
        {"shared_ff": 8},
    ),
    "GLM-4.5": ({"score_fn": "sigmoid", "num_groups": None, "routed_scale": 1.5}, {"shared_ff": 8}),
    "OLMoE": ({"normalize": False}, {}),
    "Jamba": ({"normalize": False}, {}),
    "DBRX": ({"normalize": True}, {}),
    "Granite-MoE": ({"normalize": True}, {}),
    "Llama-4": (
        {"top_k": 1, "score_fn": "sigmoid", "normalize": False},
        {"shared_ff": 8, "weight_input": True},
    ),
    "GPT-OSS": (
        {"logit_bias": True},
        {"activation": "clamped_swiglu", "glu_limit": 1.0, "expert_bias": True},
    ),
    "Switch": (
        {
            "top_k": 1,
            "normalize": False,
            "logit_bias": True,
            "group_capacity": 2,
            "token_group": "sequence",
        },
        {"activation": "relu"},
    ),
    "NLLB-MoE": (
        {
            "top_k": 2,
            "logit_bias": True,
            "group_capacity_factor": 1.0,
            "token_group": "shard",
            "renormalize_after_drops": True,
            "routed_scale": pytest.approx(0.8),
        },
        {"activation": "relu", "expert_bias": True},
    ),
}


@pytest.mark.parametrize("name", list(TINY))
def test_block_kwargs_per_family(name):
    kwargs = hf.block_kwargs(TINY[name], dtype=jnp.bfloat16)
    assert kwargs["d_model"] == 8
    assert (kwargs["router"].num_experts, kwargs["experts"].d_ff) == (8, 8)
    assert kwargs["experts"].dtype == jnp.bfloat16
    router, experts = EXPECTED[name]
    for field, want in router.items():
        assert getattr(kwargs["router"], field) == want, (name, field)
    for field, want in experts.items():
        assert getattr(kwargs["experts"], field) == want, (name, field)


def test_layer_prefixes_follow_each_family_rule():
    cases = {
        "Qwen2-MoE": (
            dict(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3]),
            ["model.layers.1.mlp", "model.layers.5.mlp"],
        ),
        "DeepSeek-V3": (
            dict(num_hidden_layers=4, first_k_dense_replace=2),
            ["model.layers.2.mlp", "model.layers.3.mlp"],
        ),
        "Jamba": (
            dict(num_hidden_layers=6),
            [
                "model.layers.1.feed_forward",
                "model.layers.3.feed_forward",
                "model.layers.5.feed_forward",
            ],
        ),
        "DBRX": (dict(n_layers=2), ["transformer.blocks.0.ffn", "transformer.blocks.1.ffn"]),
        "Switch": (
            dict(num_layers=4, num_decoder_layers=2),
            [
                "encoder.block.1.layer.1.mlp",
                "encoder.block.3.layer.1.mlp",
                "decoder.block.1.layer.2.mlp",
            ],
        ),
        "NLLB-MoE": (
            dict(encoder_layers=4, decoder_layers=2),
            [
                "model.encoder.layers.1.ffn",
                "model.encoder.layers.3.ffn",
                "model.decoder.layers.1.ffn",
            ],
        ),
    }
    for name, (overrides, want) in cases.items():
        assert hf.layer_prefixes({**TINY[name], **overrides}) == want, name
    assert hf.layer_prefixes({**TINY["Jamba"], "num_experts": 1}) == []  # every MLP dense
    for name, field in (
        ("DeepSeek-V3", "first_k_dense_replace"),
        ("GLM-4.5", "first_k_dense_replace"),
        ("Jamba", "expert_layer_period"),
        ("Jamba", "expert_layer_offset"),
    ):
        with pytest.raises(ValueError, match=f"lacks '{field}'"):
            hf.layer_prefixes({k: v for k, v in TINY[name].items() if k != field})
    dbrx = {
        **TINY["DBRX"],
        "ffn_config": {**TINY["DBRX"]["ffn_config"], "moe_normalize_expert_weights": None},
    }
    assert hf.block_kwargs(dbrx)["router"].normalize is False  # null: no normalisation
    text = {
        **TINY["Llama-4"]["text_config"],
        "num_hidden_layers": 4,
        "interleave_moe_layer_step": 2,
    }
    assert hf.layer_prefixes({"model_type": "llama4", "text_config": text}) == [
        "language_model.model.layers.1.feed_forward",
        "language_model.model.layers.3.feed_forward",
    ]
    assert hf.layer_prefixes({**text, "model_type": "llama4_text", "moe_layers": [0]}) == [
        "model.layers.0.feed_forward"
    ]


@pytest.mark.parametrize(
    "config,error,match",
    [
        ({"model_type": "llama"}, ValueError, "unknown model_type 'llama'"),
        ([("model_type", "mixtral")], TypeError, "config must be a dict"),
        ({**TINY["Mixtral"], "num_local_experts": None}, ValueError, "lacks 'num_local_experts'"),
        ({**TINY["Mixtral"], "hidden_act": "tanh"}, ValueError, "hidden_act='tanh'"),
        (
            {
                **TINY["DBRX"],
                "ffn_config": {**TINY["DBRX"]["ffn_config"], "moe_normalize_expert_weights": 2},
            },
            ValueError,
            "moe_normalize_expert_weights=2",
        ),
        ({**TINY["DeepSeek-V2"], "topk_method": "noaux_tc"}, ValueError, "topk_method"),
        (
            {**TINY["NLLB-MoE"], "second_expert_policy": "sampling"},
            ValueError,
            "second_expert_policy='sampling'",
        ),
        (
            {**TINY["NLLB-MoE"], "moe_eval_capacity_token_fraction": 0.5},
            ValueError,
            "moe_eval_capacity_token_fraction=0.5",
        ),
        (
            {**TINY["NLLB-MoE"], "batch_prioritized_routing": True},
            ValueError,
            "batch_prioritized_routing",
        ),
        (
            {**TINY["DBRX"], "ffn_config": {"moe_top_k": 2}},
            ValueError,
            "lacks 'ffn_config.moe_num_experts'",
        ),
        (
            {
                k: v
                for k, v in TINY["GPT-OSS"].items()
                if k not in ("num_experts_per_tok", "experts_per_token")
            },
            ValueError,
            r"lacks 'num_experts_per_tok' \(or 'experts_per_token'\)",
        ),
        # Fields whose HF default differs by family are required (not read as another model).
        *[
            ({k: v for k, v in TINY[family].items() if k != field}, ValueError, f"lacks '{field}'")
            for family, fields in (
                ("DeepSeek-V3", ("n_group", "routed_scaling_factor", "n_shared_experts")),
                ("GLM-4.5", ("n_group", "routed_scaling_factor", "n_shared_experts")),
                ("Qwen2-MoE", ("shared_expert_intermediate_size",)),
            )
            for field in fields
        ],
    ],
)
def test_config_errors_name_the_field(config, error, match):
    with pytest.raises(error, match=match):
        hf.block_kwargs(config)


def build(name, mesh_shape=(4,), axes=("ep",), **overrides):
    kwargs = hf.block_kwargs(TINY[name])
    mesh = make_mesh(mesh_shape, axes)
    return hnn.MoEBlock(
        **kwargs,
        mesh=mesh,
        topology=hep.Topology.from_mesh(mesh, axes),
        rngs=nnx.Rngs(0),
        **overrides,
    )


def random_tensors(block, prefix, model_type, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    shapes = hf.tensor_shapes(block, prefix, model_type)
    return {k: rng.normal(size=s).astype(dtype) for k, s in shapes.items()}


def params(block):
    return {
        "/".join(map(str, path)): np.asarray(v)
        for path, v in nnx.to_flat_state(nnx.state(block, nnx.Param))
    }


def test_checkpoint_directory_with_a_sharded_index_in_bf16(tmp_path):
    """Two layers of GPT-OSS (fused, interleaved, biases) in bf16 across two files and an index;
    load_checkpoint(dir, blocks) equals load_block from the arrays."""
    config = {**TINY["GPT-OSS"], "num_hidden_layers": 2}
    prefixes = hf.layer_prefixes(config)
    blocks = [build("GPT-OSS") for _ in prefixes]
    tensors = {}
    for i, (prefix, block) in enumerate(zip(prefixes, blocks, strict=True)):
        tensors.update(random_tensors(block, prefix, "gpt_oss", ml_dtypes.bfloat16, seed=i))
    files = {name: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, name in enumerate(tensors)}
    for file in set(files.values()):
        save_file({n: t for n, t in tensors.items() if files[n] == file}, str(tmp_path / file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": files}))
    (tmp_path / "config.json").write_text(json.dumps(config))
    layouts = hf.load_checkpoint(str(tmp_path), blocks)
    assert list(layouts) == prefixes
    for prefix, block in zip(prefixes, blocks, strict=True):
        want = build("GPT-OSS")
        hf.load_block(want, tensors, prefix)
        for key, value in params(want).items():
            np.testing.assert_array_equal(params(block)[key], value, err_msg=key)
    # The interleaved columns: gate at even, up at odd positions of gate_up_proj.
    gate_up = tensors[f"{prefixes[1]}.experts.gate_up_proj"].astype(np.float32)
    np.testing.assert_array_equal(np.asarray(blocks[1].w_gate[...]), gate_up[..., 0::2])
    np.testing.assert_array_equal(
        np.asarray(blocks[1].b_up[...]),
        tensors[f"{prefixes[1]}.experts.gate_up_proj_bias"][:, 1::2].astype(np.float32),
    )


def to_stacked(tensors, prefix, num_experts, names):
    """The per-expert hub layout -> transformers' in-memory stacked one (gate_up [E, 2F, H])."""
    gate, up, down = names
    out = {k: v for k, v in tensors.items() if ".experts." not in k}

    def stack(n):
        return np.stack([tensors[f"{prefix}.experts.{e}.{n}.weight"] for e in range(num_experts)])

    out[f"{prefix}.experts.gate_up_proj"] = np.concatenate([stack(gate), stack(up)], axis=1)
    out[f"{prefix}.experts.down_proj"] = stack(down)
    return out


@pytest.mark.parametrize(
    "name,names",
    [
        ("Mixtral", ("w1", "w3", "w2")),
        ("Qwen2-MoE", ("gate_proj", "up_proj", "down_proj")),
        ("DeepSeek-V3", ("gate_proj", "up_proj", "down_proj")),
        ("Jamba", ("gate_proj", "up_proj", "down_proj")),
    ],
)
def test_stacked_layout_loads_like_the_per_expert_one(name, names):
    config = TINY[name]
    prefix = hf.layer_prefixes(config)[0]
    block, stacked_block = build(name), build(name)
    tensors = random_tensors(block, prefix, config["model_type"])
    assert hf.load_block(block, tensors, prefix).startswith("per-expert")
    stacked = to_stacked(tensors, prefix, 8, names)
    assert hf.load_block(stacked_block, stacked, prefix).startswith("stacked")
    for key, value in params(block).items():
        np.testing.assert_array_equal(params(stacked_block)[key], value, err_msg=key)


class Recorder(dict):
    """Tensors that record every read: (name, rows read or 'all')."""

    def __init__(self, tensors):
        super().__init__(tensors)
        self.reads = []

    def __getitem__(self, name):
        parent, reads = dict.__getitem__(self, name), self.reads

        class Reader:
            shape = parent.shape

            def __getitem__(self, index):
                reads.append((name, "all" if index is Ellipsis else (index.start, index.stop)))
                return parent[index]

        return Reader()


def test_experts_are_read_per_shard_in_the_placement_order():
    """Each expert is read by its own shard only (fused tensors: by row slices, never whole),
    in a replica placement's storage order."""
    ranks = [[3, 0], [1, 6], [5, 2], [7, 4]]  # a scattered placement of 8 experts on 4 ranks
    placement = balance.Placement(tuple(map(tuple, ranks)), 2)
    block = build("DBRX", balance=balance.BalanceConfig(placement=placement))
    plain = build("DBRX")
    prefix = hf.layer_prefixes(TINY["DBRX"])[0]
    tensors = random_tensors(plain, prefix, "dbrx")
    recorder = Recorder(tensors)
    hf.load_block(block, recorder, prefix)
    hf.load_block(plain, tensors, prefix)
    w1_reads = sorted(r for n, r in recorder.reads if n.endswith("w1"))
    assert w1_reads == [(8 * e, 8 * e + 8) for e in range(8)]  # one [F, H] slice per expert
    order = np.asarray(ranks).reshape(-1)
    for name in ("w_gate", "w_up", "w_down"):
        np.testing.assert_array_equal(
            np.asarray(getattr(block, name)[...]), np.asarray(getattr(plain, name)[...])[order]
        )


def test_load_errors_name_every_problem():
    block = build("Mixtral")
    prefix = "model.layers.0.block_sparse_moe"
    tensors = random_tensors(block, prefix, "mixtral")
    broken = {k: v for k, v in tensors.items() if not k.endswith("experts.3.w2.weight")}
    broken[f"{prefix}.experts.5.w1.weight"] = np.zeros((8, 9), np.float32)
    before = params(block)
    with pytest.raises(ValueError) as info:
        hf.load_block(block, broken, prefix)
    message = str(info.value)
    assert "missing tensor 'model.layers.0.block_sparse_moe.experts.3.w2.weight'" in message
    assert "experts.5.w1.weight' has shape (8, 9), expected (8, 8)" in message
    for key, value in params(block).items():  # checked before anything was set
        np.testing.assert_array_equal(value, before[key], err_msg=key)
    with pytest.raises(ValueError, match="unknown model_type 'mistral'"):
        hf.load_block(block, tensors, prefix, model_type="mistral")
    with pytest.raises(ValueError, match="no known MoE layout under prefix 'model.layers.1.mlp'"):
        hf.load_block(block, tensors, "model.layers.1.mlp")
    # GPT-OSS tensors into a block without their biases: named, not ignored.
    gpt = build("GPT-OSS")
    gpt_tensors = random_tensors(gpt, "model.layers.0.mlp", "gpt_oss")
    plain = hnn.MoEBlock(
        **{**hf.block_kwargs(TINY["Mixtral"]), "d_model": 8},
        mesh=gpt.mesh,
        topology=gpt.topology,
        rngs=nnx.Rngs(0),
    )
    with pytest.raises(ValueError, match="router.bias' but the block has no router logit bias"):
        hf.load_block(plain, gpt_tensors, "model.layers.0.mlp")
    with pytest.raises(ValueError, match="no such safetensors file"):
        hf.load_checkpoint("/nonexistent/model.safetensors", {prefix: block})


def test_pooled_load_balancing_loss_is_hf_definition():
    """HF: concatenate every layer's router logits; E * sum over (k, e) of the fraction of
    tokens whose k-th choice is e times the mean softmax probability of e."""
    rng = np.random.default_rng(3)
    cfg = hnn.RouterConfig(num_experts=6, top_k=2)
    logits = [rng.normal(size=(20, 6)).astype(np.float32) for _ in range(3)]
    outs = [hnn.route(jnp.asarray(l), jnp.zeros(6), cfg) for l in logits]  # noqa: E741
    auxes = [types.SimpleNamespace(tokens_per_expert=o.load, router_probs=o.probs) for o in outs]
    pooled = np.concatenate(logits)
    p = np.exp(pooled) / np.exp(pooled).sum(1, keepdims=True)
    top = np.argsort(-p, axis=1)[:, :2]
    mask = np.eye(6)[top]  # [N, K, E]
    want = 6 * np.sum(mask.mean(0) * p.mean(0)[None])
    np.testing.assert_allclose(hf.load_balancing_loss(auxes, top_k=2), want, rtol=1e-5)
    # One layer: top_k times the router's own loss over the same tokens.
    np.testing.assert_allclose(
        hf.load_balancing_loss(auxes[:1], top_k=2), 2 * outs[0].aux_loss, rtol=1e-5
    )


def e2m1(code):
    """An E2M1 value from its bits: sign, 2 exponent bits (bias 1), 1 mantissa bit."""
    sign = -1.0 if code & 8 else 1.0
    exponent, mantissa = (code >> 1) & 3, code & 1
    if exponent == 0:
        return sign * 0.5 * mantissa  # subnormal
    return sign * (1 + 0.5 * mantissa) * 2.0 ** (exponent - 1)


def test_gpt_oss_mxfp4_files_load_as_their_decoded_values():
    """GPT-OSS's released layout (expert weights in MXFP4: 4-bit E2M1 pairs per byte, low nibble
    first, one E8M0 scale per 32 inputs) loads as the dense bf16 layout of the decoded values."""
    config = {**TINY["GPT-OSS"], "hidden_size": 32, "intermediate_size": 32}
    kwargs = hf.block_kwargs(config)
    mesh = make_mesh((4,), ("ep",))
    topology = hep.Topology.from_mesh(mesh, ("ep",))
    blocks = [hnn.MoEBlock(**kwargs, mesh=mesh, topology=topology, rngs=nnx.Rngs(0)) for _ in "ab"]
    prefix = "model.layers.0.mlp"
    dense = random_tensors(blocks[0], prefix, "gpt_oss")
    rng = np.random.default_rng(7)
    packed = {k: v for k, v in dense.items() if not k.endswith(("gate_up_proj", "down_proj"))}
    decode = np.vectorize(e2m1)
    for proj, (out, inp) in {"gate_up_proj": (64, 32), "down_proj": (32, 32)}.items():
        codes = rng.integers(0, 16, size=(8, out, inp), dtype=np.uint8)
        scales = rng.integers(120, 134, size=(8, out, inp // 32), dtype=np.uint8)
        pairs = codes.reshape(8, out, inp // 32, 16, 2)
        packed[f"{prefix}.experts.{proj}_blocks"] = pairs[..., 0] | (pairs[..., 1] << 4)
        packed[f"{prefix}.experts.{proj}_scales"] = scales
        values = decode(codes) * 2.0 ** (np.repeat(scales, 32, axis=-1).astype(np.float64) - 127)
        dense[f"{prefix}.experts.{proj}"] = np.swapaxes(values, 1, 2).astype(np.float32)
    assert hf.load_block(blocks[0], packed, prefix).startswith("mxfp4")
    hf.load_block(blocks[1], dense, prefix)
    for key, value in params(blocks[1]).items():
        np.testing.assert_array_equal(params(blocks[0])[key], value, err_msg=key)


def test_deepseek_v3_fp8_files_load_as_their_dequantized_values(tmp_path):
    """DeepSeek-V3's released format: the expert and shared-expert weights float8 e4m3 with a
    float32 scale per block (config's weight_block_size; 4 x 3 here, so edge blocks are partial)
    load as value x scale, from safetensors files and from arrays; a float8 weight without its
    scales, or scales of another block size, is refused."""
    config = {
        **TINY["DeepSeek-V3"],
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [4, 3]},
    }
    prefix = hf.layer_prefixes(config)[0]
    blocks = [build("DeepSeek-V3") for _ in range(3)]
    dense = random_tensors(blocks[0], prefix, "deepseek_v3")
    rng = np.random.default_rng(3)
    stored = dict(dense)
    for name, value in dense.items():
        if not name.endswith("proj.weight"):  # the router stays unquantized, as released
            continue
        out, inp = value.shape
        scale = rng.uniform(0.01, 0.1, size=(-(-out // 4), -(-inp // 3))).astype(np.float32)
        full = np.repeat(np.repeat(scale, 4, 0), 3, 1)[:out, :inp]
        stored[name] = (value / full).astype(ml_dtypes.float8_e4m3fn)
        stored[name + "_scale_inv"] = scale
        dense[name] = stored[name].astype(np.float32) * full
    save_file(stored, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert hf.load_checkpoint(str(tmp_path), {prefix: blocks[0]})[prefix].startswith("per-expert")
    hf.load_block(blocks[1], stored, prefix, fp8_block=(4, 3))
    want = build("DeepSeek-V3")
    hf.load_block(want, dense, prefix)
    for key, value in params(want).items():
        np.testing.assert_array_equal(params(blocks[0])[key], value, err_msg=key)
        np.testing.assert_array_equal(params(blocks[1])[key], value, err_msg=key)
    name = f"{prefix}.experts.0.up_proj.weight"
    with pytest.raises(ValueError, match=f"'{name}' is float8_e4m3fn without '{name}_scale_inv'"):
        hf.load_block(
            blocks[2], {k: v for k, v in stored.items() if k != name + "_scale_inv"}, prefix
        )
    with pytest.raises(ValueError, match=r"in 128 x 128 blocks needs \(1, 1\)"):
        hf.load_block(blocks[2], stored, prefix)

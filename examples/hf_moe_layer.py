"""Every HuggingFace MoE family through `nn.MoEBlock`: config -> block -> safetensors -> EP run.

For each family a tiny `config.json` of its own model_type is mapped to block arguments
(`nn.hf.block_kwargs`), random weights are written under that family's tensor names and layout
(`nn.hf.tensor_shapes`, safetensors' numpy API: no torch), loaded back (`nn.hf.load_checkpoint`,
each process reading only its own experts) and run under EP on 8 fake CPU devices (a 2 x 4
node/local mesh) with both backends. One line per family: the layout read, the output's norm,
rows dropped by a Switch/GShard capacity, and whether the backends agree bit for bit.

    python examples/hf_moe_layer.py [--families=Mixtral,GPT-OSS] [--tokens=16]
"""

from __future__ import annotations

import json
import os
import tempfile

import jax
import numpy as np
from absl import app, flags, logging
from flax import nnx
from jax.sharding import AxisType
from safetensors.numpy import save_file

import jax_hybridep as hep
from jax_hybridep import nn as hnn
from jax_hybridep.nn import hf

H, F, E = 8, 8, 8  # model width, expert width, experts: tiny, every family alike

# A tiny config per family, as its config.json would say it (the fields its mapping reads); laid
# out as a table, one family per entry, so the formatter is told to leave it.
TINY = {
    "Mixtral": dict(model_type="mixtral", hidden_size=H, intermediate_size=F,
                    num_local_experts=E, num_experts_per_tok=2, num_hidden_layers=2),
    "Qwen2-MoE": dict(model_type="qwen2_moe", hidden_size=H, moe_intermediate_size=F,
                      num_experts=E, num_experts_per_tok=2, shared_expert_intermediate_size=2 * F,
                      norm_topk_prob=False, num_hidden_layers=2),
    "Qwen3-MoE": dict(model_type="qwen3_moe", hidden_size=H, moe_intermediate_size=F,
                      num_experts=E, num_experts_per_tok=3, norm_topk_prob=True,
                      num_hidden_layers=2),
    "DeepSeek-V2": dict(model_type="deepseek_v2", hidden_size=H, moe_intermediate_size=F,
                        n_routed_experts=E, num_experts_per_tok=2, n_shared_experts=2,
                        topk_method="group_limited_greedy", n_group=4, topk_group=2,
                        routed_scaling_factor=2.5, norm_topk_prob=False,
                        first_k_dense_replace=1, num_hidden_layers=3),
    "DeepSeek-V2-Lite": dict(model_type="deepseek_v2", hidden_size=H, moe_intermediate_size=F,
                             n_routed_experts=E, num_experts_per_tok=3, n_shared_experts=2,
                             topk_method="greedy", n_group=1, topk_group=1,
                             routed_scaling_factor=1.0, norm_topk_prob=False,
                             first_k_dense_replace=1, num_hidden_layers=2),
    "DeepSeek-V3": dict(model_type="deepseek_v3", hidden_size=H, moe_intermediate_size=F,
                        n_routed_experts=E, num_experts_per_tok=3, n_shared_experts=1,
                        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                        first_k_dense_replace=1, num_hidden_layers=2),
    "GLM-4.5": dict(model_type="glm4_moe", hidden_size=H, moe_intermediate_size=F,
                    n_routed_experts=E, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
                    topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True,
                    first_k_dense_replace=1, num_hidden_layers=2),
    "OLMoE": dict(model_type="olmoe", hidden_size=H, intermediate_size=F, num_experts=E,
                  num_experts_per_tok=2, norm_topk_prob=False, num_hidden_layers=1),
    "Jamba": dict(model_type="jamba", hidden_size=H, intermediate_size=F, num_experts=E,
                  num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
                  num_hidden_layers=4),
    "DBRX": dict(model_type="dbrx", d_model=H, n_layers=1,
                 ffn_config=dict(moe_num_experts=E, moe_top_k=2, ffn_hidden_size=F,
                                 moe_normalize_expert_weights=1, ffn_act_fn={"name": "silu"})),
    "Granite-MoE": dict(model_type="granitemoe", hidden_size=H, intermediate_size=F,
                        num_local_experts=E, num_experts_per_tok=2, num_hidden_layers=1),
    "Llama-4": dict(model_type="llama4",
                    text_config=dict(hidden_size=H, intermediate_size=F, num_local_experts=E,
                                     num_experts_per_tok=1, interleave_moe_layer_step=1,
                                     num_hidden_layers=2)),
    "GPT-OSS": dict(model_type="gpt_oss", hidden_size=H, intermediate_size=F,
                    num_local_experts=E, num_experts_per_tok=2, swiglu_limit=1.0,
                    num_hidden_layers=1),
    "Switch": dict(model_type="switch_transformers", d_model=H, d_ff=F, num_experts=E,
                   expert_capacity=2, router_bias=True, dense_act_fn="relu", num_layers=2,
                   num_decoder_layers=2, encoder_sparse_step=2, decoder_sparse_step=2),
    "NLLB-MoE": dict(model_type="nllb_moe", d_model=H, encoder_ffn_dim=F, decoder_ffn_dim=F,
                     num_experts=E, router_bias=True, moe_eval_capacity_token_fraction=0.0,
                     moe_token_dropout=0.2, activation_function="relu", encoder_layers=2,
                     decoder_layers=2, encoder_sparse_step=2, decoder_sparse_step=2),
}  # fmt: skip

flags.DEFINE_list("families", list(TINY), "families to run (names as in TINY)")
flags.DEFINE_integer("tokens", 8, "sequence length; 2 sequences per device", lower_bound=1)
FLAGS = flags.FLAGS


def make_mesh():
    devices = np.asarray(jax.devices("cpu")[:8]).reshape(2, 4)  # CPU devices even beside GPUs
    return jax.sharding.Mesh(devices, ("node", "local"), axis_types=(AxisType.Auto,) * 2)


def build(config, mesh, backend):
    """The family's block on `mesh`, all-to-all over both levels with `backend`."""
    kwargs = hf.block_kwargs(config)
    topology = hep.Topology.from_mesh(mesh, ("node", "local"))
    dispatch = hep.DispatchConfig(num_experts=kwargs["router"].num_experts, backend=backend)
    return hnn.MoEBlock(**kwargs, mesh=mesh, topology=topology, dispatch=dispatch, rngs=nnx.Rngs(0))


def random_checkpoint(directory, config, block, seed):
    """Writes config.json and model.safetensors with random weights for the first MoE layer."""
    prefix = hf.layer_prefixes(config)[0]
    shapes = hf.tensor_shapes(block, prefix, config["model_type"])
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in shapes.items():
        scale = 0.1 if name.endswith("bias") else H**-0.5  # every fan-in is H or F = H
        tensors[name] = (scale * rng.normal(size=shape)).astype(np.float32)
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return prefix


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # absl's INFO lines (backend probing) are noise here
    jax.config.update("jax_num_cpu_devices", 8)  # before any device is used
    mesh = make_mesh()
    x = np.random.default_rng(1).normal(size=(16, FLAGS.tokens, H)).astype(np.float32)
    unknown = sorted(set(FLAGS.families) - set(TINY))
    if unknown:
        raise app.UsageError(f"--families: unknown {unknown}; known: {', '.join(TINY)}")
    for name in FLAGS.families:
        config = TINY[name]
        outputs = {}
        with tempfile.TemporaryDirectory() as directory:
            prefix = None
            for backend in ("ffi", "xla"):
                block = build(config, mesh, backend)
                if prefix is None:
                    prefix = random_checkpoint(
                        directory, config, block, seed=list(TINY).index(name)
                    )
                layout = hf.load_checkpoint(directory, {prefix: block})[prefix]
                y, aux = nnx.jit(lambda b, x: b(x))(block, x)
                outputs[backend] = (np.asarray(y), int(aux.dropped))
        (y_ffi, dropped), (y_xla, _) = outputs["ffi"], outputs["xla"]
        same = (
            "bitwise"
            if np.array_equal(y_ffi, y_xla)
            else f"max|diff| {abs(y_ffi - y_xla).max():.1e}"
        )
        print(
            f"{name:17s} {config['model_type']:20s} {layout:40s} |y| "
            f"{np.linalg.norm(y_ffi):7.3f}  dropped {dropped:3d}  ffi vs xla: {same}"
        )


if __name__ == "__main__":
    app.run(main)

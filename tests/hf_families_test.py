"""Every HuggingFace MoE family: `MoEBlock(**hf.block_kwargs(config))` with the family's tensors
loaded by `hf.load_block` equals that family's dense reference (tests/hf_reference.py, written
from its modeling code): expert ids exactly, outputs and gradients (input and every parameter) to
1e-5 in float32, on a 1-level and a 2-level mesh, with the dispatch's padding rows poisoned (NaN).

Cost: one compiled program per family (values, gradients and ids together) runs every (mesh,
backend) block: both meshes span the same 4 devices. Both backends' outputs must also agree bit
for bit (docs/design.md §2.1.4).
"""

import zlib

import hf_reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from harness import BACKENDS, make_mesh

import jax_hybridep as hep
from examples.hf_moe_layer import TINY  # the example's tiny config of each family
from jax_hybridep import nn as hnn
from jax_hybridep.nn import hf

BATCH, SEQ = 4, 8  # one sequence of 8 tokens per device
MESHES = (((4,), ("ep",)), ((2, 2), ("node", "local")))
GROUPS = BATCH  # NLLB-MoE's token groups: each device's tokens


def reference(name, t, x, config):
    """The family's dense reference on relative tensor names t and tokens x [N, H]."""
    fn = {
        "Mixtral": ref.mixtral,
        "Qwen2-MoE": ref.qwen_moe,
        "Qwen3-MoE": ref.qwen_moe,
        "DeepSeek-V2": ref.deepseek_v2,
        "DeepSeek-V2-Lite": ref.deepseek_v2,
        "DeepSeek-V3": ref.deepseek_v3,
        "GLM-4.5": ref.deepseek_v3,
        "OLMoE": ref.olmoe,
        "Jamba": ref.jamba,
        "DBRX": ref.dbrx,
        "Granite-MoE": ref.granitemoe,
        "Llama-4": ref.llama4,
        "GPT-OSS": ref.gpt_oss,
    }.get(name)
    if fn is not None:
        return fn(t, x, config)
    if name == "Switch":
        return ref.switch(t, x, config, SEQ)
    return ref.nllb_moe(t, x, config, GROUPS)


def random_tensors(name, block, prefix):
    """Random weights under the family's names; Switch/NLLB get hot experts so capacity binds."""
    config = TINY[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    tensors = {}
    for tensor, shape in hf.tensor_shapes(block, prefix, config["model_type"]).items():
        scale = 0.3 if tensor.endswith("bias") else 8**-0.5
        tensors[tensor] = (scale * rng.normal(size=shape)).astype(np.float32)
    if name in ("Switch", "NLLB-MoE"):
        tensors[f"{prefix}.router.classifier.bias"][:2] += 2.0
    return tensors


def build(config, mesh, axes, backend):
    kwargs = hf.block_kwargs(config)
    dispatch = hep.DispatchConfig(num_experts=kwargs["router"].num_experts, backend=backend)
    topology = hep.Topology.from_mesh(mesh, axes)
    return hnn.MoEBlock(**kwargs, mesh=mesh, topology=topology, dispatch=dispatch, rngs=nnx.Rngs(0))


def flat(state):
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree.leaves_with_path(state)}


def loss(block, x, cot):
    y, aux = block(x)
    return jnp.sum(y * cot), (y, aux.dropped, aux.router_probs)


@nnx.jit
def run(blocks, x, cot):
    """Every block's output, drops, gradients (parameters, x) and expert ids: one program."""
    outs = []
    for block in blocks:
        (_, (y, dropped, probs)), grads = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
            block, x, cot
        )
        routing = block.route(x)
        outs.append((y, dropped, grads, routing.topk_idx, probs - routing.probs))
    return outs


@pytest.mark.parametrize("name", list(TINY))
def test_family_block_equals_its_reference(name, monkeypatch):
    # Rows past the groups are NaN: no option (input weighting, biases) may read them.
    monkeypatch.setenv("JAX_HYBRIDEP_POISON_PADDING", "1")
    config, index = TINY[name], list(TINY).index(name)
    prefix = hf.layer_prefixes(config)[0]
    x = jax.random.normal(jax.random.key(index), (BATCH, SEQ, 8), jnp.float32)
    cot = jax.random.normal(jax.random.key(100 + index), x.shape, jnp.float32)
    # Both meshes span the same 4 devices, so one program runs every (mesh, backend) block.
    cases = [(make_mesh(shape, axes), axes, b) for shape, axes in MESHES for b in BACKENDS]
    blocks = [build(config, mesh, axes, b) for mesh, axes, b in cases]
    tensors = random_tensors(name, blocks[0], prefix)
    for block in blocks:
        hf.load_block(block, tensors, prefix, model_type=config["model_type"])
    rel = {k[len(prefix) + 1 :]: jnp.asarray(v) for k, v in tensors.items()}

    def ref_loss(t, x):
        y, ids = reference(name, t, x.reshape(-1, 8), config)
        return jnp.sum(y.reshape(x.shape) * cot), (y, ids)

    (_, (y_ref, ids_ref)), (g_ref, gx_ref) = jax.jit(
        jax.value_and_grad(ref_loss, argnums=(0, 1), has_aux=True)
    )(rel, x)
    g_ref = {f"{prefix}.{k}": v for k, v in g_ref.items()}
    outs = run(blocks, x, cot)
    # The reference's gradients, loaded like weights, are the blocks' parameter gradients.
    hf.load_block(blocks[0], g_ref, prefix, model_type=config["model_type"])
    want = flat(nnx.state(blocks[0], nnx.Param))
    for (y, dropped, (grads, grad_x), ids, probs_error), (mesh, _, backend) in zip(
        outs, cases, strict=True
    ):
        at = f"{name} on {dict(mesh.shape)}, {backend}"
        np.testing.assert_array_equal(ids, ids_ref, err_msg=at)
        # The block's mean routing probabilities (per shard, averaged) are the global ones.
        np.testing.assert_allclose(probs_error, 0, atol=1e-6, err_msg=at)
        assert int(dropped) == int(np.sum(np.asarray(ids_ref) < 0)), at
        np.testing.assert_allclose(y.reshape(-1, 8), y_ref, rtol=1e-5, atol=1e-5, err_msg=at)
        np.testing.assert_allclose(grad_x, gx_ref, rtol=1e-5, atol=1e-5, err_msg=at)
        got = flat(grads)
        assert want.keys() == got.keys(), at
        for key in want:
            np.testing.assert_allclose(
                got[key], want[key], rtol=1e-5, atol=1e-5, err_msg=f"{at}: d/d{key}"
            )
    assert BACKENDS == ("xla", "ffi")  # per mesh, both backends: the same bits (§2.1.4)
    for m in range(len(MESHES)):
        np.testing.assert_array_equal(outs[2 * m][0], outs[2 * m + 1][0], err_msg=name)
    if name in ("Switch", "NLLB-MoE"):
        assert int(outs[0][1]) > 0, f"{name}: the capacity never bound"

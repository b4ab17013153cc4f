"""nn.hf.load_block / load_checkpoint never load a block partly or silently wrong: tensors under a
layer that the block cannot hold (a ninth expert, an expert bias, a router bias) are named unless
`ignore_extra`; weights of a non-float dtype are refused; FP8 scales that do not fit their weight
are named before anything is set; a read that fails leaves the block as it was; every layer of a
checkpoint is checked before the first is set; arguments of the wrong type are TypeErrors naming
them."""

import json

import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from harness import make_mesh
from safetensors.numpy import save_file

import jax_hybridep as hep
from jax_hybridep import nn as hnn
from jax_hybridep.nn import hf

CONFIG = dict(
    model_type="mixtral",
    hidden_size=8,
    intermediate_size=8,
    num_local_experts=8,
    num_experts_per_tok=2,
    num_hidden_layers=2,
)
PREFIX = "model.layers.0.block_sparse_moe"
DEEPSEEK = dict(
    model_type="deepseek_v3",
    hidden_size=8,
    moe_intermediate_size=8,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=1.0,
    first_k_dense_replace=0,
    num_hidden_layers=1,
)


def block(config=CONFIG):
    mesh = make_mesh((4,), ("ep",))
    topology = hep.Topology.from_mesh(mesh, ("ep",))
    return hnn.MoEBlock(**hf.block_kwargs(config), mesh=mesh, topology=topology, rngs=nnx.Rngs(0))


def tensors(b, prefix=PREFIX, model_type="mixtral", seed=0):
    rng = np.random.default_rng(seed)
    shapes = hf.tensor_shapes(b, prefix, model_type)
    return {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}


def params(b):
    return {"/".join(map(str, p)): np.asarray(v) for p, v in nnx.to_flat_state(nnx.state(b))}


def assert_unchanged(b, before):
    for key, value in params(b).items():
        np.testing.assert_array_equal(value, before[key], err_msg=key)


EXTRA = {
    "a ninth expert": f"{PREFIX}.experts.8.w1.weight",
    "an expert bias": f"{PREFIX}.experts.0.w1.bias",
    "a router bias": f"{PREFIX}.gate.bias",
    "an orphan FP8 scale": f"{PREFIX}.gate.bias_scale_inv",
}


@pytest.mark.parametrize("what", sorted(EXTRA))
def test_a_tensor_the_block_cannot_hold_is_named_unless_ignored(what, tmp_path):
    """Before: ignored, although docs/families.md said it never is."""
    b = block()
    values = tensors(b)
    name = EXTRA[what]
    values[name] = np.ones((8, 8) if name.endswith("weight") else (8,), np.float32)
    before = params(b)
    with pytest.raises(ValueError, match=f"cannot hold.*{name}"):
        hf.load_block(b, values, PREFIX)
    assert_unchanged(b, before)
    save_file(values, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=f"cannot hold.*{name}"):
        hf.load_checkpoint(str(tmp_path / "model.safetensors"), {PREFIX: b})
    assert_unchanged(b, before)
    # The documented switch: load what the block holds, leave the rest unread.
    want = block()
    hf.load_block(want, {k: v for k, v in values.items() if k != name}, PREFIX)
    hf.load_block(b, values, PREFIX, ignore_extra=True)
    assert_unchanged(b, params(want))
    other = block()
    hf.load_checkpoint(str(tmp_path / "model.safetensors"), {PREFIX: other}, ignore_extra=True)
    assert_unchanged(other, params(want))


def test_the_next_layer_is_not_extra():
    """ "model.layers.1" is not under "model.layers.1x" nor "model.layers.10" under
    "model.layers.1": only names under the prefix and a dot count."""
    b = block()
    prefix = "model.layers.1.block_sparse_moe"
    values = tensors(b, prefix)
    values.update(tensors(b, "model.layers.10.block_sparse_moe", seed=1))
    values["model.layers.1.block_sparse_moe_extra.x"] = np.zeros(3, np.float32)
    hf.load_block(b, values, prefix)


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.uint8, np.bool_])
def test_a_weight_of_an_integer_dtype_is_refused(dtype):
    """Before: cast to the block's dtype (an int8-quantised weight loaded as its raw integers)."""
    b = block()
    values = tensors(b)
    name = f"{PREFIX}.experts.3.w2.weight"
    values[name] = np.ones((8, 8), dtype)
    before = params(b)
    with pytest.raises(ValueError, match=f"{name}' is {np.dtype(dtype).name}, expected a float"):
        hf.load_block(b, values, PREFIX)
    assert_unchanged(b, before)


def fp8(values, names, block_size=(4, 4)):
    """values with `names` stored as float8 and their scales (block_size blocks)."""
    out = dict(values)
    for name in names:
        w = values[name]
        scale = np.full(
            (-(-w.shape[0] // block_size[0]), -(-w.shape[1] // block_size[1])), 0.5, np.float32
        )
        out[name] = (w / 0.5).astype(ml_dtypes.float8_e4m3fn)
        out[name + "_scale_inv"] = scale
    return out


def test_fp8_scales_of_the_wrong_shape_are_named_before_anything_is_set():
    """Before: refused only when that weight was read, after the router and other experts were
    overwritten, and the message named no tensor."""
    b = block(DEEPSEEK)
    prefix = "model.layers.0.mlp"
    values = tensors(b, prefix, "deepseek_v3")
    names = sorted(n for n in values if n.endswith("proj.weight"))
    stored = fp8(values, names)
    bad = names[len(names) // 2] + "_scale_inv"
    stored[bad] = np.ones((3, 3), np.float32)
    before = params(b)
    with pytest.raises(ValueError, match=f"'{bad}' has shape \\(3, 3\\), but"):
        hf.load_block(b, stored, prefix, fp8_block=(4, 4))
    assert_unchanged(b, before)
    hf.load_block(b, fp8(values, names), prefix, fp8_block=(4, 4))  # the right ones load


class Failing(dict):
    """Tensors whose reads of one tensor fail (a disk error in the middle of a load)."""

    def __init__(self, values, bad):
        super().__init__(values)
        self.bad = bad

    def __getitem__(self, name):
        value, bad = dict.__getitem__(self, name), self.bad

        class Reader:
            shape, dtype = value.shape, value.dtype

            def __getitem__(self, index):
                if name == bad:
                    raise OSError(f"reading {name}: Input/output error")
                return value[index]

        return Reader()


def test_a_read_that_fails_leaves_the_block_as_it_was():
    b = block()
    values = tensors(b)
    before = params(b)
    bad = f"{PREFIX}.experts.7.w2.weight"  # read last: the router and most experts come first
    with pytest.raises(OSError, match="Input/output error"):
        hf.load_block(b, Failing(values, bad), PREFIX)
    assert_unchanged(b, before)


def test_every_layer_is_checked_before_the_first_is_set(tmp_path):
    blocks = [block(), block()]
    values = {}
    for i, b in enumerate(blocks):
        values.update(tensors(b, f"model.layers.{i}.block_sparse_moe", seed=i))
    del values["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(values, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    before = [params(b) for b in blocks]
    with pytest.raises(ValueError, match="missing tensor 'model.layers.1.block_sparse_moe"):
        hf.load_checkpoint(str(tmp_path), blocks)
    for b, was in zip(blocks, before, strict=True):
        assert_unchanged(b, was)


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(block=None), TypeError, "block must be an nn.MoEBlock"),
        (dict(block="block"), TypeError, "block must be an nn.MoEBlock"),
        (dict(tensors=[("a", 1)]), TypeError, "tensors must be a mapping"),
        (dict(prefix=3), TypeError, "prefix must be a str"),
        (dict(model_type=3), TypeError, "model_type must be a str"),
        (dict(fp8_block="43"), ValueError, "fp8_block must be two block sizes"),
        (dict(fp8_block=(4, 0)), ValueError, "fp8_block must be two block sizes"),
        (dict(ignore_extra="no"), TypeError, "ignore_extra must be a bool"),
    ],
)
def test_load_block_arguments_of_the_wrong_type_are_named(change, error, match):
    """Before: AttributeError (or another error) from deep inside."""
    b = block()
    args = dict(block=b, tensors=tensors(b), prefix=PREFIX)
    args.update(change)
    pos = [args.pop(k) for k in ("block", "tensors", "prefix")]
    with pytest.raises(error, match=match):
        hf.load_block(*pos, **args)
    with pytest.raises(TypeError, match="block must be an nn.MoEBlock"):
        hf.tensor_shapes(None, PREFIX, "mixtral")

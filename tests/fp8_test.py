"""FP8 on the wire (docs/design.md §2.1.8, jax_hybridep/fp8.py): the quantisation's bits in jnp, the
C++ host code and ml_dtypes; FP8 dispatch on the xla and ffi backends bitwise equal, and equal to
the 16-bit dispatch of the dequantised tokens; f8 arrays in the compiled all-to-alls; the bytes;
gradients straight-through."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from harness import all_axes_spec, make_mesh, random_routing
from jax.sharding import PartitionSpec as P
from route_kinds import ROUTES, gpu_twin_route, on_mesh, same_bits_on
from transport_twin import JaxExchanges

import jax_hybridep as hep
from jax_hybridep import _native, fp8, ops, traffic
from jax_hybridep import nn as hnn
from jax_hybridep.exchange import routes
from jax_hybridep.exchange.wire import Carrier
from lab import native_module

MESHES = [((8,), ("ep",)), ((2, 4), ("node", "local")), ((2, 2, 2), ("dc", "node", "local"))]
FP8 = "float8_e4m3fn"
native = native_module.testing_module() if _native.available() else None
needs_native = pytest.mark.skipif(native is None, reason="native module not built")


def _bits(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _all_bf16_as_f32():
    return np.arange(1 << 16, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)


@needs_native
@pytest.mark.parametrize("amax", [1e-4, 0.37, 1.0, 448.0, 3.0e4])
def test_element_step_bitwise_over_every_bf16_pattern(amax):
    x = _all_bf16_as_f32()
    inv = np.float32(448.0) / np.float32(amax)
    jnp_q = _bits(jax.jit(fp8.cast)(x, inv))
    cpp_q = np.frombuffer(native.fp8_quantize_elements(x.tobytes(), float(inv)), np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        ref = np.clip(x * inv, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(jnp_q, _bits(ref))
    np.testing.assert_array_equal(cpp_q, _bits(ref))
    # NaN stays NaN, ±Inf saturates to ±448.
    specials = ref[np.isnan(x) | np.isinf(x)].astype(np.float32)
    assert np.isnan(specials).sum() == np.isnan(x).sum()
    assert sorted(set(specials[~np.isnan(specials)])) == [-448.0, 448.0]


def _special_tokens(rng, tokens, hidden, dtype):
    x = rng.standard_normal((tokens, hidden)).astype(np.float32) * 10.0 ** rng.integers(
        -6, 4, (tokens, 1)
    )
    x[0, :] = 0.0  # every block at the amax floor
    x[1, 3], x[1, -1], x[2, 5] = np.nan, np.inf, -np.inf  # excluded from amax
    x[3, : min(hidden, 128)] = 1e-7  # one block under the floor
    return np.asarray(x.astype(dtype))


@needs_native
@pytest.mark.parametrize("hidden", [256, 200, 7])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_rows_and_scales_bitwise_jnp_and_cpp(hidden, dtype):
    x = _special_tokens(np.random.default_rng(3), 9, hidden, jnp.dtype(dtype))
    q, scales = jax.jit(fp8.quantize)(x)
    assert q.dtype == jnp.float8_e4m3fn and scales.shape == (9, fp8.num_blocks(hidden))
    wire = np.asarray(jax.jit(fp8.to_wire)(q, scales))
    cpp = np.frombuffer(native.fp8_quantize_rows(dtype, x.tobytes(), hidden), np.uint8)
    np.testing.assert_array_equal(cpp.reshape(wire.shape), wire)
    back = np.asarray(jax.jit(fp8.dequantize, static_argnums=2)(q, scales, x.dtype))
    cpp_back = np.frombuffer(native.fp8_dequantize_rows(dtype, wire.tobytes(), hidden), x.dtype)
    np.testing.assert_array_equal(_bits(cpp_back.reshape(back.shape)), _bits(back))
    # The formula itself: scale = amax / 448 over the finite elements, floored at 1e-4.
    blocks = np.pad(
        np.where(np.isfinite(x), np.abs(x.astype(np.float32)), 0), ((0, 0), (0, -hidden % 128))
    ).reshape(9, -1, 128)
    amax = np.maximum(blocks.max(-1), np.float32(1e-4))
    np.testing.assert_array_equal(np.asarray(scales), amax * (np.float32(1) / np.float32(448)))
    q_again, scales_again = jax.jit(fp8.from_wire, static_argnums=1)(wire, hidden)
    np.testing.assert_array_equal(_bits(q_again), _bits(q))
    np.testing.assert_array_equal(np.asarray(scales_again), np.asarray(scales))


def _setup(shape, names, hidden, dtype=jnp.bfloat16, capacity=None, seed=5):
    mesh = make_mesh(shape, names)
    topo = hep.Topology.from_mesh(mesh, names)
    n, T, K, E = mesh.size, 6, 3, 2 * mesh.size
    rng = np.random.default_rng(seed)
    idx, w = random_routing(rng, n * T, K, E, invalid_fraction=0.1)
    x = _special_tokens(rng, n * T, hidden, dtype)
    return mesh, topo, jnp.asarray(x), idx, w, dict(num_experts=E, capacity_factor=capacity)


def _dispatch_fn(mesh, topo, cfg, route=None):
    spec = all_axes_spec(mesh)

    def body(x, idx, w):
        d = ops.dispatch_with_route(route, x, idx, w, topology=topo, config=cfg)
        return d.tokens, d.scales, d.weights, d.group_sizes, d.stats.level_rows

    scales_spec = spec if cfg.fp8_rows else None
    return on_mesh(
        mesh, body, out_specs=(spec, scales_spec, spec, P(topo.ep_axes), P(topo.ep_axes))
    )


# Hidden sizes of one full and of two partial blocks (wire rows of H + 4 * ceil(H / 128) bytes) on
# the fused host route and the walked one over two and three levels; the contract suite runs
# FP8 on the wire on every route kind (H = 8).
@pytest.mark.parametrize(
    "shape,names,hidden,capacity",
    [(*MESHES[0], 200, None), (*MESHES[1], 256, 1.0), (*MESHES[2], 200, 1.0)],
)
def test_fp8_dispatch_xla_equals_ffi_and_the_dequantised_16_bit_dispatch(
    shape, names, hidden, capacity
):
    mesh, topo, x, idx, w, kw = _setup(shape, names, hidden, capacity=capacity)
    results = {}
    for rows in (False, True):
        cfg = hep.DispatchConfig(wire_dtype=FP8, fp8_rows=rows, **kw)

        def program(kind, cfg=cfg):
            topo_k, cfg_k, route = ROUTES[kind].prepare(topo, cfg)
            return _dispatch_fn(mesh, topo_k, cfg_k, route=route)

        results[rows] = same_bits_on(("ffi",), program, x, idx, w)["xla"]
    # Dequantised rows are the 16-bit dispatch of x' = dequantize(quantize(x)), and the FP8 rows
    # dequantise to them: one quantisation per token, at the source, forwarded unchanged.
    x_prime = jax.jit(lambda x: fp8.dequantize(*fp8.quantize(x), x.dtype))(x)
    plain = hep.DispatchConfig(backend="xla", **kw)
    want = jax.device_get(_dispatch_fn(mesh, topo, plain)(x_prime, idx, w))
    deq, _, weights, sizes, level_rows = results[False]
    for got, ref in zip((deq, weights, sizes, level_rows), (want[0], *want[2:]), strict=True):
        np.testing.assert_array_equal(_bits(got), _bits(ref))
    q, scales = results[True][:2]
    assert q.dtype == jnp.float8_e4m3fn and scales.shape == (q.shape[0], fp8.num_blocks(hidden))
    per_shard = q.shape[0] // mesh.size
    live = np.concatenate(
        [
            np.arange(r * per_shard, r * per_shard + int(s))
            for r, s in enumerate(sizes.reshape(mesh.size, -1).sum(1))
        ]
    )
    redone = np.asarray(fp8.dequantize(jnp.asarray(q[live]), jnp.asarray(scales[live]), x.dtype))
    np.testing.assert_array_equal(_bits(redone), _bits(deq[live]))


@pytest.mark.parametrize("backend", ["xla", "ffi"])
def test_prequantised_input_equals_quantising_inside(backend):
    mesh, topo, x, idx, w, kw = _setup((2, 4), ("node", "local"), 200)
    cfg = hep.DispatchConfig(backend=backend, wire_dtype=FP8, fp8_rows=True, **kw)
    inside = jax.device_get(_dispatch_fn(mesh, topo, cfg)(x, idx, w))
    given = jax.device_get(_dispatch_fn(mesh, topo, cfg)(jax.jit(fp8.quantize)(x), idx, w))
    for a, b in zip(inside, given, strict=True):
        np.testing.assert_array_equal(_bits(a), _bits(b))


def test_compiled_all_to_alls_carry_fp8_bytes_and_the_bytes_ratio():
    """The payload crosses every level as the e4m3fn bytes (u8: XLA:CPU would widen f8 arrays
    to f16 in a collective, as it widens bf16 ones to f32) with its f32 scales beside it."""
    hidden, nb = 640, fp8.num_blocks(640)
    mesh, topo, x, idx, w, kw = _setup((2, 4), ("node", "local"), hidden, capacity=2.0)
    arrays = {}
    for wire in (None, FP8):
        cfg = hep.DispatchConfig(backend="xla", wire_dtype=wire, **kw)
        text = _dispatch_fn(mesh, topo, cfg).lower(x, idx, w).compile().as_text()
        arrays[wire] = [a for c in traffic.collectives(text, "all-to-all") for a in c.operands]
    payload16 = [s for k, s in arrays[None] if k in ("bf16", "f32") and s[-1] == hidden]
    payload8 = [s for k, s in arrays[FP8] if s[-1] == hidden]
    assert {k for k, s in arrays[FP8] if s[-1] == hidden} == {"u8"}
    scales = [s for k, s in arrays[FP8] if k == "f32" and s[-1] == nb]
    assert len(payload8) == len(scales) == len(payload16) > 0
    assert sorted(s[:-1] for s in scales) == sorted(s[:-1] for s in payload8)
    wire_bytes = sum(traffic.array_bytes("u8", s) for s in payload8)
    wire_bytes += sum(traffic.array_bytes("f32", s) for s in scales)
    bf16_bytes = sum(traffic.array_bytes("bf16", s) for s in payload16)
    assert wire_bytes * 2 * hidden == bf16_bytes * (hidden + 4 * nb)
    # The run-time counts: the same copies per level, each of wire_bytes(H) bytes.
    level_rows = {}
    for wire in (None, FP8):
        cfg = hep.DispatchConfig(backend="ffi", wire_dtype=wire, **kw)
        level_rows[wire] = np.asarray(_dispatch_fn(mesh, topo, cfg)(x, idx, w)[4]).sum(0)
    np.testing.assert_array_equal(level_rows[FP8], level_rows[None])
    assert (level_rows[FP8] > 0).all()
    at_fp8 = traffic.level_bytes(level_rows[FP8], hidden, jnp.bfloat16, FP8)
    at_bf16 = traffic.level_bytes(level_rows[None], hidden, jnp.bfloat16)
    np.testing.assert_array_equal(at_fp8 * 2 * hidden, at_bf16 * (hidden + 4 * nb))


def test_gradients_equal_the_16_bit_path_given_the_same_row_cotangents(backend):
    mesh, topo, x, idx, w, kw = _setup((2, 4), ("node", "local"), 200, dtype=jnp.float32)
    spec = all_axes_spec(mesh)

    def grads(wire):
        cfg = hep.DispatchConfig(backend=backend, wire_dtype=wire, **kw)

        def rows(x, idx, w):
            d = hep.dispatch(x, idx, w, topology=topo, config=cfg)
            return d.tokens, d.weights

        fn = on_mesh(mesh, rows, out_specs=(spec, spec))
        shapes = jax.eval_shape(fn, x, idx, w)
        rng = np.random.default_rng(9)
        cts = tuple(jnp.asarray(rng.standard_normal(o.shape), o.dtype) for o in shapes)
        pullback = jax.jit(lambda x, w, cts: jax.vjp(lambda x, w: fn(x, idx, w), x, w)[1](cts))
        return jax.device_get(pullback(x, w, cts))

    for got, want in zip(grads(FP8), grads(None), strict=True):
        np.testing.assert_array_equal(_bits(got), _bits(want))


def _fp8_rows_loss(mesh, topo, kw, backend, rows_fp8, use_rows=True):
    """sum(combine(1.5 * rows, weights=d.weights) ** 2) with the rows dequantised by the
    consumer (fp8_rows=True) or by dispatch (fp8_rows=False): the same bits either way."""
    cfg = hep.DispatchConfig(backend=backend, wire_dtype=FP8, fp8_rows=rows_fp8, **kw)
    spec = all_axes_spec(mesh)

    def body(x, idx, w):
        d = hep.dispatch(x, idx, w, topology=topo, config=cfg)
        if not use_rows:
            return jnp.zeros(x.shape, jnp.float32).at[:1, :1].add(jnp.sum(d.weights))
        dtype = jnp.float32 if isinstance(x, tuple) else x.dtype
        rows = fp8.dequantize(d.tokens, d.scales, dtype) if rows_fp8 else d.tokens
        return hep.combine(rows * 1.5, d.handle, weights=d.weights).astype(jnp.float32)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    return lambda x, idx, w: jnp.sum(fn(x, idx, w) ** 2)  # x may be a quantised (q, scales)


def test_fp8_rows_pass_routing_weight_gradients_exactly(backend):
    """fp8_rows=True: the gradient w.r.t. topk_weights (x not differentiated) is the dequantised
    path's bit for bit, on both backends (the rows carry no cotangent; each row's weight
    cotangent returns to its (t, k) as on every path)."""
    mesh, topo, x, idx, w, kw = _setup((2, 4), ("node", "local"), 200)
    grads = jax.jit(
        lambda x, w: [
            jax.value_and_grad(_fp8_rows_loss(mesh, topo, kw, backend, rows), argnums=2)(x, idx, w)
            for rows in (True, False)
        ]
    )(x, w)
    (v8, g8), (v16, g16) = jax.device_get(grads)
    assert np.count_nonzero(np.nan_to_num(g16)) > g16.size // 2
    np.testing.assert_array_equal(_bits(v8), _bits(v16))
    np.testing.assert_array_equal(_bits(g8), _bits(g16))


def test_fp8_rows_refuse_gradients_that_need_x_through_the_rows():
    mesh, topo, x, idx, w, kw = _setup((8,), ("ep",), 128, dtype=jnp.float32)
    loss = _fp8_rows_loss(mesh, topo, kw, "xla", True)
    with pytest.raises(TypeError, match="needs x's cotangent through the FP8 rows"):
        jax.eval_shape(jax.grad(loss), x, idx, w)  # traced only: refused before compiling
    with pytest.raises(TypeError, match="needs x's cotangent through the FP8 rows"):
        jax.eval_shape(jax.grad(loss, argnums=(0, 2)), x, idx, w)
    # x differentiated but the rows unused: their cotangent is zero, so is x's gradient.
    unused = _fp8_rows_loss(mesh, topo, kw, "xla", True, use_rows=False)
    assert jax.eval_shape(jax.grad(unused), x, idx, w).shape == x.shape
    # Pre-quantised input: the same rule for q and scales.
    pre = _fp8_rows_loss(mesh, topo, kw, "xla", True)
    with pytest.raises(TypeError, match="needs x's cotangent"):
        jax.eval_shape(jax.grad(lambda x, w: pre(fp8.quantize(x), idx, w)), x, w)


def test_config_rejects_unknown_wire_dtypes():
    with pytest.raises(ValueError, match="wire_dtype"):
        hep.DispatchConfig(num_experts=4, wire_dtype="float8_e5m2")
    with pytest.raises(ValueError, match="fp8_rows=True needs"):
        hep.DispatchConfig(num_experts=4, fp8_rows=True)


# One level (the transport quantises) and three (wire rows under the slow levels); two levels,
# and FP8 values and gradients on every mesh, run in the contract suite (the `gpu_twin` kind).
@pytest.mark.parametrize("shape,names,hidden", [(*MESHES[0], 200), (*MESHES[2], 198)])
def test_gpu_route_carries_fp8_like_the_xla_backend(shape, names, hidden):
    """The GPU route (CUDA bottom over the pure-JAX twin of its exchanges, as the contract
    suite's `gpu_twin` kind runs it): on one level the tokens reach the transport unquantised
    (its send kernel quantises), under slower levels as wire rows; bitwise the xla backend's
    values, scales and row weights, H a multiple of 128 or not (198: wire rows of 206 bytes)."""
    mesh, topo, x, idx, w, kw = _setup(shape, names, hidden, capacity=1.0)
    gpu_topo = dataclasses.replace(topo, platform="gpu")
    assert routes.route_for("ffi", gpu_topo).carrier is Carrier.SEND_QUANTISES
    reached = []  # the dtype of what reached the transport, per trace

    class Recording(JaxExchanges):
        def dispatch(self, plan, fast, x, *args):
            reached.append(x.dtype)
            return super().dispatch(plan, fast, x, *args)

    twin = gpu_twin_route(topo, Recording())
    for rows in (False, True):
        cfg = hep.DispatchConfig(backend="ffi", wire_dtype=FP8, fp8_rows=rows, **kw)
        got = jax.device_get(_dispatch_fn(mesh, gpu_topo, cfg, route=twin)(x, idx, w))
        assert reached[-1] == (x.dtype if len(names) == 1 else jnp.uint8)
        xla = dataclasses.replace(cfg, backend="xla")
        want = jax.device_get(_dispatch_fn(mesh, topo, xla)(x, idx, w))
        runs = [got]
        if rows:  # pre-quantised input reaches the transport as wire rows on every route
            given = jax.jit(fp8.quantize)(x)
            runs.append(
                jax.device_get(_dispatch_fn(mesh, gpu_topo, cfg, route=twin)(given, idx, w))
            )
            assert reached[-1] == jnp.uint8
        for run in runs:
            for a, b in zip(run, want, strict=True):
                if b is not None:
                    np.testing.assert_array_equal(_bits(a), _bits(b))


def test_moe_block_trains_with_fp8_dispatch():
    mesh = make_mesh((2, 2), ("node", "local"))
    topo = hep.Topology.from_mesh(mesh, ("node", "local"))
    router = hnn.RouterConfig(num_experts=8, top_k=2)
    x = jax.random.normal(jax.random.key(1), (4, 8, 128))

    def block(**wire):
        dispatch = hep.DispatchConfig(num_experts=8, **wire)
        return hnn.MoEBlock(
            128,
            router=router,
            experts=hnn.ExpertConfig(d_ff=32),
            mesh=mesh,
            topology=topo,
            dispatch=dispatch,
            rngs=nnx.Rngs(0),
        )

    def loss(b, x):
        y, aux = b(x)
        return jnp.sum(y**2) + aux.loss

    (want, want_g), (got, got_g) = (
        nnx.jit(nnx.value_and_grad(loss))(block(**wire), x) for wire in ({}, {"wire_dtype": FP8})
    )
    assert float(got) != float(want)  # the tokens did go through FP8
    assert abs(float(got) - float(want)) < 0.05 * abs(float(want))
    grads = (jax.tree.leaves(nnx.state(g)) for g in (got_g, want_g))
    for a, b in zip(*grads, strict=True):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_allclose(a, b, rtol=0.1, atol=0.05 * float(np.abs(b).max()))
    with pytest.raises(ValueError, match="fp8_rows"):
        block(wire_dtype=FP8, fp8_rows=True)

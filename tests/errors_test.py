"""Bad input fails at trace time with names and shapes; runtime failures are errors, not hangs."""

import dataclasses
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import BACKENDS, make_mesh, moe_fn
from jax.sharding import PartitionSpec as P

import jax_hybridep as hep
from jax_hybridep import compat
from lab import native_module


def _run(mesh, fn, *args, in_specs=None, out_specs=None):
    spec = P(tuple(mesh.axis_names))
    in_specs = in_specs or (spec,) * len(args)
    out_specs = out_specs or spec
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))(*args)


@pytest.fixture(scope="module")
def ep4():
    mesh = make_mesh((4,), ("ep",))
    return mesh, hep.Topology.from_mesh(mesh, ("ep",))


def _dispatch_tokens(topo, cfg):
    def fn(x, idx, w):
        return hep.dispatch(x, idx, w, topology=topo, config=cfg).tokens

    return fn


X, IDX, W = np.ones((16, 4), np.float32), np.zeros((16, 2), np.int32), np.ones((16, 2), np.float32)


@pytest.mark.parametrize(
    "args,error,match",
    [
        (
            (np.ones((16, 4, 1), np.float32), IDX, W),
            ValueError,
            r"x must be \[T, H\], got shape \(4, 4, 1\)",
        ),
        ((X, np.zeros((16,), np.int32), W[:, 0]), ValueError, r"topk_idx must be \[T, K\]"),
        (
            (X, IDX, np.ones((16, 3), np.float32)),
            ValueError,
            r"topk_weights shape \(4, 3\) differs",
        ),
        (
            (np.ones((8, 4), np.float32), IDX, W),
            ValueError,
            r"x has T=2 tokens .* topk_idx has T=4",
        ),
        (
            (X, IDX.astype(np.float32), W),
            TypeError,
            r"topk_idx must hold integer expert ids, got dtype float32",
        ),
        (
            (X.astype(np.int32), IDX, W),
            TypeError,
            r"x must be float32, bfloat16 or float16, got int32",
        ),
        ((X, IDX, W.astype(np.int32)), TypeError, r"topk_weights must be floating point"),
    ],
)
def test_shape_and_dtype_errors(ep4, args, error, match):
    mesh, topo = ep4
    with pytest.raises(error, match=match):
        _run(mesh, _dispatch_tokens(topo, hep.DispatchConfig(num_experts=8)), *args)


def test_k_larger_than_e(ep4):
    mesh, topo = ep4
    idx = np.zeros((16, 9), np.int32)
    with pytest.raises(ValueError, match=r"K=9 columns but there are only num_experts=8"):
        _run(mesh, _dispatch_tokens(topo, hep.DispatchConfig(num_experts=8)), X, idx, idx * 1.0)


def test_experts_not_divisible_by_ep_size(ep4):
    mesh, topo = ep4
    with pytest.raises(ValueError, match=r"num_experts=6 is not divisible by the EP size 4"):
        _run(mesh, _dispatch_tokens(topo, hep.DispatchConfig(num_experts=6)), X, IDX, W)


def test_axes_not_in_mesh():
    mesh = make_mesh((4,), ("ep",))
    with pytest.raises(ValueError, match=r"name axes \['node'\] that are not in the mesh"):
        hep.Topology.from_mesh(mesh, ("node", "ep"))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_experts=0), "num_experts must be an int >= 1, got 0"),
        (dict(num_experts=8, capacity_factor=0.0), "capacity_factor must be a finite number > 0"),
        (dict(num_experts=8, pad_multiple=0), "pad_multiple must be an int >= 1"),
        (dict(num_experts=8, backend="nccl"), "backend must be one of"),
        (dict(num_experts=2, expert_placement=((0, 0), (0, 0))), "maps two experts to one"),
        (dict(num_experts=2, expert_placement=((0, 0),)), "has 1 entries for num_experts=2"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        hep.DispatchConfig(**kwargs)


def test_config_is_hashable():
    a = hep.DispatchConfig(num_experts=4, expert_placement=[[0, 1], [0, 0], [1, 0], [1, 1]])
    b = hep.DispatchConfig(num_experts=4, expert_placement=((0, 1), (0, 0), (1, 0), (1, 1)))
    assert a == b and hash(a) == hash(b)


def test_placement_out_of_range(ep4):
    mesh, topo = ep4
    cfg = hep.DispatchConfig(num_experts=2, expert_placement=((0, 0), (7, 0)))
    with pytest.raises(ValueError, match="names EP rank 7 but the EP size is 4"):
        _run(mesh, _dispatch_tokens(topo, cfg), X, IDX, W)


def test_outside_shard_map(ep4):
    _, topo = ep4
    with pytest.raises(
        ValueError, match=r"must run inside jax.shard_map over the EP axes \('ep',\)"
    ):
        jax.jit(_dispatch_tokens(topo, hep.DispatchConfig(num_experts=8)))(X, IDX, W)


def test_under_vmap(ep4):
    mesh, topo = ep4
    fn = _dispatch_tokens(topo, hep.DispatchConfig(num_experts=8))
    batched = lambda x, i, w: jax.vmap(fn)(x[None], i[None], w[None])[0]  # noqa: E731
    with pytest.raises(ValueError, match="does not support jax.vmap"):
        _run(mesh, batched, X, IDX, W)


def test_handle_from_another_topology_or_backend(ep4):
    mesh, topo = ep4
    other = hep.Topology.from_mesh(make_mesh((2, 2), ("a", "b")), (("a", "b"),))
    cfg = hep.DispatchConfig(num_experts=8, backend="ffi")

    def with_topology(x, idx, w):
        d = hep.dispatch(x, idx, w, topology=topo, config=cfg)
        return hep.combine(d.tokens, d.handle, topology=other)

    def with_backend(x, idx, w):
        d = hep.dispatch(x, idx, w, topology=topo, config=cfg)
        return hep.combine(d.tokens, d.handle, config=dataclasses.replace(cfg, backend="xla"))

    def wrong_rows(x, idx, w):
        d = hep.dispatch(x, idx, w, topology=topo, config=cfg)
        return hep.combine(d.tokens[:-1], d.handle)

    with pytest.raises(ValueError, match=r"handle made for topology \(\('ep',\),\)"):
        _run(mesh, with_topology, X, IDX, W)
    with pytest.raises(ValueError, match="handle from the 'ffi' backend"):
        _run(mesh, with_backend, X, IDX, W)
    with pytest.raises(
        ValueError, match=r"C=32 rows \(one per row of its dispatch\), got shape \(31, 4\)"
    ):
        _run(mesh, wrong_rows, X, IDX, W)
    with pytest.raises(TypeError, match="handle must be Dispatched.handle"):
        hep.combine(jnp.ones((8, 4)), object())


def test_ffi_needs_every_mesh_axis_manual():
    mesh = make_mesh((2, 4), ("data", "ep"))
    topo = hep.Topology.from_mesh(mesh, ("ep",))

    def run(cfg):
        fn = jax.shard_map(
            _dispatch_tokens(topo, cfg),
            mesh=mesh,
            in_specs=P("ep"),
            out_specs=P("ep"),
            axis_names={"ep"},
        )
        return jax.jit(fn)(X, IDX, W)

    with pytest.raises(
        ValueError, match=r"mesh axes \['data'\] outside the EP group are not manual"
    ):
        run(hep.DispatchConfig(num_experts=8, backend="ffi"))
    assert run(hep.DispatchConfig(num_experts=8)).shape == (4 * 32, 4)  # auto -> xla


def _error_text(excinfo):
    match = re.search(
        r"jax_hybridep strict mode: [^\n]*?\]\, invalid per EP rank \[[^\]]*\]", str(excinfo.value)
    )
    assert match, str(excinfo.value)
    return match.group(0)


def test_strict_mode_raises_the_same_error_on_every_backend(ep4):
    mesh, topo = ep4
    idx = np.array(
        [[0, 0]] * 8 + [[1, 99]] * 8, np.int32
    )  # cap 4: experts 0, 1 overflow; 99 invalid
    messages = {}
    for backend in BACKENDS:
        cfg = hep.DispatchConfig(num_experts=8, capacity_factor=1.0, strict=True, backend=backend)
        with pytest.raises(Exception, match="strict mode") as excinfo:
            jax.block_until_ready(_run(mesh, _dispatch_tokens(topo, cfg), X, idx, W))
        messages[backend] = _error_text(excinfo)
    assert messages["xla"] == messages["ffi"]
    assert messages["ffi"] == (
        "jax_hybridep strict mode: 16 row(s) dropped over capacity and 8 invalid expert id(s) in "
        "EP group 0; dropped per EP rank [4, 8, 0, 4], invalid per EP rank [0, 0, 4, 4]"
    )
    for backend in BACKENDS:  # the same routing within capacity passes
        cfg = hep.DispatchConfig(num_experts=8, strict=True, backend=backend)
        _run(mesh, _dispatch_tokens(topo, cfg), X, np.arange(32).reshape(16, 2) % 8, W)


def test_rendezvous_timeout_names_missing_ranks_and_process_stays_usable(ep4):
    mesh, topo = ep4
    cfg = hep.DispatchConfig(num_experts=8, backend="ffi", timeout_s=1.0)
    inner = _dispatch_tokens(topo, cfg)

    def rank0_skips(x, idx, w):  # rank 0 never reaches the exchange
        skip = jax.lax.axis_index("ep") == 0
        skipped = compat.mark_varying(jnp.zeros((32, 4), x.dtype), ("ep",))
        return jax.lax.cond(skip, lambda: skipped, lambda: inner(x, idx, w))

    start = time.monotonic()
    with pytest.raises(Exception, match=r"timed out after 1 s: EP ranks \[0\] of 4 did not arrive"):
        jax.block_until_ready(_run(mesh, rank0_skips, X, IDX, W))
    assert time.monotonic() - start < 30
    with pytest.raises(hep.TransportError, match=r"EP ranks \[0\] of 4 did not arrive"):
        hep.check_errors()  # the library's own type, which JAX's runtime error does not carry
    assert native_module.testing_module().open_exchange_count() == 0
    fn = moe_fn(mesh, topo, hep.DispatchConfig(num_experts=8, backend="ffi"))
    out, _ = fn(X, IDX, W, np.ones((8, 4, 4), np.float32))
    np.testing.assert_allclose(out, np.full((16, 4), 8.0))  # 2 rows of weight 1, each 4 * 1s


def test_check_errors_is_quiet_without_failures():
    """hep.check_errors() reports recorded failures; none happened in this test."""
    assert hep.check_errors() is None
    assert issubclass(hep.TransportError, RuntimeError)

"""Edge and wrong inputs, one test per class (issue: hardening): every bad value gets a clear
error naming it, x64 mode works, ids are checked in their own dtype before any cast, absurd
capacities are clamped, env vars are validated, runtime failures come out with their own type."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import warnings

import jax
import numpy as np
import pytest
from harness import make_mesh
from jax.sharding import PartitionSpec as P

import jax_hybridep as hep
from jax_hybridep import config as config_module

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def ep4():
    mesh = make_mesh((4,), ("ep",))
    return mesh, hep.Topology.from_mesh(mesh, ("ep",))


def _dispatched(mesh, topo, cfg, x, idx, w):
    """(stacked dispatch results per shard) of one dispatch on `mesh`."""
    spec = P(tuple(mesh.axis_names))

    def fn(x, idx, w):
        d = hep.dispatch(x, idx, w, topology=topo, config=cfg)
        return jax.tree.map(lambda a: a[None], (d.tokens, d.kept, d.stats.invalid, d.stats.dropped))

    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))(x, idx, w)


# ----------------------------------------------------------------------------- config values


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_experts=True), "num_experts must be an int >= 1, got True"),
        (dict(num_experts=8.0), "num_experts must be an int >= 1, got 8.0"),
        (dict(num_experts=8, capacity_factor=math.inf), "capacity_factor must be a finite"),
        (dict(num_experts=8, capacity_factor=math.nan), "capacity_factor must be a finite"),
        (dict(num_experts=8, capacity_factor="1.25"), "capacity_factor must be a finite"),
        (dict(num_experts=8, pad_multiple=True), "pad_multiple must be an int >= 1, got True"),
        (dict(num_experts=8, timeout_s=0), r"timeout_s must be a number of seconds in \(0, "),
        (dict(num_experts=8, timeout_s=math.inf), "timeout_s must be a number of seconds"),
        (dict(num_experts=8, num_sms=0), r"num_sms must be an int in \[1, 256\], got 0"),
        (dict(num_experts=8, num_local_slots=2.5), "num_local_slots must be an int >= 1"),
        (dict(num_experts=2, expert_placement=((0, 0.5), (1, 0))), "must be int pairs"),
        (dict(num_experts=2, expert_placement=((0,), (1, 0))), r"\(rank, slot\) pairs"),
        (dict(num_experts=8, backend=["ffi"]), "backend must be one of"),
    ],
)
def test_config_fields_name_the_bad_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        hep.DispatchConfig(**kwargs)


def test_strict_must_be_a_bool():
    with pytest.raises(TypeError, match="strict must be a bool, got 'yes'"):
        hep.DispatchConfig(num_experts=8, strict="yes")


@pytest.mark.parametrize("raw", ["0", "-1", "abc", "inf", ""])
def test_timeout_env_var_is_validated_with_its_name(monkeypatch, raw):
    monkeypatch.setenv("JAX_HYBRIDEP_TIMEOUT_S", raw)
    with pytest.raises(ValueError, match="JAX_HYBRIDEP_TIMEOUT_S"):
        _ = hep.DispatchConfig(num_experts=8).resolved_timeout_s
    monkeypatch.setenv("JAX_HYBRIDEP_TIMEOUT_S", "2.5")
    assert hep.DispatchConfig(num_experts=8).resolved_timeout_s == 2.5


def test_backend_env_var_is_validated_with_its_name(monkeypatch, ep4):
    mesh, topo = ep4
    monkeypatch.setenv("JAX_HYBRIDEP_BACKEND", "nccl")
    cfg = hep.DispatchConfig(num_experts=8)
    with pytest.raises(ValueError, match="JAX_HYBRIDEP_BACKEND='nccl'"):
        _dispatched(
            mesh,
            topo,
            cfg,
            np.ones((8, 4), np.float32),
            np.zeros((8, 1), np.int32),
            np.ones((8, 1), np.float32),
        )


# ----------------------------------------------------------------------------- capacity bounds


def test_huge_capacity_factor_is_clamped_to_what_can_arrive(ep4):
    mesh, topo = ep4
    topo_plan = lambda f: config_module.make_plan(  # noqa: E731
        topo, hep.DispatchConfig(num_experts=8, capacity_factor=f), 2, 2
    )
    with pytest.warns(UserWarning, match="clamped to capacity 16 rows per local expert"):
        plan = topo_plan(1e9)
    assert plan.capacity == 2 * 4 * 2  # T * EP * K: every row to one expert
    assert plan.rows == 16  # the most rows a rank can receive
    with pytest.warns(UserWarning):
        assert topo_plan(1e308).capacity == 16  # no overflow to inf
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert topo_plan(1.0).capacity == 2  # ordinary factors untouched, no warning


def test_clamped_capacity_keeps_every_row_like_dropless(ep4, backend):
    mesh, topo = ep4
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 4)).astype(np.float32)
    idx = np.zeros((16, 2), np.int32)  # every row to expert 0, duplicates included
    w = np.ones((16, 2), np.float32)
    with pytest.warns(UserWarning, match="clamped"):
        huge = hep.DispatchConfig(num_experts=8, capacity_factor=1e6, backend=backend)
        tokens, kept, _, dropped = _dispatched(mesh, topo, huge, x, idx, w)
    assert np.all(kept) and np.all(dropped == 0)
    assert tokens.shape == (4, 32, 4)  # per rank C = T * EP * K = 4 * 4 * 2


def test_row_budget_beyond_the_worst_case_is_clamped(ep4):
    _, topo = ep4
    cfg = hep.DispatchConfig(num_experts=8, row_budget=10**6)
    with pytest.warns(UserWarning, match="row_budget=1000000"):
        assert config_module.make_plan(topo, cfg, 2, 2).rows == 2 * 4 * 2


def test_buffer_beyond_int32_rows_is_refused():
    mesh_like = hep.Topology(levels=(("ep",),), mesh_axes=("ep",), mesh_shape=(1024,))
    cfg = hep.DispatchConfig(num_experts=1024)
    with pytest.raises(ValueError, match=r"C=\d+ rows per rank .* int32"):
        config_module.make_plan(mesh_like, cfg, 2**21, 8)


# ----------------------------------------------------------------------------- ids and shapes


@pytest.mark.parametrize(
    "dtype,ids,want_invalid",
    [
        (np.uint32, [2**32 - 1, 3], 1),  # not "-1": a huge unsigned id is invalid
        (np.uint8, [255, 3], 1),
        (np.int8, [-1, 3], 0),
        (np.int16, [-3, 300], 2),
    ],
)
def test_ids_are_checked_in_their_own_dtype(ep4, backend, dtype, ids, want_invalid):
    mesh, topo = ep4
    idx = np.tile(np.asarray(ids, dtype), (16, 1))
    cfg = hep.DispatchConfig(num_experts=8, backend=backend)
    x, w = np.ones((16, 4), np.float32), np.ones((16, 2), np.float32)
    _, kept, invalid, _ = _dispatched(mesh, topo, cfg, x, idx, w)
    assert int(np.sum(invalid)) == 16 * want_invalid
    assert int(np.sum(kept)) == 16 * sum(0 <= int(i) < 8 for i in np.asarray(ids, dtype))


@pytest.mark.parametrize("where", ["dispatch", "combine"])
def test_zero_hidden_size_is_refused_at_trace_time(ep4, where):
    mesh, topo = ep4
    cfg = hep.DispatchConfig(num_experts=8)
    spec = P("ep")
    hidden = 0 if where == "dispatch" else 4

    def fn(x, idx, w):
        d = hep.dispatch(x, idx, w, topology=topo, config=cfg)
        return hep.combine(d.tokens[:, :0], d.handle)

    x = np.ones((16, hidden), np.float32)
    idx, w = np.zeros((16, 2), np.int32), np.ones((16, 2), np.float32)
    match = "needs T >= 1, H >= 1" if where == "dispatch" else r"combine needs H >= 1"
    with pytest.raises(ValueError, match=match):
        jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))(x, idx, w)


def test_topology_must_be_a_topology(ep4):
    mesh, _ = ep4
    cfg = hep.DispatchConfig(num_experts=8)
    with pytest.raises(TypeError, match="topology must be a jax_hybridep.Topology"):
        _dispatched(
            mesh,
            mesh,
            cfg,
            np.ones((16, 4), np.float32),
            np.zeros((16, 1), np.int32),
            np.ones((16, 1), np.float32),
        )


# ----------------------------------------------------------------------------- typed errors


def _strict_failure(mesh, topo, backend):
    cfg = hep.DispatchConfig(num_experts=8, capacity_factor=1.0, strict=True, backend=backend)
    idx = np.zeros((16, 2), np.int32)  # every row to expert 0: over capacity
    return lambda: jax.block_until_ready(
        _dispatched(
            mesh, topo, cfg, np.ones((16, 4), np.float32), idx, np.ones((16, 2), np.float32)
        )
    )


def test_strict_failure_comes_out_as_strict_mode_error(ep4, backend):
    mesh, topo = ep4
    run = _strict_failure(mesh, topo, backend)
    with pytest.raises(hep.StrictModeError, match="28 row\\(s\\) dropped over capacity") as info:
        with hep.typed_errors():
            run()
    assert isinstance(info.value.__cause__, jax.errors.JaxRuntimeError)
    assert hep.check_errors() is None  # raised once, then nothing is left


def test_check_errors_raises_the_recorded_type_with_the_same_message(ep4):
    mesh, topo = ep4
    messages = {}
    for backend in ("xla", "ffi"):
        with pytest.raises(jax.errors.JaxRuntimeError):
            _strict_failure(mesh, topo, backend)()
        with pytest.raises(hep.StrictModeError) as info:
            hep.check_errors()
        messages[backend] = str(info.value)
        assert hep.check_errors() is None
    assert messages["xla"] == messages["ffi"]
    assert messages["ffi"].startswith("jax_hybridep strict mode: 28 row(s) dropped")


def test_typed_errors_leaves_other_errors_alone():
    with pytest.raises(KeyError):
        with hep.typed_errors():
            raise KeyError("not ours")


# ----------------------------------------------------------------------------- x64 mode


X64_CHILD = textwrap.dedent(
    """
    import json, os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.sharding import PartitionSpec as P
    from harness import make_mesh, moe_fn  # tests/ on PYTHONPATH
    import jax_hybridep as hep
    from jax_hybridep import nn as hnn

    mesh = make_mesh((2, 4), ("node", "local"))
    topo = hep.Topology.from_mesh(mesh, ("node", "local"))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 8))                  # float64: cast like any float input
    idx = rng.integers(-1, 16, (64, 2))               # int64, with -1
    idx[0, 0] = 2**32 + 3                             # wraps to 3 in int32: must stay invalid
    w = rng.random((64, 2))
    experts = rng.standard_normal((16, 8, 8)).astype(np.float32)
    out = {}
    for backend in ("xla", "ffi"):
        cfg = hep.DispatchConfig(num_experts=16, capacity_factor=1.0, backend=backend)
        fn = moe_fn(mesh, topo, cfg)
        y, stacked = fn(x.astype(np.float32), idx, w, experts)
        g = jax.jit(jax.grad(lambda w: jnp.sum(fn(x.astype(np.float32), idx, w, experts)[0])))(w)
        out[backend] = dict(
            y=np.asarray(y).view(np.uint32).tolist(), g=np.asarray(g).tolist(),
            invalid=int(np.sum(stacked[4].invalid)), dtype=str(y.dtype))
    block = hnn.MoEBlock(8, router=hnn.RouterConfig(num_experts=16, top_k=2),
                         experts=hnn.ExpertConfig(d_ff=16), mesh=mesh, topology=topo,
                         dispatch=hep.DispatchConfig(num_experts=16, backend="xla"),
                         rngs=nnx.Rngs(0))
    y, aux = nnx.jit(lambda b, x: b(x))(block, jnp.asarray(x[:64].reshape(8, 8, 8), jnp.float32))
    out["moe"] = dict(shape=list(y.shape), finite=bool(jnp.all(jnp.isfinite(y))),
                      tokens=int(jnp.sum(aux.tokens_per_expert)))
    print(json.dumps(out))
    """
)


@pytest.mark.slow
def test_x64_mode_works_on_every_backend_and_in_moe_block():
    path = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", X64_CHILD],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHONPATH=path),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["xla"] == out["ffi"]  # bitwise, int64 ids and all
    assert out["xla"]["invalid"] == 1  # 2**32 + 3 counted, not routed to expert 3
    assert out["xla"]["dtype"] == "float32"
    assert out["moe"] == dict(shape=[8, 8, 8], finite=True, tokens=64 * 2)


# ----------------------------------------------------------------------------- Topology, nn


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(levels=(("ep",),), mesh_axes=("ep",), mesh_shape=(4, 2)), "one size >= 1 per mesh"),
        (dict(levels=(("ep",),), mesh_axes=("ep",), mesh_shape=(0,)), "one size >= 1 per mesh"),
        (dict(levels=((1,),), mesh_axes=("ep",), mesh_shape=(4,)), "name mesh axes by string"),
        (dict(levels=5, mesh_axes=("ep",), mesh_shape=(4,)), "sequence of axis names"),
    ],
)
def test_topology_constructor_checks_its_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        hep.Topology(**kwargs)


def test_topology_takes_lists_and_a_bare_axis_name():
    a = hep.Topology(levels="ep", mesh_axes=["ep"], mesh_shape=[4])
    assert a == hep.Topology(levels=(("ep",),), mesh_axes=("ep",), mesh_shape=(4,))
    assert hash(a) == hash(hep.Topology(levels=[["ep"]], mesh_axes=("ep",), mesh_shape=(4,)))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_experts=8, top_k=2.0), "top_k must be an int >= 1"),
        (dict(num_experts=8, top_k=2, aux_loss_coef=-1.0), "aux_loss_coef must be a finite"),
        (
            dict(num_experts=8, top_k=2, routed_scale=0.0),
            "routed_scale must be a finite number > 0",
        ),
        (dict(num_experts=8, top_k=2, bias_update_rate=math.nan), "bias_update_rate must be"),
        (dict(num_experts=8, top_k=2, normalize=1), "normalize must be a bool"),
        (dict(num_experts=8, top_k=2, num_groups=2.0, topk_groups=1), "num_groups must be an int"),
    ],
)
def test_router_config_checks_its_fields(kwargs, match):
    from jax_hybridep import nn as hnn

    with pytest.raises((ValueError, TypeError), match=match):
        hnn.RouterConfig(**kwargs)


def test_moe_block_checks_mesh_topology_and_sizes_before_building(ep4):
    from flax import nnx

    from jax_hybridep import nn as hnn

    mesh, topo = ep4
    router = hnn.RouterConfig(num_experts=6, top_k=2)
    experts = hnn.ExpertConfig(d_ff=16)
    with pytest.raises(ValueError, match=r"num_experts=6 experts do not split evenly over the EP"):
        hnn.MoEBlock(8, router=router, experts=experts, mesh=mesh, topology=topo, rngs=nnx.Rngs(0))
    other = make_mesh((2, 2), ("a", "b"))
    router = hnn.RouterConfig(num_experts=8, top_k=2)
    with pytest.raises(ValueError, match="topology was built for mesh"):
        hnn.MoEBlock(8, router=router, experts=experts, mesh=other, topology=topo, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="d_ff must be an int >= 1, got 0"):
        hnn.ExpertConfig(d_ff=0)
    with pytest.raises(TypeError, match="experts must be a jax_hybridep.nn.ExpertConfig"):
        hnn.MoEBlock(8, router=router, experts=16, mesh=mesh, topology=topo, rngs=nnx.Rngs(0))

"""Bad arguments to the public API, second round (issue: hardening): every class of failure gets a
ValueError/TypeError naming the argument and the value, raised before anything compiles or runs.

* values that used to be accepted and give a silently wrong result (fractional sizes truncated,
  NaN read as uniform routing or turned into a NaN plan, a level named twice keeping the last,
  FP8 bytes counted for any wire dtype, integer input returning integers, a NaN flow size that
  never finished);
* foreign errors (AttributeError, ZeroDivisionError, IndexError, ...) where an argument had the
  wrong type or range;
* output paths checked before any work, their directories created.

Cheap by design: no test here compiles a program (the op checks run while tracing, under
`jax.eval_shape`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from harness import make_mesh
from jax.sharding import PartitionSpec as P

import jax_hybridep as hep
from jax_hybridep import balance, fp8, sim, traffic, values, xdc
from jax_hybridep import nn as hnn
from jax_hybridep.balance import moves, skews
from jax_hybridep.xdc import cost, planner, replanning, volumes

NAN = math.nan


@pytest.fixture(scope="module")
def ep4():
    mesh = make_mesh((4,), ("ep",))
    return mesh, hep.Topology.from_mesh(mesh, ("ep",))


@pytest.fixture(scope="module")
def dc2():
    mesh = make_mesh((2, 4), ("dc", "local"))
    return mesh, hep.Topology.from_mesh(mesh, ("dc", "local"))


def _cluster():
    return cost.Cluster((2, 4), (cost.Link(1e9), cost.Link(1e10)), ("dc", "local"))


def _workload(**kw):
    return xdc.Workload(
        **{
            **dict(tokens=64, top_k=2, num_experts=16, hidden=32, act_bytes=2, expert_bytes=1024),
            **kw,
        }
    )


def _flows(**kw):
    base = dict(
        paths=np.array([[True, False]]),
        path=np.array([0]),
        count=np.array([1.0]),
        size=np.array([1.0]),
        start=np.array([0.0]),
        tag=np.array([0]),
    )
    return sim.Flows(**{**base, **kw})


_NET = sim.Network(np.array([1.0, 2.0]), np.array([1.0, 1.0]), ("a", "b"))

# ------------------------------------------------------ accepted before, silently wrong results

SILENTLY_WRONG = {
    "fractional domain size": (
        lambda: xdc.Migration(domains={"dc": 1.5}),
        ValueError,
        r"domains\['dc'\].*got 1.5",
    ),
    "fractional domains in the byte model": (
        lambda: volumes.expected_volumes(
            (2, 4),
            (1.5, 1),
            tokens=4,
            top_k=2,
            num_experts=16,
            hidden=4,
            act_bytes=2,
            expert_bytes=8,
        ),
        ValueError,
        "domains must be one or more ints >= 1, got \\(1.5, 1\\)",
    ),
    "fractional candidates": (
        lambda: xdc.plan(_cluster(), _workload(), candidates=[(1.5, 1)]),
        ValueError,
        r"candidates\[i\] must be one or more ints >= 1, got \(1.5, 1\)",
    ),
    "fractional layer domains": (
        lambda: planner.layer_list((1.5, 1), 1),
        ValueError,
        "domains must be",
    ),
    "NaN routing probabilities to the planner": (
        lambda: xdc.plan(_cluster(), _workload(), np.full(16, NAN)),
        ValueError,
        "routing must be finite",
    ),
    "NaN expert_probs of a Workload": (
        lambda: _workload(expert_probs=(NAN,) * 16),
        ValueError,
        "expert_probs must be finite",
    ),
    "NaN counts read as uniform routing": (
        lambda: replanning.routing_from_counts([[NAN] * 16]),
        ValueError,
        "tokens_per_expert must be finite",
    ),
    "NaN counts to the re-planner": (
        lambda: xdc.Replanner(_cluster(), _workload(), every=1).update(1, [[NAN] * 16]),
        ValueError,
        "tokens_per_expert must be finite",
    ),
    "a link schedule naming a level twice": (
        lambda: xdc.LinkSchedule.parse("10:dc=1,dc=2", ("dc", "local")),
        ValueError,
        "name each level once",
    ),
    "a link schedule repeating a step": (
        lambda: xdc.LinkSchedule.parse("10:dc=1;10:dc=2", ("dc", "local")),
        ValueError,
        "steps must increase",
    ),
    "re-plan min_gain past 1": (
        lambda: xdc.replan((1, 1), _cluster(), _workload(), min_gain=2.0),
        ValueError,
        r"min_gain must be a finite number in \[0, 1\), got 2.0",
    ),
    "decay of 1 (the average never moves)": (
        lambda: balance.moving_average([1.0], [2.0], 1.0),
        ValueError,
        r"decay must be a finite number in \[0, 1\), got 1.0",
    ),
    "NaN load measurement": (
        lambda: balance.moving_average([1.0], [NAN], 0.5),
        ValueError,
        "tokens_per_expert must be finite",
    ),
    "numeric strings as loads": (
        lambda: balance.plan_placement(["1"] * 8, 4, 2, 1),
        TypeError,
        "load must hold real numbers, got dtype <U1",
    ),
    "bools as loads": (
        lambda: balance.plan_placement([True] * 8, 4, 2, 1),
        TypeError,
        "got dtype bool",
    ),
    "balance min_gain of 2 (never re-places)": (
        lambda: balance.plan_placement([1.0] * 8, 4, 2, 1, min_gain=2.0),
        ValueError,
        r"min_gain must be a finite number in \[0, 1\)",
    ),
    "a permutation index out of range (clamped by jax)": (
        lambda: moves.permute(np.ones(3), [0, 1, 5]),
        ValueError,
        "perm must be a permutation",
    ),
    "fractional ids counted": (
        lambda: skews.counts(np.array([1.5, 2.7]), 8),
        TypeError,
        "topk_idx must hold integ",
    ),
    "FP8 bytes for another wire dtype": (
        lambda: traffic.copy_bytes(16, np.float32, "float16"),
        ValueError,
        "wire_dtype must be None .* got 'float16'",
    ),
    "fractional copies to bytes": (
        lambda: traffic.level_bytes([1.5, 2], 4, np.float32),
        TypeError,
        "level_rows must hold integers",
    ),
    "a NaN flow size (the simulation never ended)": (
        lambda: _flows(size=np.array([NAN])),
        ValueError,
        "Flows.size must be finite",
    ),
    "a NaN link capacity": (
        lambda: sim.Network(np.array([NAN]), np.array([1.0]), ("a",)),
        ValueError,
        "Network.capacity must be finite",
    ),
    "a string flag on a layer": (
        lambda: sim.MoELayer(forward_only="yes"),
        TypeError,
        "MoELayer.forward_only must be a",
    ),
    "a domain size that does not divide the DCs": (
        lambda: sim.Datacenters(4).token_messages(3),
        ValueError,
        "domain size 3 must divide",
    ),
    "a plot written into a directory": (
        lambda: sim.plot([{"policy": "best"}], "."),
        ValueError,
        "is a directory",
    ),
    "Topology flags coerced": (
        lambda: hep.Topology("ep", ("ep",), (4,), single_process="no"),
        TypeError,
        "single_process must be a bool, got 'no'",
    ),
    "a mesh axis named twice": (
        lambda: hep.Topology("ep", ("ep", "ep"), (2, 2)),
        ValueError,
        "name an axis twice",
    ),
    "a stream model domain past G": (
        lambda: cost.a2a_volume(9, g=8, d=1.0),
        ValueError,
        r"s must be a finite number in \[1, 8\]",
    ),
}


@pytest.mark.parametrize("case", sorted(SILENTLY_WRONG))
def test_values_that_gave_silently_wrong_results_are_refused(case):
    make, error, match = SILENTLY_WRONG[case]
    with pytest.raises(error, match=match):
        make()


def test_moe_block_refuses_integer_input(ep4):
    mesh, topo = ep4
    block = hnn.MoEBlock(
        8,
        router=hnn.RouterConfig(num_experts=8, top_k=2),
        experts=hnn.ExpertConfig(d_ff=16),
        mesh=mesh,
        topology=topo,
        rngs=nnx.Rngs(0),
    )
    with pytest.raises(TypeError, match="x must be floating point, got int32"):
        block(jnp.ones((4, 8), jnp.int32))  # returned int32 outputs before
    with pytest.raises(ValueError, match=r"x must be \[..., d_model=8\], got shape \(4, 6\)"):
        block(jnp.ones((4, 6)))


# ------------------------------------------------------------------ foreign errors, now named


def _traced(mesh, fn, *args):
    """Traces fn per shard under shard_map (nothing compiles)."""
    spec = P(tuple(mesh.axis_names))
    return jax.eval_shape(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec), *args)


def test_op_arguments_of_the_wrong_type_are_named(ep4):
    mesh, topo = ep4
    cfg = hep.DispatchConfig(num_experts=8)
    x, idx, w = jnp.ones((16, 4)), jnp.zeros((16, 2), jnp.int32), jnp.ones((16, 2))

    def dispatch(config):
        return lambda x, i, w: hep.dispatch(x, i, w, topology=topo, config=config).tokens

    with pytest.raises(TypeError, match="config must be a jax_hybridep.DispatchConfig, got Non"):
        _traced(mesh, dispatch(None), x, idx, w)
    cfg8 = hep.DispatchConfig(num_experts=8, wire_dtype="float8_e4m3fn", fp8_rows=True)

    def as_list(x, i, w):
        return hep.dispatch(list(fp8.quantize(x)), i, w, topology=topo, config=cfg8).weights

    with pytest.raises(TypeError, match="got a list of 2 \\(pass the quantised pair as a tuple"):
        _traced(mesh, as_list, x, idx, w)

    def combine(**kw):
        def fn(x, i, w):
            d = hep.dispatch(x, i, w, topology=topo, config=cfg)
            return hep.combine(d.tokens, d.handle, **kw)

        return fn

    with pytest.raises(TypeError, match="topology must be a Topology or None, got Mesh"):
        _traced(mesh, combine(topology=mesh), x, idx, w)
    with pytest.raises(TypeError, match="config must be a jax_hybridep.DispatchConfig, got str"):
        _traced(mesh, combine(config="ffi"), x, idx, w)


FOREIGN = {
    "Topology.from_mesh(None)": (
        lambda ep4, dc2: hep.Topology.from_mesh(None),
        TypeError,
        "mesh must be a jax.sharding",
    ),
    "an unknown axis": (
        lambda ep4, dc2: ep4[1].axis_size("x"),
        ValueError,
        "axis 'x' is not a mesh axis",
    ),
    "non-numeric loads": (
        lambda ep4, dc2: balance.plan_placement(["a"] * 8, 4, 2, 1),
        TypeError,
        "load must hold real numbers",
    ),
    "a current placement of the wrong type": (
        lambda ep4, dc2: balance.plan_placement([1.0] * 8, 4, 2, 1, current="x"),
        TypeError,
        "current must be a balance.Placement or None",
    ),
    "Replicas without a topology": (
        lambda ep4, dc2: balance.Replicas(balance.Placement.default(8, 4), None),
        TypeError,
        "topology must be a jax_hybridep.Topology",
    ),
    "one array where a sequence of arrays goes": (
        lambda ep4, dc2: balance.Replicas(balance.Placement.default(8, 4, 1), ep4[1]).gather(
            np.ones((2, 2, 3))
        ),
        TypeError,
        "wrap one array in a tuple",
    ),
    "a float perm": (
        lambda ep4, dc2: moves.permute(np.ones(3), [0.0, 1.0, 2.0]),
        TypeError,
        "perm must hold",
    ),
    "ExpertDomains on another mesh": (
        lambda ep4, dc2: xdc.ExpertDomains.from_mesh(ep4[0], dc2[1], xdc.Migration(domains={})),
        ValueError,
        "the topology was built for mesh",
    ),
    "a cluster of the wrong type": (
        lambda ep4, dc2: planner.evaluate(None, _workload(), (1, 1)),
        TypeError,
        "cluster must be a cost.Cluster",
    ),
    "a schedule given as its spec": (
        lambda ep4, dc2: xdc.Replanner(_cluster(), _workload(), every=1, schedule="10:dc=1"),
        TypeError,
        "schedule must be a LinkSchedule",
    ),
    "links given as a list": (
        lambda ep4, dc2: xdc.parse_links("dc=1", ["dc"]),
        TypeError,
        "levels must be a",
    ),
    "G = 0 in the stream model": (
        lambda ep4, dc2: cost.a2a_volume(1, g=0, d=1.0),
        ValueError,
        "g must be an int >= 1",
    ),
    "a zero domain": (
        lambda ep4, dc2: sim.lower_bound(sim.Datacenters(4), sim.MoELayer(), 0),
        ValueError,
        "domain size 0 must divide",
    ),
    "a simulator without a network": (
        lambda ep4, dc2: sim.simulate(None, _flows()),
        TypeError,
        "net must be a sim.Network",
    ),
    "zero members in an all-reduce": (
        lambda ep4, dc2: traffic.all_reduce_bytes(8, 0, 0),
        ValueError,
        "members must be an int",
    ),
    "route without a config": (
        lambda ep4, dc2: hnn.route(jnp.ones((4, 8)), jnp.zeros(8), None),
        TypeError,
        "config must be a jax_hybridep.nn.RouterConfig",
    ),
    "blocks given as a string": (
        lambda ep4, dc2: hnn.prefetch_experts("blocks"),
        TypeError,
        "blocks must be a sequence",
    ),
    "a 1-D tensor to quantize": (
        lambda ep4, dc2: fp8.quantize(np.ones(4, np.float32)),
        ValueError,
        r"x must be \[T, H\]",
    ),
}


@pytest.mark.parametrize("case", sorted(FOREIGN))
def test_foreign_errors_now_name_the_argument(case, ep4, dc2):
    make, error, match = FOREIGN[case]
    with pytest.raises(error, match=match):
        make(ep4, dc2)


# ------------------------------------------------------------------------------- output paths


def test_output_paths_are_checked_and_their_directories_created(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="cannot be created: .* is a file"):
        values.check_output_path("csv", str(tmp_path / "file" / "x.csv"))
    with pytest.raises(ValueError, match="is a directory, not a file path"):
        values.check_output_path("csv", str(tmp_path))
    with pytest.raises(TypeError, match="csv must be a file path, got None"):
        values.check_output_path("csv", None)
    nested = tmp_path / "a" / "b" / "rows.csv"
    assert values.check_output_path("csv", str(nested)) == str(nested)
    assert not (tmp_path / "a").exists()  # checking creates nothing
    sim.write_csv([], str(nested))
    assert nested.read_text().startswith("dc_gbps,")


def test_sim_cli_refuses_a_bad_output_path_before_the_sweep(tmp_path, capsys):
    from jax_hybridep.sim.__main__ import main

    (tmp_path / "file").write_text("")
    bad = str(tmp_path / "file" / "x.csv")
    with pytest.raises(SystemExit) as info:
        main(["--csv", bad, "--png", ""])  # the default sweep would take minutes
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(
        f"argument --csv: '{bad}' cannot be created: '{tmp_path / 'file'}' is a file"
    )


def test_empty_lists_and_numpy_shapes_are_accepted_where_valid():
    assert values.check_array("x", [], integer=True, nonempty=False).size == 0
    shape = hep.Topology(mesh_axes=("ep",), mesh_shape=np.array([4]), levels=("ep",)).mesh_shape
    assert shape == (4,) and type(shape[0]) is int

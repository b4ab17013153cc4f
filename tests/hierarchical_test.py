"""Multi-level topologies beyond the contract suite (tests/contract_test.py runs every §2.1 case
on one to three levels, on every route kind, and checks the run-time copies per level against an
independent count of (token, destination group) pairs): the xla backend's compiled all-to-alls
move exactly the padded per-level buffers, and a level spanning two mesh axes has the sizes and
strides the walk relies on."""

import numpy as np
import pytest
from harness import make_mesh, moe_fn, random_routing

import jax_hybridep as hep
from jax_hybridep import traffic

MESHES = {
    "node2_local4": ((2, 4), ("node", "local")),
    "dc2_node2_local4": ((2, 2, 4), ("dc", "node", "local")),
}
T, H, F = 5, 8, 8


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_xla_all_to_alls_move_the_padded_level_buffers(mesh_name):
    """(In one process every ffi level exchanges by direct write: no all-to-all to read.)"""
    shape, names = MESHES[mesh_name]
    mesh = make_mesh(shape, names)
    topo = hep.Topology.from_mesh(mesh, names)
    ep = int(np.prod(shape))
    num_experts, k = 2 * ep, 4
    rng = np.random.default_rng(21)
    idx, w = random_routing(rng, ep * T, k, num_experts, invalid_fraction=0.1)
    x = rng.normal(size=(ep * T, H)).astype(np.float32)
    experts = (rng.normal(size=(num_experts, H, F)) / np.sqrt(H)).astype(np.float32)
    hier = moe_fn(mesh, topo, hep.DispatchConfig(num_experts=num_experts, backend="xla"))
    hlo = hier.lower(x, idx, w, experts).compile().as_text()
    moved = {
        (groups, size) for kind, size, groups in traffic.all_to_all_bytes(hlo) if kind == "f32"
    }
    for level, size in zip(names, traffic.padded_level_bytes(topo, T, H, np.float32), strict=True):
        assert any(level in groups and n == size for groups, n in moved), (level, size, moved)
    rows = np.array([3, 5, 7])
    np.testing.assert_array_equal(traffic.level_bytes(rows, H, np.float32), rows * H * 4)


def test_a_level_spanning_two_mesh_axes():
    """Levels are groups of mesh axes: ("node", ("x", "y")) is two levels over three axes (the
    contract suite's `level_over_two_axes` case runs it)."""
    mesh = make_mesh((2, 2, 2), ("node", "x", "y"))
    topo = hep.Topology.from_mesh(mesh, ("node", ("x", "y")))
    assert topo.level_sizes == (2, 4) and topo.level_strides == (4, 1)
    assert topo.ep_axes == ("node", "x", "y") and topo.ep_size == 8

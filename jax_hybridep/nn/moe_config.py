"""The MoE block's grouped settings, checked and resolved before any parameter is made: its mesh
(the topology's own), the dispatch config it runs, its expert domains (`xdc.Migration` ->
`xdc.ExpertDomains`) and its replica placement (`balance.BalanceConfig` -> `balance.Placement`);
and, once per call, the token exchange they make (`Exchange`). Each failure is a
ValueError/TypeError naming the setting."""

from __future__ import annotations

import dataclasses

import jax

import jax_hybridep as hep
from jax_hybridep import balance
from jax_hybridep.nn.experts import ExpertConfig
from jax_hybridep.nn.router import RouterConfig
from jax_hybridep.values import check_int
from jax_hybridep.xdc.migration import Migration
from jax_hybridep.xdc.runtime.domains import ExpertDomains


def check_block(d_model, router, experts) -> None:
    """The block's own arguments' types."""
    check_int("d_model", d_model, 1)
    for name, value, cls in (("router", router, RouterConfig), ("experts", experts, ExpertConfig)):
        if not isinstance(value, cls):
            raise TypeError(f"{name} must be a jax_hybridep.nn.{cls.__name__}, got {value!r}")


def block_mesh(mesh, topology, router: RouterConfig) -> jax.sharding.Mesh:
    """The mesh the block runs on: the topology's own (`Topology.from_mesh`), or `mesh` when the
    topology holds none; given both, they must be one mesh. The experts must split over its EP
    size."""
    if not isinstance(topology, hep.Topology):
        raise TypeError(f"topology must be a jax_hybridep.Topology, got {type(topology).__name__}")
    if mesh is None:
        mesh = topology.mesh
        if mesh is None:
            raise TypeError(
                f"the block needs a mesh: topology {topology.levels} over {topology.mesh_dict} "
                "holds none (it was not built by Topology.from_mesh); build it with "
                "Topology.from_mesh(mesh, ...) or pass mesh="
            )
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    mesh_shape = dict(mesh.shape)
    if topology.mesh_dict != mesh_shape:
        raise ValueError(
            f"topology was built for mesh {topology.mesh_dict}, but the block's mesh is "
            f"{mesh_shape}; build it with Topology.from_mesh(mesh, ...)"
        )
    if topology.mesh is not None and topology.mesh != mesh:
        raise ValueError(
            f"topology was built for another mesh of the same axes: the topology's mesh "
            f"{dict(topology.mesh.shape)} of devices {topology.mesh.device_ids.tolist()}, the "
            f"block's mesh {mesh_shape} of devices {mesh.device_ids.tolist()}; pass one of them "
            "(the topology alone is enough)"
        )
    if router.num_experts % topology.ep_size:
        raise ValueError(
            f"router.num_experts={router.num_experts} experts do not split evenly over the EP "
            f"size {topology.ep_size} (EP axes {topology.ep_axes} of mesh {mesh_shape}): the "
            "stacked expert weights are sharded over them"
        )
    return mesh


def block_dispatch(dispatch, router: RouterConfig) -> hep.DispatchConfig:
    """The dispatch config the block runs: `dispatch` (default: the router's expert count) with
    zero_padding=False, as both expert paths (ragged_dot, the CPU capacity windows) ignore rows
    past the groups by a select, so the block never pays for writing them."""
    dispatch = dispatch or hep.DispatchConfig(num_experts=router.num_experts)
    if not isinstance(dispatch, hep.DispatchConfig):
        raise TypeError(f"dispatch must be a jax_hybridep.DispatchConfig, got {dispatch!r}")
    if dispatch.num_experts != router.num_experts:
        raise ValueError(
            f"dispatch.num_experts={dispatch.num_experts} differs from "
            f"router.num_experts={router.num_experts}"
        )
    if dispatch.fp8_rows:
        raise ValueError(
            "MoEBlock trains through dispatch's rows, so it needs dequantised rows: use "
            "DispatchConfig(wire_dtype='float8_e4m3fn') without fp8_rows=True"
        )
    return dataclasses.replace(dispatch, zero_padding=False)


def block_domains(migration, mesh, topology) -> ExpertDomains | None:
    """The block's expert domains; None (plain EP) without a migration or with no domains."""
    if migration is None:
        return None
    if not isinstance(migration, Migration):
        raise TypeError(f"migration must be a jax_hybridep.xdc.Migration, got {migration!r}")
    if migration.domains:
        return ExpertDomains.from_mesh(mesh, topology, migration)
    if migration.compression is not None or migration.grad_compression is not None:
        raise ValueError(
            f"Migration(compression={migration.compression}, grad_compression="
            f"{migration.grad_compression}) needs domains (they compress the experts moved "
            "inside a domain)"
        )
    return None


def block_placement(balance_config, dispatch: hep.DispatchConfig, topology, domains):
    """The block's replica placement (None: plain EP), checked against its experts, mesh,
    dispatch config and domains."""
    if balance_config is None:
        return None
    if not isinstance(balance_config, balance.BalanceConfig):
        raise TypeError(
            f"balance must be a jax_hybridep.balance.BalanceConfig, got {balance_config!r}"
        )
    if domains is not None:
        raise ValueError(
            "balance (redundant slots / a placement) cannot be combined with expert domains: "
            "inside a domain every expert is already replicated on every member "
            "(docs/balance.md)"
        )
    if dispatch.expert_placement is not None or dispatch.num_local_slots is not None:
        raise ValueError(
            "balance's placement replaces DispatchConfig.expert_placement and num_local_slots; "
            "leave those unset"
        )
    return balance_config.placement_for(dispatch.num_experts, topology)


@dataclasses.dataclass(frozen=True)
class Exchange:
    """The token exchange one block call runs (static; `block_exchange`).

    Attributes:
      mesh: the mesh the call's `shard_map` runs over (with expert domains, the split mesh).
      topology: the topology `dispatch`/`combine` run on (with domains, the outer axes only).
      config: the dispatch config (with domains, the replica placement and its slots).
      expert_axes: the mesh axes the stacked experts' dim is sharded over.
    """

    mesh: jax.sharding.Mesh
    topology: hep.Topology
    config: hep.DispatchConfig
    expert_axes: tuple[str, ...]


def block_exchange(mesh, topology, dispatch: hep.DispatchConfig, domains) -> Exchange:
    """The exchange of a block on `mesh` and `topology` running `dispatch`: plain EP, or its
    expert domains' (tokens only between domains)."""
    if domains is None:
        return Exchange(mesh, topology, dispatch, topology.ep_axes)
    return Exchange(
        domains.mesh, domains.token_topology, domains.dispatch_config(dispatch), domains.expert_axes
    )

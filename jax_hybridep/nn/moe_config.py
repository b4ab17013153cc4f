"""The MoE block's grouped settings, checked and resolved before any parameter is made: the
dispatch config it runs, its expert domains (`xdc.Migration` -> `xdc.ExpertDomains`) and its
replica placement (`balance.BalanceConfig` -> `balance.Placement`). Each failure is a
ValueError/TypeError naming the setting."""

from __future__ import annotations

import dataclasses

import jax

import jax_hybridep as hep
from jax_hybridep import balance, xdc
from jax_hybridep.nn.experts import ExpertConfig
from jax_hybridep.nn.router import RouterConfig
from jax_hybridep.values import check_int


def check_block(d_model, router, experts, mesh, topology) -> None:
    """The block's own arguments: types, and the experts against the mesh's EP size."""
    check_int("d_model", d_model, 1)
    for name, value, cls in (("router", router, RouterConfig), ("experts", experts, ExpertConfig)):
        if not isinstance(value, cls):
            raise TypeError(f"{name} must be a jax_hybridep.nn.{cls.__name__}, got {value!r}")
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if not isinstance(topology, hep.Topology):
        raise TypeError(f"topology must be a jax_hybridep.Topology, got {type(topology).__name__}")
    mesh_shape = dict(mesh.shape)
    if topology.mesh_dict != mesh_shape:
        raise ValueError(
            f"topology was built for mesh {topology.mesh_dict}, but the block's mesh is "
            f"{mesh_shape}; build it with Topology.from_mesh(mesh, ...)"
        )
    if router.num_experts % topology.ep_size:
        raise ValueError(
            f"router.num_experts={router.num_experts} experts do not split evenly over the EP "
            f"size {topology.ep_size} (EP axes {topology.ep_axes} of mesh {mesh_shape}): the "
            "stacked expert weights are sharded over them"
        )


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


def block_domains(migration, mesh, topology) -> xdc.ExpertDomains | None:
    """The block's expert domains; None (plain EP) without a migration or with no domains."""
    if migration is None:
        return None
    if not isinstance(migration, xdc.Migration):
        raise TypeError(f"migration must be a jax_hybridep.xdc.Migration, got {migration!r}")
    if migration.domains:
        return xdc.ExpertDomains.from_mesh(mesh, topology, migration)
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

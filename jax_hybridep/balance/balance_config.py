"""`BalanceConfig`: an MoE block's expert load balancing as one value (redundant slots for copies
of hot experts and the placement to start from), resolved into a checked `Placement`."""

from __future__ import annotations

import dataclasses

from jax_hybridep.balance.placement import Placement
from jax_hybridep.values import check_int


@dataclasses.dataclass(frozen=True)
class BalanceConfig:
    """Copies of hot experts in an MoE block (`nn.MoEBlock(balance=...)`, docs/balance.md).

    A block given one runs with a replica placement (logical ids -> physical slots, replicas
    fetched each step), even with no redundant slot: its experts can then move between ranks
    (`MoEBlock.set_placement`). Exact: values and gradients equal the block without copies'.

    Attributes:
      redundant_slots: extra expert slots per EP rank for copies of hot experts (0: none);
        None: the placement's (0 without one).
      placement: the `Placement` to start from; None: plain EP's order, redundant slots empty.
    """

    redundant_slots: int | None = None
    placement: Placement | None = None

    def __post_init__(self):
        if self.redundant_slots is not None:
            check_int("BalanceConfig.redundant_slots", self.redundant_slots, 0)
        p = self.placement
        if p is not None and not isinstance(p, Placement):
            raise TypeError(
                f"BalanceConfig.placement must be a jax_hybridep.balance.Placement, got {p!r}"
            )
        slots = self.redundant_slots
        if p is not None and slots is not None and p.redundant_per_rank != slots:
            raise ValueError(
                f"BalanceConfig.placement has {p.redundant_per_rank} redundant slots per rank, "
                f"redundant_slots={self.redundant_slots}"
            )

    def placement_for(self, num_experts: int, topology) -> Placement:
        """The starting placement for `num_experts` experts on `topology`'s EP group (ValueError
        when a given placement is for other experts or ranks)."""
        if self.placement is None:
            return Placement.for_topology(num_experts, topology, self.redundant_slots or 0)
        p, ranks = self.placement, topology.ep_size
        if (p.num_experts, p.num_ranks) != (num_experts, ranks):
            raise ValueError(
                f"placement is for {p.num_experts} experts on {p.num_ranks} ranks; the block has "
                f"{num_experts} experts on EP size {ranks}"
            )
        return p

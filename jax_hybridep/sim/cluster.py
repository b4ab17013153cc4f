"""The simulator's inputs: the datacenters and their links (`Datacenters`), one MoE layer's sizes
and compute (`MoELayer`), and the kinds of traffic phase a layer step is made of (`Phase`).

Rank (d, i) is GPU i of DC d. Links (each direction its own link): one per GPU to its DC fabric
(`gpu_gbps`, PCIe/NVLink class), one uplink and one downlink per DC (`dc_gbps`, shared by the
DC's GPUs); the WAN core between DCs is non-blocking, so only up- and downlinks contend.
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from jax_hybridep.sim.network import Congestion
from jax_hybridep.values import check_bool, check_int, check_real, is_int

TOKENS, GRADS = 0, 1  # Flows.tag values
EXCHANGES = ("hierarchical", "flat")


def _number(owner, name: str, value, low: float = 0.0, strict: bool = False) -> None:
    """Sets owner.name to `value` as a float; ValueError unless it is a finite real number
    >= low (> 0 when strict)."""
    value = check_real(f"{type(owner).__name__}.{name}", value, low, positive=strict)
    object.__setattr__(owner, name, value)


def _count(owner, name: str, value, low: int = 1) -> None:
    object.__setattr__(owner, name, check_int(f"{type(owner).__name__}.{name}", value, low))


def _flag(owner, name: str) -> None:
    object.__setattr__(
        owner, name, check_bool(f"{type(owner).__name__}.{name}", getattr(owner, name))
    )


@dataclasses.dataclass(frozen=True)
class Datacenters:
    """Datacenters, links and per-message costs.

    Attributes:
      num_dcs: N, datacenters.
      gpus_per_dc: g, GPUs (ranks) per DC.
      dc_gbps: each DC's uplink and downlink (each direction), Gbit/s, shared by its g GPUs.
      gpu_gbps: each GPU's link to its DC (PCIe 3.0 x16 class in the paper's testbed), Gbit/s.
      wan_latency_s: one-way latency a cross-DC message pays before its bytes flow (RTT/2).
      intra_latency_s: the same inside a DC.
      msg_overhead_s: o, sender cost per message; a rank's messages start o apart.
      header_bytes: bytes added to every message.
      min_window_bytes: a flow's minimum window; min window / RTT is its floor rate.
      congestion_exponent: `Congestion.exponent` on the DC links (0: ideal max-min sharing).
      exchange: "hierarchical" (cross-DC to the same GPU index, then forwarded inside the DC) or
        "flat" (every rank to every peer rank directly).
    """

    num_dcs: int
    gpus_per_dc: int = 8
    dc_gbps: float = 10.0
    gpu_gbps: float = 128.0
    wan_latency_s: float = 5e-3
    intra_latency_s: float = 5e-6
    msg_overhead_s: float = 5e-6
    header_bytes: float = 0.0
    min_window_bytes: float = 1500.0
    congestion_exponent: float = 0.1
    exchange: str = "hierarchical"

    def __post_init__(self):
        _count(self, "num_dcs", self.num_dcs)
        _count(self, "gpus_per_dc", self.gpus_per_dc)
        for name in ("dc_gbps", "gpu_gbps"):
            _number(self, name, getattr(self, name), strict=True)
        for name in (
            "wan_latency_s",
            "intra_latency_s",
            "msg_overhead_s",
            "header_bytes",
            "min_window_bytes",
            "congestion_exponent",
        ):
            _number(self, name, getattr(self, name))
        if not isinstance(self.exchange, str) or self.exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {self.exchange!r}")

    def check_domain(self, domain) -> int:
        """domain as an int, when it is a DC-level domain size S that divides num_dcs."""
        if not is_int(domain) or domain < 1 or self.num_dcs % domain:
            raise ValueError(f"domain size {domain!r} must divide the DC count {self.num_dcs}")
        return int(domain)

    @property
    def num_ranks(self) -> int:
        return self.num_dcs * self.gpus_per_dc

    def floor(self, cross: np.ndarray) -> np.ndarray:
        """Per-flow floor rate (min window / RTT) of intra-DC (False) or cross-DC (True) flows."""
        cross = np.asarray(cross)
        if cross.dtype != bool:
            raise TypeError(f"cross must be a bool array (cross-DC or not), got {cross.dtype}")
        rtt = 2 * np.where(cross, self.wan_latency_s, self.intra_latency_s)
        return np.where(rtt > 0, self.min_window_bytes / np.maximum(rtt, 1e-300), 0.0)

    @property
    def congestion(self) -> Congestion:
        return Congestion(self.congestion_exponent)

    @property
    def hierarchical(self) -> bool:
        return self.exchange == "hierarchical"

    def token_messages(self, domain: int) -> tuple[int, int]:
        """(cross-DC, intra-DC) messages a rank sends in one token exchange with domain S."""
        self.check_domain(domain)
        m, g = self.num_dcs // domain, self.gpus_per_dc
        return (m - 1, g - 1) if self.hierarchical else ((m - 1) * g, g - 1)

    def scatter_slot(self, domain: int) -> int:
        """Posting slot of a rank's first reduce-scatter message: after its token messages of
        the phase the reduce-scatter joins (hierarchical: the WAN stage; flat: all of them)."""
        cross, local = self.token_messages(domain)
        return cross if self.hierarchical else cross + local


@dataclasses.dataclass(frozen=True)
class MoELayer:
    """One MoE layer's sizes and compute (backward compute is twice the forward's).

    Attributes:
      data_bytes: D, bytes a rank feeds into one token all-to-all.
      expert_bytes: P_E, expert bytes a rank holds (all-gathered / reduce-scattered in a domain);
        the simulator takes them to be one expert (the shared expert of SR compression has
        their size).
      compute_s: forward compute that overlaps no communication (experts, post-expert work).
      pre_expert_s: Lat_PE, forward pre-expert compute that the expert all-gather can hide under.
      skew: Zipf exponent of routing over the destination GPU index (0: uniform).
      forward_only: time the forward pass only.
      compression: SR compression of the forward expert all-gather, full bytes / bytes sent
        (1: off). Above 1 the layer also keeps the shared expert in sync: an all-reduce of
        `expert_bytes` over the domain (a reduce-scatter then an all-gather, `P_E / S` to each
        of the S - 1 peers), before the gather.
      compress_gradients: the backward reduce-scatter compressed as well. False (default) is
        this package's runtime: exact gradients, reduce-scattered at full size.
    """

    data_bytes: float = 48e6
    expert_bytes: float = 0.36e6
    compute_s: float = 10e-3
    pre_expert_s: float = 5e-3
    skew: float = 0.0
    forward_only: bool = False
    compression: float = 1.0
    compress_gradients: bool = False

    def __post_init__(self):
        for name in ("data_bytes", "expert_bytes", "compute_s", "pre_expert_s", "skew"):
            _number(self, name, getattr(self, name))
        _number(self, "compression", self.compression, low=1.0)
        _flag(self, "forward_only")
        _flag(self, "compress_gradients")

    @property
    def compressed(self) -> bool:
        return self.compression > 1

    @property
    def gather_bytes(self) -> float:
        """Bytes of one forward all-gather message (one rank's experts, as sent)."""
        return self.expert_bytes / self.compression if self.compressed else self.expert_bytes

    @property
    def scatter_bytes(self) -> float:
        """Bytes of one backward reduce-scatter message (full size unless compress_gradients)."""
        return self.gather_bytes if self.compress_gradients else self.expert_bytes


class Phase(enum.Enum):
    """The message patterns a layer step is simulated from (each a set of messages that start
    together; several can be simulated jointly)."""

    DISPATCH = "dispatch"  # flat token all-to-all, sized by the destination's routing weight
    COMBINE = "combine"  # its transpose, sized by the sender's weight
    WAN = "wan"  # hierarchical exchange, cross-DC stage (the same in both directions)
    LOCAL_DISPATCH = "local_dispatch"  # hierarchical, intra-DC stage of dispatch
    LOCAL_COMBINE = "local_combine"  # hierarchical, intra-DC stage of combine
    GATHER = "gather"  # forward expert all-gather within the domain
    SCATTER = "scatter"  # backward reduce-scatter of replica gradients (after the token messages)
    SYNC = "sync"  # one half of the shared-expert all-reduce (SR compression)

    @property
    def rail(self) -> bool:
        """Messages to the rank with the sender's GPU index in other DCs of its domain."""
        return self in (Phase.GATHER, Phase.SCATTER, Phase.SYNC)

    @property
    def local(self) -> bool:
        """The hierarchical exchange's intra-DC stage."""
        return self in (Phase.LOCAL_DISPATCH, Phase.LOCAL_COMBINE)

    @property
    def transposed(self) -> bool:
        """A combine pattern: sized by the sender's routing weight instead of the receiver's."""
        return self in (Phase.COMBINE, Phase.LOCAL_COMBINE)

    @property
    def tag(self) -> int:
        return GRADS if self is Phase.SCATTER else TOKENS

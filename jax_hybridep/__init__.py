"""jax_hybridep: expert-parallel MoE dispatch and combine for JAX, as XLA FFI custom calls.

topo = hep.Topology.from_mesh(mesh, levels=("ep",))
cfg = hep.DispatchConfig(num_experts=64)
# inside jax.shard_map over topo's axes, per shard:
d = hep.dispatch(x, topk_idx, topk_weights, topology=topo, config=cfg)
out = hep.combine(experts(d.tokens, d.group_sizes), d.handle, weights=d.weights)
"""

from jax_hybridep import _native  # noqa: F401  (registers the FFI targets)
from jax_hybridep.config import DispatchConfig
from jax_hybridep.errors import StrictModeError, TransportError, check_errors, typed_errors
from jax_hybridep.exchange.handle import Handle
from jax_hybridep.ops import Dispatched, DispatchStats, combine, dispatch
from jax_hybridep.topology import Topology

__all__ = [
    "DispatchConfig",
    "Dispatched",
    "DispatchStats",
    "Handle",
    "StrictModeError",
    "Topology",
    "TransportError",
    "check_errors",
    "combine",
    "dispatch",
    "typed_errors",
]
__version__ = "0.1.0"

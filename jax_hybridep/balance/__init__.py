"""Expert load balancing: redundant copies of hot experts placed from measured load (docs/design.md
§2.1.6), with exact training.

* `BalanceConfig` (`balance_config`): a block's balancing as one value (redundant slots, the
  placement to start from), `nn.MoEBlock(balance=...)`.
* `Placement` (`placement`): each logical expert's physical slots (one primary, where its weights
  are stored, and any redundant copies), the replica rule that spreads a hot expert's rows over
  its copies (the sender's node first), and the loads and replica-sync bytes it predicts.
* `plan_placement` (`balancer`): the balancer, from a moving average of `tokens_per_expert`.
* `Replicas` (`runtime`): per shard, logical ids -> physical slots before `dispatch` and the
  replicas' weights fetched from their primaries (gradients summed back exactly).
* `move_experts` (`moves`): stored weights and optimiser state moved to a new placement.
* `skews`: skewed routings (Zipf, DeepSeek-V3-like group-limited) for the balance table, which
  the benchmark measures (`python -m jax_hybridep.bench.balance`; the algorithm here imports no
  benchmark).
"""

from jax_hybridep.balance import balance_config, balancer, moves, placement, runtime, skews
from jax_hybridep.balance.balance_config import BalanceConfig
from jax_hybridep.balance.balancer import BalancePlan, moving_average, plan_placement
from jax_hybridep.balance.moves import expert_tags, move_experts
from jax_hybridep.balance.placement import EMPTY, Placement, imbalance, permutation
from jax_hybridep.balance.runtime import Replicas, ReplicaStats

__all__ = [
    "EMPTY",
    "BalanceConfig",
    "BalancePlan",
    "Placement",
    "ReplicaStats",
    "Replicas",
    "balance_config",
    "balancer",
    "expert_tags",
    "imbalance",
    "move_experts",
    "moves",
    "moving_average",
    "permutation",
    "placement",
    "plan_placement",
    "runtime",
    "skews",
]

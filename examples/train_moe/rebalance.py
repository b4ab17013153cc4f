"""Expert load balancing in the main job (--redundant_slots, --rebalance_every).

`Rebalancer` keeps a moving average of each MoE block's `tokens_per_expert`, re-places the
experts every --rebalance_every steps with `jax_hybridep.balance.plan_placement` (a block keeps
its placement unless the new one is predicted to be better by more than 2%), and moves the
stored expert weights and Adam's moments to the new order (`balance.move_experts`): training
continues as if nothing had moved, up to float32 summation order. A placement is static, so the
caller recompiles its steps only when one changed.

Checkpoints hold the state in plain EP's order (each logical expert once, where a run without
redundant slots keeps it), beside the placements and load averages in the checkpoint's meta:
`--resume` restores the state, then moves it to the saved placements, so a resumed run compiles
the same program and continues identically.

With several processes (`job_runtime/processes.py`) process 0 plans from its load averages (the
counts are all-reduced in the step, so every process holds the same ones) and every process applies
its decision; the processes then compare a digest of the placements they hold, recorded with each
event (`placement_digests`, one per process), and stop if they differ.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
from flax import nnx

from examples.job_runtime.processes import Processes
from jax_hybridep import balance

LOAD_DECAY = 0.9  # the moving average of tokens_per_expert (about the last 10 steps)
META_KEY = "balance"


class Rebalancer:
    """The balancing state of one run: per replicated block, its placement and load average."""

    def __init__(self, cfg, graphdef, params, rest, tx, processes: Processes | None = None):
        self.every = cfg.rebalance_every
        self.tx = tx
        self.processes = processes or Processes()
        model = nnx.merge(graphdef, params, rest)
        self.tags, blocks = balance.expert_tags(model, params)
        self.placements = [b.placement for b in blocks]
        self.loads: list[np.ndarray | None] = [None] * len(blocks)
        self.last_events: list[dict] = []  # the last `rebalance`'s, one per measured block
        # Charged replica sync (--charge_sync): an expert's weights against the bytes a routed
        # row moves per step (dispatch and combine, forward and backward).
        itemsize = 4  # float32 parameters and activations
        d, f = cfg.model.d_model, cfg.model.d_ff
        self.expert_bytes = 3 * d * f * itemsize if cfg.charge_sync else 0
        self.row_bytes = 4 * d * itemsize if cfg.charge_sync else 0

    @property
    def active(self) -> bool:
        return bool(self.placements)

    def observe(self, tokens_per_expert) -> None:
        """One step's [blocks, E] tokens_per_expert into the moving averages."""
        for i, counts in enumerate(np.asarray(tokens_per_expert)):
            self.loads[i] = balance.moving_average(self.loads[i], counts, LOAD_DECAY)

    def due(self, completed_steps: int) -> bool:
        return self.active and self.every > 0 and completed_steps % self.every == 0

    def rebalance(self, step, graphdef, params, rest, opt_state):
        """Re-places every block from its load average (process 0's decision). Returns
        (changed, graphdef, params, rest, opt_state) with the state moved; an event per measured
        block is kept in `last_events`."""
        decision = self.processes.decide(f"rebalance {step}", lambda: self._plan(step))
        perms, changed = [], False
        self.last_events = [event for _, event in decision if event is not None]
        for i, (placement, _) in enumerate(decision):
            if placement is None:
                perms.append(None)
                continue
            new = balance.Placement.from_json(placement)
            perms.append(balance.permutation(self.placements[i], new))
            self.placements[i], changed = new, True
        digests = self.processes.exchange(f"placements {step}", self.digest())
        if len(set(digests)) > 1:
            raise RuntimeError(
                f"step {step}: the processes hold different expert placements after the same "
                f"re-balancing decision (digests {digests})"
            )
        for event in self.last_events:
            event["placement_digests"] = digests
        if not changed:
            return False, graphdef, params, rest, opt_state
        return (True, *self._move(graphdef, params, rest, opt_state, perms))

    def _plan(self, step) -> list:
        """Per block: (the new placement as JSON, or None to keep it; the event, or None when
        nothing was measured yet)."""
        decision = []
        for i, current in enumerate(self.placements):
            if self.loads[i] is None:  # nothing measured yet (e.g. resumed without averages)
                decision.append((None, None))
                continue
            plan = balance.plan_placement(
                self.loads[i],
                current.num_ranks,
                current.slots_per_rank,
                current.redundant_per_rank,
                current.ranks_per_node,
                current=current,
                expert_bytes=self.expert_bytes,
                row_bytes=self.row_bytes,
            )
            event = dict(
                step=step,
                layer=i,
                changed=plan.changed,
                predicted_before=plan.before,
                predicted_after=plan.after,
                remote_replicas=plan.placement.remote_replicas,
                sync_bytes_per_step=int(sum(plan.sync_bytes)),
                moved_experts=plan.moved_experts if plan.changed else 0,
            )
            decision.append((plan.placement.to_json() if plan.changed else None, event))
        return decision

    def digest(self) -> str:
        """A short digest of the placements this process holds."""
        text = json.dumps([p.to_json() for p in self.placements], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def _move(self, graphdef, params, rest, opt_state, perms):
        params = balance.move_experts(params, self.tags, perms)
        opt_state = balance.move_experts(opt_state, self.tags, perms, tx=self.tx)
        model = nnx.merge(graphdef, params, rest)
        for block, placement in zip(
            balance.expert_tags(model, params)[1], self.placements, strict=True
        ):
            block.placement = placement
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        return graphdef, params, rest, opt_state

    # -- checkpoints ----------------------------------------------------------------------------

    def _to_plain_order(self):
        return [balance.permutation(p, _plain(p)) for p in self.placements]

    def checkpoint_state(self, params, opt_state):
        """(params, opt_state) in plain EP's expert order, for the checkpoint."""
        if not self.active:
            return params, opt_state
        perms = self._to_plain_order()
        return (
            balance.move_experts(params, self.tags, perms),
            balance.move_experts(opt_state, self.tags, perms, tx=self.tx),
        )

    def to_meta(self) -> dict:
        return dict(
            placements=[p.to_json() for p in self.placements],
            loads=[None if v is None else v.tolist() for v in self.loads],
        )

    def restore(self, saved_meta, graphdef, params, rest, opt_state):
        """After the checkpoint's state was restored (plain order, onto blocks built in plain
        order): the saved placements and load averages, the state moved to them. A checkpoint
        without them (or from a run with other slots) keeps the plain placements."""
        saved = (saved_meta or {}).get(META_KEY)
        if not self.active or not saved:
            return graphdef, params, rest, opt_state
        placements = [balance.Placement.from_json(p) for p in saved["placements"]]
        fits = len(placements) == len(self.placements) and all(
            (p.num_ranks, p.slots, p.ranks_per_node) == (q.num_ranks, q.slots, q.ranks_per_node)
            for p, q in zip(placements, self.placements, strict=True)
        )
        if not fits:
            return graphdef, params, rest, opt_state
        perms = [
            balance.permutation(q, p) for p, q in zip(placements, self.placements, strict=True)
        ]
        self.placements = placements
        self.loads = [None if v is None else np.asarray(v, np.float64) for v in saved["loads"]]
        return self._move(graphdef, params, rest, opt_state, perms)


def _plain(p: balance.Placement) -> balance.Placement:
    return balance.Placement.default(
        p.num_experts, p.num_ranks, p.redundant_per_rank, p.ranks_per_node
    )


def rank_loads(tokens_per_slot, slots_per_rank: int) -> np.ndarray:
    """[blocks, R * L] rows per physical slot -> [blocks, R] rows per rank."""
    load = np.asarray(tokens_per_slot)
    return load.reshape(load.shape[0], -1, slots_per_rank).sum(-1)

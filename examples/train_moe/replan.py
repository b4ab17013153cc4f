"""The re-planning hook of the main job: every N steps, plan the expert domains again from the
routing the run measured and the links in force (`jax_hybridep.xdc.Replanner`), and when the plan
changes hand the training loop the model rebuilt on the new domains (one more compile).

Measured routing: the rows each layer's experts received (`MoEAux.tokens_per_expert`), summed
over the steps since the last re-plan. Links: given to the run (`--links`, `--link_schedule`),
since fake devices have no links to measure. The model's parameters keep their sharding under
every domain setting, so switching moves no parameter; the other state is carried over by
`model.rebuild`.

With several processes (`job_runtime/processes.py`; `job.train` sets `processes`) process 0
re-plans from the counts (all-reduced in the step: the same on every process) and every process
adopts its decision; the processes then compare the domains they run, recorded with each re-plan
(`domains_per_process`), and stop if they differ.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from examples.job_runtime.processes import Processes
from examples.moe_lm.model import (
    MoETransformer,
    dense_param_bytes,
    describe_workload,
    rebuild,
    with_layer_domains,
)
from jax_hybridep import xdc


class ReplanHook:
    """Re-plans every `replanner.every` steps; `after_step` returns (graphdef, rest) to switch to.

    Args:
      replanner: the `xdc.Replanner` (its workload describes `model_config`'s step).
      model_config: the model the run starts with (`model_config` after construction: with the
        replanner's initial domains).
      mesh, topology: the run's mesh and plain-EP topology.
    """

    def __init__(self, replanner: xdc.Replanner, model_config, mesh, topology):
        self.replanner, self.mesh, self.topology = replanner, mesh, topology
        self.names = tuple(level[0] for level in topology.levels)
        self.model_config = with_layer_domains(model_config, self.names, replanner.layer_domains)
        self.counts = None
        self.compiles = 1
        self.processes = Processes()  # job.train sets the run's

    @classmethod
    def from_config(cls, cfg, model_config, mesh, topology) -> ReplanHook:
        """The hook `job.train` builds from its flags (`--replan_every`, `--links`, ...)."""
        if not cfg.links:
            raise ValueError(
                f"--replan_every={cfg.replan_every} needs --links (e.g. "
                "dc=10:5:shared,node=100,local=3600), the links to plan for"
            )
        levels = {
            level[0]: size
            for level, size in zip(topology.levels, topology.level_sizes, strict=True)
        }
        cluster = xdc.parse_links(cfg.links, levels)
        schedule = xdc.LinkSchedule.parse(cfg.link_schedule, list(levels))
        abstract = nnx.eval_shape(
            lambda: MoETransformer(model_config, mesh, topology, rngs=nnx.Rngs(0))
        )
        dense = dense_param_bytes(nnx.state(abstract, nnx.Param))
        workload = describe_workload(
            model_config, cfg.batch * cfg.seq_len // mesh.devices.size, dense
        )
        # A rank's own parameters, their gradients and Adam's two moments (activations are not
        # counted): what --memory_limit_mb must hold besides what the domains add.
        own = model_config.layers * (model_config.experts // topology.ep_size)
        resident = 4 * (dense + own * workload.expert_bytes_full())
        workload = dataclasses.replace(workload, resident_bytes=resident)
        limit = round(cfg.memory_limit_mb * 1e6) if cfg.memory_limit_mb else None
        start = None
        if model_config.migration.domains or model_config.layer_domains:  # --domains: start there
            start = [
                tuple(dict(model_config.domains_of(i) or ()).get(n, 1) for n in levels)
                for i in range(model_config.layers)
            ]
        replanner = xdc.Replanner(
            cluster,
            workload,
            every=cfg.replan_every,
            schedule=schedule,
            memory_limit_bytes=limit,
            layer_domains=start,
        )
        return cls(replanner, model_config, mesh, topology)

    @property
    def history(self) -> list[dict]:
        """Every re-plan (`xdc.Replanner.history`)."""
        return self.replanner.history

    def after_step(self, step: int, metrics, params, rest):
        """After `step` steps, with the step's metrics: (graphdef, rest) on new domains, or None
        (a subclass may return (None, rest): new state, the same compiled step)."""
        counts = np.asarray(metrics["tokens_per_expert"], np.int64)
        self.counts = counts if self.counts is None else self.counts + counts
        if not self.replanner.due(step):
            return None
        counts, self.counts = self.counts, None
        new, entry = self.processes.decide(f"replan {step}", lambda: self._replan(step, counts))
        if not self.processes.is_main:  # process 0's decision, as if this process had made it
            self.replanner.history.append(entry)
            if new is not None:
                self.replanner.layer_domains = [tuple(d) for d in new]
        domains = [list(d) for d in self.replanner.layer_domains]
        everyone = self.processes.exchange(f"domains {step}", domains)
        if any(d != domains for d in everyone):
            raise RuntimeError(
                f"step {step}: the processes run different domains after the same re-plan "
                f"({everyone})"
            )
        self.replanner.history[-1]["domains_per_process"] = everyone
        if new is None:
            return None
        self.model_config = with_layer_domains(self.model_config, self.names, new)
        graphdef, rest = rebuild(self.model_config, self.mesh, self.topology, params, rest)
        rest = jax.device_put(rest, nnx.get_named_sharding(rest, self.mesh))
        self.compiles += 1
        return graphdef, rest

    def _replan(self, step: int, counts):
        """(the per-layer domains to switch to or None, the history entry): process 0's part."""
        new = self.replanner.update(step, counts)
        return (None if new is None else [list(d) for d in new]), self.replanner.history[-1]

    def describe(self, step: int) -> str:
        """One line on the last re-plan."""
        h = self.history[-1]
        gbps = ", ".join(f"{n} {g:g} Gbps" for n, g in h["gbps"].items())
        return (
            f"step {step}: re-planned to domains {h['layer_domains']} ({gbps}; routing skew "
            f"{h['skew']:.2f}; predicted {h['current_s'] * 1e3:.1f} -> {h['chosen_s'] * 1e3:.1f} "
            f"ms per step); compile {self.compiles}"
        )

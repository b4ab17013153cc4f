"""The private jax API the job runtime needs, in one place: `jax.distributed`'s runtime client and
the cluster detection `jax.distributed.initialize()` does by itself.

Private-API shims because jax offers no public way to either: `jax.distributed` exposes no
key-value store or barrier to Python (`processes.py` agrees on flags, decides and watches
liveness through them), and `initialize()` detects a cluster (SLURM, Open MPI, ...) without saying
what it found, while `startup.start` must know the coordinator's address and this process's index
before the runtime starts (to check the port and wait for the coordinator, and to name the address
in one line when the job cannot be joined). They live beside the job runtime, their one user,
not in `jax_hybridep.compat`: the library needs neither.

Checked on jax 0.11.2 (the GPU machines; read from its `jax/_src/clusters/cluster.py` and
`jax/_src/distributed.py`) and 0.12.0.1 (here, under the tests): `distributed.global_state.client`,
`clusters.ClusterEnv._cluster_types` with `opt_in_only_method`, `is_env_present`,
`get_process_count`, `get_process_id` and `get_coordinator_address(timeout_secs,
override_coordinator_port)` are alike in both.
"""

from __future__ import annotations

import os


def distributed_client():
    """The `jax.distributed` runtime client (its key-value store and barriers: `key_value_set`,
    `key_value_dir_get`, `blocking_key_value_get`, `wait_at_barrier`), or None when
    `jax.distributed` is not initialised."""
    from jax._src import distributed  # noqa: PLC0415  (private: this module's reason to be)

    return distributed.global_state.client


def _detected_env():
    """The cluster environment class `jax.distributed.initialize()` would detect by itself
    (SLURM, Open MPI, ...; not the opt-in ones such as mpi4py), or None."""
    from jax._src import clusters  # noqa: PLC0415  (private: this module's reason to be)

    for env in clusters.ClusterEnv._cluster_types:
        if not env.opt_in_only_method and env.is_env_present():
            return env
    return None


def detected_cluster() -> tuple[str, int] | None:
    """(name, process count) of the cluster environment `jax.distributed.initialize()` would
    detect by itself, or None when the environment describes none. Reads environment variables
    (on a cloud TPU VM also its metadata server), starts nothing."""
    env = _detected_env()
    return None if env is None else (env.__name__, env.get_process_count())


def detected_coordinator(timeout_s: int) -> tuple[str, int] | None:
    """(coordinator address, this process's index) of the cluster environment that
    `detected_cluster` finds, as `jax.distributed.initialize()` would derive them (the address
    honours JAX_COORDINATOR_ADDRESS and JAX_COORDINATOR_PORT), or None when there is none."""
    env = _detected_env()
    if env is None:
        return None
    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if address is None:
        address = env.get_coordinator_address(
            timeout_secs=timeout_s, override_coordinator_port=os.environ.get("JAX_COORDINATOR_PORT")
        )
    return address, env.get_process_id()

"""The algorithm layer (docs/design.md §3): dispatch and combine as one walk over per-level steps.

A `Route` (routes.py) names the steps one call runs: a layout step, one level step per walked
level (slow -> fast) and a bottom, where the items a rank holds become expert-major rows (a bottom
may itself span the fastest level, as the CUDA transport does). walk.py is the only code that
walks levels; each kind of step lives in one module:

  routes.py       backend selection: which layout, level steps and bottom a call runs
  walk.py         the walk: dispatch down the levels, combine and the VJPs back up
  handle.py       what the walk builds for combine and the VJPs (`jax_hybridep.Handle`)
  steps.py        the interfaces, the items passed between steps, the fast-level geometry
  layout_steps.py layout steps: jnp (the oracle), host rendezvous, host from gathered counts, CUDA
  xla_steps.py    jnp packing + `jax.lax.all_to_all` levels, jnp rows (the `xla` backend)
  host_steps.py   host custom calls: direct-write levels in one process, packed levels across
                  processes (around an XLA all-to-all), host rows
  host_fused.py   the one-call-per-direction host bottom spanning one in-process level
  cuda.py         the CUDA transport as the bottom spanning the fastest GPU level
  ffi_call.py     emitting the custom calls and their attribute bundles
"""

"""Dispatch + combine benchmark: hybridep (ffi, xla; flat, hierarchical) against the ways JAX
users write MoE token exchange today, on the devices present.

`python -m jax_hybridep.bench --help`; in-process: `jax_hybridep.bench.main.benchmark(...)`.
Modules: `workloads` (presets, routings), `baselines` (GShard, MaxText, worst-case all_to_all),
`runner` (programs, timing, floor), `metrics` (bandwidth, bytes, ratios), `report` (table, JSON,
PNG), `cli` (argument types of the CLIs), `main` (CLI). Beside it, each its own CLI: `layer` (a
whole MoE layer), `profile` (one case's time), `balance` (the load-balance table of
docs/balance.md).
"""

"""The laboratory: what exists to prove, measure, emulate or reproduce jax_hybridep.

One rule: what ships is what a user imports or runs (`jax_hybridep/`, `xla_ffi/`); what exists to
prove, measure, emulate or reproduce the project stands here, beside it, imports the package, and
is never imported by it. `pip install .` installs none of it; `tests/imports_test.py` holds the
rule (no production native file includes a header from here, no production target builds a
source from here).

Importable from the repository root (pytest's `pythonpath = ["."]`, the scripts' working
directory); never installed. What lives here (docs/development.md, "Layout"):

* `host_executor/`: the host executor, the CUDA kernels' own sources run on the CPU
  (docs/host_executor.md), built on demand by `tests/host_executor_helpers.py`.
* `native/`: the sources of the native test module `_hybridep_testing` (self-tests, references,
  the virtual-rank harness, benchmark hooks, introspection), with its CUDA side in `native/cuda/`;
  built only by the developer install (CMake option `JAX_HYBRIDEP_TESTING=ON`,
  `scripts/setup.sh`).
* `native_module.py`: the loader of that module (`testing_module()`).
* `gpu_transport_bench.py`: the CUDA transport's microbenchmark over the test module's hooks
  (`python -m lab.gpu_transport_bench`).
"""

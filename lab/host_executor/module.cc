// The host executor's Python module (docs/host_executor.md), built on demand by the tests from
// the kernel sources in the working tree (tests/host_executor_helpers.py): the executor's
// settings and counters, its probe kernels, and the transport's and the layout's hooks and the
// virtual-rank harness (lab/native/cuda/, the same sources a GPU build compiles) on its virtual
// GPUs.
#include <cstdint>
#include <string>

#include "lab/host_executor/executor.h"
#include "lab/host_executor/probes.h"
#include "lab/native/cuda/hooks.h"
#include "lab/native/cuda/layout_hooks.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/vector.h"

#ifndef JAX_HYBRIDEP_HOST_MODULE
#define JAX_HYBRIDEP_HOST_MODULE _hybridep_host_executor
#endif

namespace nb = nanobind;
namespace hx = jax_hybridep::host;

NB_MODULE(JAX_HYBRIDEP_HOST_MODULE, m) {
  m.def(
      "configure",
      [](uint64_t seed, int gpus, int sms, int64_t optin_smem, double switch_probability,
         double copy_probability, int64_t max_steps, bool detect_races) {
        hx::Options o;
        o.seed = seed;
        o.gpus = gpus;
        o.sms = sms;
        o.optin_smem = optin_smem;
        o.switch_probability = switch_probability;
        o.copy_probability = copy_probability;
        o.max_steps = max_steps;
        o.detect_races = detect_races;
        hx::Configure(o);
      },
      nb::arg("seed") = 0, nb::arg("gpus") = 8, nb::arg("sms") = 2, nb::arg("optin_smem") = 232448,
      nb::arg("switch_probability") = 0.5, nb::arg("copy_probability") = 0.25,
      nb::arg("max_steps") = 400000000, nb::arg("detect_races") = true,
      "Starts a new run: `gpus` virtual GPUs of `sms` SMs (one resident block each) and "
      "`optin_smem` bytes of opt-in shared memory per block; the scheduler's seed, the chance of a "
      "switch at each scheduling point and of a bulk-copy stage per step; the step limit (a hang "
      "report past it); whether races are checked.");
  m.def(
      "stats",
      [] {
        const hx::Stats& s = hx::CurrentStats();
        nb::dict d;
        d["steps"] = s.steps;
        d["switches"] = s.switches;
        d["threads"] = s.threads;
        d["launches"] = s.launches;
        d["bulk_copies"] = s.bulk_copies;
        d["accesses"] = s.accesses;
        d["virtual_ns"] = s.virtual_ns;
        return d;
      },
      "Counters of the current run.");
  m.def("release", &hx::Reset,
        "Ends the current run and frees what it holds: its threads and their stacks (a failed "
        "run leaves them), its virtual GPUs' and mapped memory, its streams; the settings stay. A "
        "pytest "
        "process goes on compiling XLA programs, which need the mappings and memory back.");
  m.def("run_probe", &hx::RunProbe, nb::arg("name"), nb::arg("arg") = 0,
        "Runs a probe kernel (lab/host_executor/probes.cu) and returns its outputs.");
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const hx::Report& r) {
      PyErr_SetString(PyExc_RuntimeError, r.what());
    }
  });
  jax_hybridep::RegisterTransportHooks(m);
  jax_hybridep::RegisterTransportHarness(m);
  jax_hybridep::RegisterLayoutHooks(m);
}

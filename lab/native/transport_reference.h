// The direct-write transport's rounds as the test module takes them ([N, R, ...] inputs: N rounds
// of dispatch, combine, redispatch (scaled) and row values over R ranks), and their results by the
// CPU kernels the host handlers run (exchange.h's pull transport): the reference the numpy model
// of docs/design.md §2.1 is checked against, so a GPU run only has the CUDA kernels left to test.
#ifndef JAX_HYBRIDEP_LAB_NATIVE_TRANSPORT_REFERENCE_H_
#define JAX_HYBRIDEP_LAB_NATIVE_TRANSPORT_REFERENCE_H_

#include "nanobind/nanobind.h"

namespace jax_hybridep {

// Adds transport_reference() to `m`.
void RegisterTransportReference(nanobind::module_& m);

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_LAB_NATIVE_TRANSPORT_REFERENCE_H_

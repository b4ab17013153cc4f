// Shared by the test module's hooks: numpy arrays in and out (in CPU memory: CpuArray), and
// argument checks that raise ValueError naming the argument. No CUDA.
#ifndef JAX_HYBRIDEP_LAB_NATIVE_ARRAY_HOOKS_H_
#define JAX_HYBRIDEP_LAB_NATIVE_ARRAY_HOOKS_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "nanobind/nanobind.h"
#include "nanobind/ndarray.h"
#include "xla_ffi/common/numeric.h"

namespace jax_hybridep {

namespace nb = nanobind;

template <typename T>
using CpuArray = nb::ndarray<const T, nb::c_contig, nb::device::cpu>;

template <typename T>
inline nb::object ToNumpy(std::vector<T> values, std::vector<size_t> shape) {
  auto* owned = new std::vector<T>(std::move(values));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::cast(nb::ndarray<nb::numpy, T>(owned->data(), shape.size(), shape.data(), owner));
}

inline void Require(bool ok, const std::string& message) {
  if (!ok) throw nb::value_error(message.c_str());
}

template <typename T>
inline void RequireShape(const CpuArray<T>& a, const char* name, std::vector<int64_t> shape) {
  bool ok = a.ndim() == shape.size();
  for (size_t i = 0; ok && i < shape.size(); ++i) ok = static_cast<int64_t>(a.shape(i)) == shape[i];
  std::string want, got;
  for (int64_t d : shape) want += (want.empty() ? "" : ", ") + std::to_string(d);
  for (size_t i = 0; i < a.ndim(); ++i) got += (i ? ", " : "") + std::to_string(a.shape(i));
  Require(ok, std::string(name) + ": expected shape (" + want + ") but got (" + got + ")");
}

inline void RequireRange(const int32_t* values, size_t n, int64_t limit, const char* name) {
  for (size_t i = 0; i < n; ++i) {
    Require(values[i] >= -1 && values[i] < limit,
            std::string(name) + " has " + std::to_string(values[i]) + ", outside [-1, " +
                std::to_string(limit) + ")");
  }
}

inline Dtype ParseDtype(const std::string& name) {
  if (name == "float32") return Dtype::kF32;
  if (name == "bfloat16") return Dtype::kBF16;
  if (name == "float16") return Dtype::kF16;
  throw nb::value_error("dtype must be 'float32', 'bfloat16' or 'float16'");
}

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_LAB_NATIVE_ARRAY_HOOKS_H_

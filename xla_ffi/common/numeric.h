// Conversions between float32 and the 16-bit float formats the ops carry.
//
// Both round to nearest even, like XLA's convert, so the CPU kernels and XLA agree bitwise. No
// compiler half-precision types are used: their availability differs between compilers and
// targets, and the arithmetic here is always done in float32.
#ifndef JAX_HYBRIDEP_XLA_FFI_COMMON_NUMERIC_H_
#define JAX_HYBRIDEP_XLA_FFI_COMMON_NUMERIC_H_

#include <cstdint>
#include <cstring>

// The same conversions run in CUDA kernels, which must match the CPU kernels bit for bit: a
// function marked so compiles for the CPU and, under nvcc, for the GPU too.
#ifdef __CUDACC__
#define JAX_HYBRIDEP_CPU_AND_GPU __host__ __device__
#else
#define JAX_HYBRIDEP_CPU_AND_GPU
#endif

namespace jax_hybridep {

enum class Dtype { kF32, kBF16, kF16 };

JAX_HYBRIDEP_CPU_AND_GPU inline float BitsToFloat(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

JAX_HYBRIDEP_CPU_AND_GPU inline uint32_t FloatToBits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

JAX_HYBRIDEP_CPU_AND_GPU inline float Bf16ToFloat(uint16_t h) {
  return BitsToFloat(static_cast<uint32_t>(h) << 16);
}

JAX_HYBRIDEP_CPU_AND_GPU inline uint16_t FloatToBf16(float f) {
  uint32_t bits = FloatToBits(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep it quiet and keep the sign.
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  }
  uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

JAX_HYBRIDEP_CPU_AND_GPU inline float F16ToFloat(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return BitsToFloat(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    // Zero or subnormal: value = mantissa * 2^-24, exact in float32.
    float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-08f;
    return sign ? -magnitude : magnitude;
  }
  return BitsToFloat(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

JAX_HYBRIDEP_CPU_AND_GPU inline uint16_t FloatToF16(float f) {
  uint32_t bits = FloatToBits(f);
  uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  uint32_t abs_bits = bits & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) return sign | 0x7e00u | ((abs_bits >> 13) & 0x3ffu);  // NaN
  if (abs_bits >= 0x477ff000u) return sign | 0x7c00u;  // rounds to infinity (or is infinity)
  if (abs_bits < 0x38800000u) {
    // Result is subnormal or zero in float16: round |f| / 2^-24 to an integer, nearest even.
    // Adding 0.5 (the magic constant) makes float32 rounding do exactly that.
    float magnitude = BitsToFloat(abs_bits) + 0.5f;
    return sign | static_cast<uint16_t>(FloatToBits(magnitude) - FloatToBits(0.5f));
  }
  uint32_t mantissa_odd = (abs_bits >> 13) & 1u;
  abs_bits += 0xc8000fffu + mantissa_odd;  // rebias exponent (-112 << 23) and round to nearest even
  return sign | static_cast<uint16_t>(abs_bits >> 13);
}

JAX_HYBRIDEP_CPU_AND_GPU inline float LoadAsFloat(const void* base, int64_t i, Dtype dtype) {
  switch (dtype) {
    case Dtype::kF32:
      return static_cast<const float*>(base)[i];
    case Dtype::kBF16:
      return Bf16ToFloat(static_cast<const uint16_t*>(base)[i]);
    case Dtype::kF16:
      return F16ToFloat(static_cast<const uint16_t*>(base)[i]);
  }
  return 0.0f;
}

JAX_HYBRIDEP_CPU_AND_GPU inline void StoreFromFloat(void* base, int64_t i, float value,
                                                    Dtype dtype) {
  switch (dtype) {
    case Dtype::kF32:
      static_cast<float*>(base)[i] = value;
      return;
    case Dtype::kBF16:
      static_cast<uint16_t*>(base)[i] = FloatToBf16(value);
      return;
    case Dtype::kF16:
      static_cast<uint16_t*>(base)[i] = FloatToF16(value);
      return;
  }
}

JAX_HYBRIDEP_CPU_AND_GPU inline int64_t DtypeBytes(Dtype dtype) {
  return dtype == Dtype::kF32 ? 4 : 2;
}

// The widest power-of-two word (up to 16 bytes) dividing both addresses and the byte count: the
// vector width a row copy between them can use.
JAX_HYBRIDEP_CPU_AND_GPU inline int WordBytes(const void* a, const void* b, int64_t bytes) {
  const uint64_t bits = reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b) |
                        static_cast<uint64_t>(bytes);
  for (int w = 16; w > 1; w /= 2) {
    if (bits % w == 0) return w;
  }
  return 1;
}

// Row kernels over `hidden` elements, with the dtype fixed at compile time so the loops
// vectorise (the CPU kernels dispatch by dtype and CPU: exchange.h). They do exactly the scalar
// operations above, element by element, in the same order (no reassociation; the build disables FMA
// contraction), so results are bitwise those of a scalar loop and of XLA, at any vector width.

// acc[h] = acc[h] + row[h] (times w when weighted), in float32. kFirst: acc is +0 and not read
// (0 + x, the same bits as after filling it with zeros: -0 becomes +0).
template <Dtype D, bool kFirst>
inline void AccumulateRowT(float* __restrict acc, const void* __restrict row, int64_t hidden,
                           bool weighted, float w) {
  if (weighted) {
    for (int64_t h = 0; h < hidden; ++h) {
      acc[h] = (kFirst ? 0.0f : acc[h]) + LoadAsFloat(row, h, D) * w;
    }
  } else {
    for (int64_t h = 0; h < hidden; ++h) acc[h] = (kFirst ? 0.0f : acc[h]) + LoadAsFloat(row, h, D);
  }
}

// out[h] = acc[h] rounded to dtype.
template <Dtype D>
inline void StoreRowT(void* __restrict out, const float* __restrict acc, int64_t hidden) {
  for (int64_t h = 0; h < hidden; ++h) StoreFromFloat(out, h, acc[h], D);
}

// acc[h] = acc[h] + part[h] rounded to dtype (and read back as float32): a partial that crosses
// as dtype, added without storing it first. kFirst as in AccumulateRowT.
template <Dtype D, bool kFirst>
inline void AccumulateRoundedT(float* __restrict acc, const float* __restrict part,
                               int64_t hidden) {
  for (int64_t h = 0; h < hidden; ++h) {
    float rounded = part[h];
    if (D == Dtype::kBF16) rounded = Bf16ToFloat(FloatToBf16(part[h]));
    if (D == Dtype::kF16) rounded = F16ToFloat(FloatToF16(part[h]));
    acc[h] = (kFirst ? 0.0f : acc[h]) + rounded;
  }
}

// out[h] = in[h] * w in float32, rounded to dtype.
template <Dtype D>
inline void ScaleRowT(void* __restrict out, const void* __restrict in, int64_t hidden, float w) {
  for (int64_t h = 0; h < hidden; ++h) StoreFromFloat(out, h, LoadAsFloat(in, h, D) * w, D);
}

// The routing-weight gradient of a weighted combine is, per row, the dot product of the expert
// output y[row] and the row of the output's cotangent. Its summation order is fixed here so the
// host handlers and the `xla` backend on CPU (jax_hybridep/weight_grad.py) agree bit for bit:
// products rounded to float32; L lane sums, lane l adding the products at h = l, L + l, 2L + l, ...
// in ascending h (the hidden % L trailing products go to lanes 0..hidden % L - 1 last); then the
// lanes halved pairwise (lane l += lane l + w/2 for a width w; an odd last lane moves down) until
// one is left. L = min(hidden, 16 * ceil(hidden / 1024)): at most ~64 steps per lane, and a
// multiple of 16 floats (one AVX-512 register) whenever hidden >= 16.
JAX_HYBRIDEP_CPU_AND_GPU inline int64_t RowDotLanes(int64_t hidden) {
  const int64_t lanes = 16 * ((hidden + 1023) / 1024);
  return hidden < lanes ? hidden : lanes;
}

// The dot product above with the cotangent row `g` (kZeroRow: a row of zeros, i.e. a padding
// row, whose products are y * 0: +-0, or NaN for a non-finite y). `lanes`: scratch for
// RowDotLanes(hidden) floats.
template <Dtype D, bool kZeroRow>
inline float RowDotT(const void* __restrict y, const void* __restrict g, int64_t hidden,
                     float* __restrict lanes) {
  if (hidden == 0) return 0.0f;
  const int64_t L = RowDotLanes(hidden), steps = hidden / L, tail = hidden % L;
  auto product = [&](int64_t h) {
    return LoadAsFloat(y, h, D) * (kZeroRow ? 0.0f : LoadAsFloat(g, h, D));
  };
  // Lanes never mix until the halving, so they are summed 16 at a time in a block the compiler
  // keeps in registers (the same adds per lane, in the same order); through `lanes` in memory
  // every step waited on the previous step's store (8x slower at hidden = 1024).
  constexpr int64_t kBlock = 16;
  int64_t first = 0;
  for (; first + kBlock <= L; first += kBlock) {
    float block[kBlock];
    for (int64_t l = 0; l < kBlock; ++l) block[l] = product(first + l);
    for (int64_t i = 1; i < steps; ++i) {
      for (int64_t l = 0; l < kBlock; ++l) block[l] = block[l] + product(i * L + first + l);
    }
    for (int64_t l = 0; l < kBlock; ++l) lanes[first + l] = block[l];
  }
  for (int64_t l = first; l < L; ++l) {  // only when hidden < 16 (then L = hidden, one step)
    lanes[l] = product(l);
    for (int64_t i = 1; i < steps; ++i) lanes[l] = lanes[l] + product(i * L + l);
  }
  for (int64_t l = 0; l < tail; ++l) lanes[l] = lanes[l] + product(steps * L + l);
  for (int64_t w = L; w > 1;) {
    const int64_t half = w / 2;
    for (int64_t l = 0; l < half; ++l) lanes[l] = lanes[l] + lanes[l + half];
    if (w % 2 == 1) lanes[half] = lanes[w - 1];
    w = half + w % 2;
  }
  return lanes[0];
}

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_COMMON_NUMERIC_H_

// FP8 on the wire (docs/design.md §2.1.8): float8_e4m3fn payload with one float32 scale per block
// of kFp8Block elements of a token, quantised once at the source and dequantised at the receiver.
//
// A wire row of a token with H elements is H payload bytes followed by ceil(H / kFp8Block)
// float32 scales (unaligned, little-endian, read and written with memcpy). The arithmetic is the
// jnp formula of jax_hybridep/fp8.py step by step in float32 (built without FMA contraction), so
// the CPU kernels, CUDA and XLA agree bit for bit. Framework-free; for the CPU and the GPU.
#ifndef JAX_HYBRIDEP_XLA_FFI_COMMON_FP8_H_
#define JAX_HYBRIDEP_XLA_FFI_COMMON_FP8_H_

#include <cstdint>
#include <cstring>

#include "xla_ffi/common/numeric.h"

namespace jax_hybridep {

constexpr int64_t kFp8Block = 128;
constexpr float kFp8Max = 448.0f;     // the largest finite e4m3fn value
constexpr float kFp8MinAmax = 1e-4f;  // the smallest block amax a scale is taken from

JAX_HYBRIDEP_CPU_AND_GPU inline int64_t Fp8Blocks(int64_t hidden) {
  return (hidden + kFp8Block - 1) / kFp8Block;
}

JAX_HYBRIDEP_CPU_AND_GPU inline int64_t Fp8WireBytes(int64_t hidden) {
  return hidden + 4 * Fp8Blocks(hidden);
}

// float32 -> e4m3fn (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinities, NaN is
// S.1111.111), round to nearest even, as XLA's convert: NaN and magnitudes past 464 (above the
// midpoint of 448 and the NaN encoding) become NaN.
JAX_HYBRIDEP_CPU_AND_GPU inline uint8_t FloatToE4m3fn(float f) {
  const uint32_t bits = FloatToBits(f);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t abs_bits = bits & 0x7fffffffu;
  // Below the smallest normal (2^-6): a multiple of 2^-9 (a subnormal, or 8: 2^-6). Adding 2^14,
  // whose ulp is 2^-9, makes float32 rounding round to it, nearest even.
  const uint32_t small = FloatToBits(BitsToFloat(abs_bits) + 16384.0f) - FloatToBits(16384.0f);
  // Normal: round the 20 dropped mantissa bits to nearest even, rebias 127 -> 7.
  const uint32_t normal = ((abs_bits + 0x7ffffu + ((abs_bits >> 20) & 1u)) >> 20) - (120u << 3);
  // Both are computed and one selected, so the CPU loops vectorise.
  uint32_t q = abs_bits < 0x3c800000u ? small : normal;
  q = abs_bits > 0x43e80000u ? 0x7fu : q;  // > 464, infinities and NaN
  return static_cast<uint8_t>(sign | q);
}

JAX_HYBRIDEP_CPU_AND_GPU inline float E4m3fnToFloat(uint8_t q) {
  const uint32_t sign = static_cast<uint32_t>(q & 0x80u) << 24;
  const uint32_t exponent = (q >> 3) & 0xfu;
  const uint32_t mantissa = q & 0x7u;
  if (exponent == 0xfu && mantissa == 0x7u) return BitsToFloat(sign | 0x7fc00000u);  // NaN
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * 0.001953125f;  // * 2^-9, exact
    return sign ? -magnitude : magnitude;
  }
  return BitsToFloat(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}

// The element step: x * inv clamped to [-448, 448] (NaN stays NaN), then e4m3fn.
JAX_HYBRIDEP_CPU_AND_GPU inline uint8_t QuantizeE4m3fn(float x, float inv) {
  float t = x * inv;
  if (t < -kFp8Max) t = -kFp8Max;  // comparisons with NaN are false: NaN passes through
  if (t > kFp8Max) t = kFp8Max;
  return FloatToE4m3fn(t);
}

// |a| when finite, else 0: what a block's amax is taken over (NaN compares false).
JAX_HYBRIDEP_CPU_AND_GPU inline float FiniteMagnitude(float a) {
  const float m = a < 0.0f ? -a : a;
  return m <= 3.4028234663852886e38f ? m : 0.0f;
}

// A block's stored scale and the factor its elements are quantised with, from its amax.
struct Fp8BlockScale {
  float scale;
  float inv;
};

JAX_HYBRIDEP_CPU_AND_GPU inline Fp8BlockScale BlockScale(float amax) {
  amax = amax < kFp8MinAmax ? kFp8MinAmax : amax;
  return {amax * (1.0f / kFp8Max), kFp8Max / amax};
}

// CPU row kernels, the dtype fixed at compile time so the loops vectorise (fp8.cc dispatches
// on the dtype, once per row, compiled for several x86 vector extensions). They do the scalar
// steps above element by element in the same order, so every build computes the same bits.

// One token [hidden] of D into its wire row (payload, then the block scales).
template <Dtype D>
inline void QuantizeRowT(const void* x, int64_t hidden, uint8_t* wire) {
  for (int64_t begin = 0; begin < hidden; begin += kFp8Block) {
    const int64_t end = begin + kFp8Block < hidden ? begin + kFp8Block : hidden;
    float amax = 0.0f;
    for (int64_t h = begin; h < end; ++h) {
      const float m = FiniteMagnitude(LoadAsFloat(x, h, D));
      amax = m > amax ? m : amax;
    }
    const Fp8BlockScale s = BlockScale(amax);
    for (int64_t h = begin; h < end; ++h) wire[h] = QuantizeE4m3fn(LoadAsFloat(x, h, D), s.inv);
    std::memcpy(wire + hidden + 4 * (begin / kFp8Block), &s.scale, sizeof(s.scale));
  }
}

// A wire row back into `hidden` elements of D: float32(q) * scale, rounded once. `table` holds
// E4m3fnToFloat of every byte (Fp8Table).
template <Dtype D>
inline void DequantizeRowT(const uint8_t* wire, int64_t hidden, const float* table, void* out) {
  for (int64_t begin = 0; begin < hidden; begin += kFp8Block) {
    float scale;
    std::memcpy(&scale, wire + hidden + 4 * (begin / kFp8Block), sizeof(scale));
    const int64_t end = begin + kFp8Block < hidden ? begin + kFp8Block : hidden;
    for (int64_t h = begin; h < end; ++h) StoreFromFloat(out, h, table[wire[h]] * scale, D);
  }
}

// E4m3fnToFloat of each of the 256 bytes.
const float* Fp8Table();

// The row kernels by dtype (fp8.cc).
void QuantizeRow(const void* x, int64_t hidden, Dtype dtype, uint8_t* wire);
void DequantizeRow(const uint8_t* wire, int64_t hidden, Dtype dtype, void* out);

}  // namespace jax_hybridep

#endif  // JAX_HYBRIDEP_XLA_FFI_COMMON_FP8_H_

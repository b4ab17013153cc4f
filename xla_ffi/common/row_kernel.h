// JAX_HYBRIDEP_ROW_KERNEL: the attribute of the CPU row kernels' dtype dispatchers
// (exchange.cc, fp8.cc).
#ifndef JAX_HYBRIDEP_XLA_FFI_COMMON_ROW_KERNEL_H_
#define JAX_HYBRIDEP_XLA_FFI_COMMON_ROW_KERNEL_H_

// The row kernels are memory-bound loops; wider vectors cut their instruction count severalfold.
// Multiversioned so one portable build still uses AVX2 and AVX-512 where the CPU has them. GCC 12
// takes the x86-64-v3/v4 levels: v4 includes AVX-512BW, which packing 16-bit floats in 512-bit
// registers needs (with AVX-512F alone the scaling kernel stays on 256-bit vectors; the
// skylake-avx512 target, which has BW too, measured a third slower on the CPU benchmark preset).
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__) && !defined(__clang__) && \
    __GNUC__ >= 12
#define JAX_HYBRIDEP_ROW_KERNEL \
  __attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4")))
#elif defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#define JAX_HYBRIDEP_ROW_KERNEL __attribute__((target_clones("default", "avx2", "avx512f")))
#else
#define JAX_HYBRIDEP_ROW_KERNEL
#endif

#endif  // JAX_HYBRIDEP_XLA_FFI_COMMON_ROW_KERNEL_H_

// The host executor's CUDA runtime (xla_ffi/cuda/host/cuda.h), found by the kernels' own #include.
#include "xla_ffi/cuda/host/cuda.h"

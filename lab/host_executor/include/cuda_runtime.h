// The host executor's CUDA runtime and its models of the PTX instructions (cuda.h, ptx.h), found
// by the kernels' own #include <cuda_runtime.h>: the production headers never name the executor.
#include "lab/host_executor/cuda.h"
#include "lab/host_executor/ptx.h"

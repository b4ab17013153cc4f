// The host executor's CUDA runtime (lab/host_executor/cuda.h), found by the kernels' own #include.
#include "lab/host_executor/cuda.h"

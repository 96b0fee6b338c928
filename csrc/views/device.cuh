// What the views driver's kernels (rows_kernel.cuh, merge_kernel.cuh) compile against: the CUDA
// runtime and the element types they move, or, for the tests without a GPU, the CPU emulation of
// the kernels (tests/cuda_emulation/cuda_emulation.h, on the tests' include path; never part of
// the extension).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <stdint.h>

#if defined(DA_CUDA_EMULATION)
#include "cuda_emulation.h"
#else
#include <cuda_runtime.h>
#endif

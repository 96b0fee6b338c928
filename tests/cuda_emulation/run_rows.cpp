// Runs rows_kernel.cuh (the views driver's row moves) on the CPU through cuda_emulation.h, for
// tests without a GPU (tests/test_views_rows.py loads it with ctypes). It builds the job with
// add_row_pair and picks the kernel with with_rows_kernel, as rows_cuda.cu does, and runs the grid
// block by block. Build:
//   c++ -std=c++17 -O1 -shared -fPIC -DDA_CUDA_EMULATION -I<csrc> -I<tests/cuda_emulation> -I<cuda include> -I<torch include>
//       tests/cuda_emulation/run_rows.cpp -o run_rows.so
#ifndef DA_CUDA_EMULATION
#error "build with -DDA_CUDA_EMULATION"
#endif

#include "views/rows_kernel.cuh"

using dilated_attention::views::add_row_pair;
using dilated_attention::views::kRowThreads;
using dilated_attention::views::RowJob;
using dilated_attention::views::RowOp;
using dilated_attention::views::RowSource;
using dilated_attention::views::RowTensor;
using dilated_attention::views::with_rows_kernel;

namespace {

RowOp row_op(int op) {
  return op == 0 ? RowOp::kCopy : op == 1 ? RowOp::kAdd : RowOp::kCheck;
}

// The job of `count` pairs: meta holds, per pair, the element bytes of dst and of src, then dst's
// kRowDims sizes and kRowDims strides and src's, then the source elements of an add or a check
// (0 float32, 1 bfloat16, 2 float16), and an add's group of source rows and their stride
// (5 + 4 kRowDims values); ptrs holds dst0, src0, dst1, src1, ... False where a pair does not fit.
bool build_job(RowJob& job, int op, int count, const int64_t* meta, void** ptrs) {
  constexpr int k = dilated_attention::views::kRowDims;
  for (int i = 0; i < count; ++i) {
    const int64_t* m = meta + (5 + 4 * k) * i;
    RowTensor dst{ptrs[2 * i], m[0], {}, {}}, src{ptrs[2 * i + 1], m[1], {}, {}};
    for (int d = 0; d < k; ++d) {
      dst.size[d] = m[2 + d];
      dst.stride[d] = m[2 + k + d];
      src.size[d] = m[2 + 2 * k + d];
      src.stride[d] = m[2 + 3 * k + d];
    }
    const int64_t* extra = m + 2 + 4 * k;
    const RowSource source = extra[0] == 1   ? RowSource::kBFloat16
                             : extra[0] == 2 ? RowSource::kHalf
                                             : RowSource::kFloat;
    if (!add_row_pair(job, dst, src, row_op(op), source, extra[1], extra[2])) return false;
  }
  return true;
}

}  // namespace

// Moves `count` pairs (meta and ptrs as build_job reads them). op: 0 copy, 1 add, 2 check (dst: an
// int flag per row, or one flag); any: a check's flag for every pair (or null). Returns 0, or 1
// where a pair does not fit the kernel (nothing moved).
extern "C" int da_emu_rows_any(int op, int count, const int64_t* meta, void** ptrs, int* any) {
  RowJob job;
  job.any = any;
  if (!build_job(job, op, count, meta, ptrs)) return 1;
  const dim3 grid((unsigned)((job.max_warps * 32 + kRowThreads - 1) / kRowThreads), (unsigned)job.count);
  with_rows_kernel(row_op(op), [&](auto kernel) {
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x)
        da_emu::run_block(grid, dim3(x, y, 1), kRowThreads, [&] { kernel(job); });
  });
  return 0;
}

// da_emu_rows_any without the flag for every pair.
extern "C" int da_emu_rows(int op, int count, const int64_t* meta, void** ptrs) {
  return da_emu_rows_any(op, count, meta, ptrs, nullptr);
}

// The job da_emu_rows would run, not run: per pair, the elements a lane moves at once and the row
// dims left after merging (vec[i], dims[i]). Returns 0, or 1 where a pair does not fit.
extern "C" int da_emu_rows_shape(int op, int count, const int64_t* meta, void** ptrs, int* vec, int* dims) {
  RowJob job;
  if (!build_job(job, op, count, meta, ptrs)) return 1;
  for (int i = 0; i < count; ++i) {
    vec[i] = job.pair[i].vec;
    dims[i] = job.pair[i].nd;
  }
  return 0;
}

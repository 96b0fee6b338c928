// Whole-row moves between strided tensors for the views driver (views.cpp), up to kRowPairs
// tensors in one launch where a copy or add per tensor took a launch each:
//
//   * the gathers of a branch's runs whose calls and segments are both several, from strided
//     (count, Bb, m, n, D) views into contiguous tensors, and the copies that give cuDNN's backward
//     its dout, out and statistics contiguous, (Bb, n, m, D) and (Bb, n, m): moved as 16-bit
//     words, so that tensors of different dtypes (bfloat16 dout/out, float32 statistics) share the
//     launch and the bytes arrive unchanged;
//   * the adds of a call's dq, dk, dv into strided views of the float32 accumulators, in float32
//     (the source converted exactly first), as at::add_ computes them;
//   * the forward's check for non-finite entries in q, k and v: a flag per row (or one flag for
//     every row, zero strides) and, where the job has one, a flag set by any of them.
//
// Each row (every index but the last) of the pair blockIdx.y gets `lanes` threads of a warp over its elements (32
// for rows of 32 elements or more, fewer for short rows: a warp then moves several rows). Compiled
// for the CPU emulation of the tests as well (tests/cuda_emulation/run_rows.cpp); the launch is in
// rows_cuda.cu.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <stdint.h>

#include <type_traits>

#if defined(DA_CUDA_EMULATION)
#include "cuda_emulation.h"  // tests/cuda_emulation, on the tests' include path
#else
#include <cuda_runtime.h>
#endif

namespace dilated_attention {
namespace views {

constexpr int kRowPairs = 6;      // tensors moved by one launch at the most
constexpr int kRowDims = 6;       // dims of a tensor at the most, the row included
constexpr int kRowThreads = 128;  // threads a block: four rows

// The source elements of an add or a check, per pair (a copy moves words whatever the dtypes).
enum class RowSource { kFloat, kBFloat16, kHalf };

// A tensor of at most kRowDims dims as the job takes it: its data, the bytes of one element, and
// its sizes and strides (elements), padded in front with size-1 dims. The last dim is the row.
struct RowTensor {
  void* data;
  int64_t elem_bytes;
  int64_t size[kRowDims];
  int64_t stride[kRowDims];
};

// One (dst, src) pair: rows[0] x ... x rows[kRowDims - 2] rows of len elements each; strides in
// elements of the type the kernel moves.
struct RowPair {
  char* dst;
  const char* src;
  int64_t rows[kRowDims - 1];
  int64_t len;
  int64_t ds[kRowDims], ss[kRowDims];
  int64_t group, gs;  // an add: the sum of group source rows, gs elements apart, added to each row
  RowSource source;   // an add's or a check's source elements
  int lanes;          // threads a row: a power of two, at most 32

  __host__ __device__ int64_t row_count() const {
    int64_t n = 1;
    for (int i = 0; i < kRowDims - 1; ++i) n *= rows[i];
    return n;
  }
};

struct RowJob {
  RowPair pair[kRowPairs];
  int count = 0;
  int64_t max_warps = 0;  // the most warps a pair needs: the grid's x covers them
  int* any = nullptr;     // a check's flag set by every non-finite entry of every pair (or none)
};

// Adds dst <- src to job. words: a plain copy moved as 16-bit words, for elements of the same size
// (a multiple of 2 bytes) whose row is contiguous in both tensors or one element long. source: the
// elements of an add or a check; group, group_stride: an add of the sum of group rows of src,
// group_stride elements apart (src the first of them). False where the pair does not fit (the job
// is full, the sizes differ, or words cannot be used): the caller then moves that pair itself.
inline bool add_row_pair(RowJob& job, const RowTensor& dst, const RowTensor& src, bool words,
                         RowSource source = RowSource::kFloat, int64_t group = 1, int64_t group_stride = 0) {
  if (job.count >= kRowPairs) return false;
  RowPair p;
  p.dst = static_cast<char*>(dst.data);
  p.src = static_cast<const char*>(src.data);
  p.group = group;
  p.gs = group_stride;
  p.source = source;
  constexpr int e = kRowDims - 1;  // the row's dim
  for (int i = 0; i < kRowDims; ++i) {
    if (dst.size[i] != src.size[i]) return false;
    p.ds[i] = dst.stride[i];
    p.ss[i] = src.stride[i];
  }
  for (int i = 0; i < e; ++i) p.rows[i] = dst.size[i];
  p.len = dst.size[e];
  if (words) {
    if (dst.elem_bytes != src.elem_bytes || dst.elem_bytes % 2 != 0) return false;
    const int64_t w = dst.elem_bytes / 2;  // words an element
    if (p.len > 1 && (p.ds[e] != 1 || p.ss[e] != 1)) return false;
    for (int i = 0; i < e; ++i) {
      p.ds[i] *= w;
      p.ss[i] *= w;
    }
    p.len *= w;
    p.ds[e] = p.ss[e] = 1;
  }
  p.lanes = 1;
  while (p.lanes < 32 && p.lanes < p.len) p.lanes *= 2;
  const int64_t rows = p.row_count(), per_warp = 32 / p.lanes;
  const int64_t warps = (rows + per_warp - 1) / per_warp;
  job.pair[job.count++] = p;
  if (warps > job.max_warps) job.max_warps = warps;
  return true;
}

// What rows_kernel does with each element: dst = src; dst = dst + src (in float32, src converted
// first; the sum of the pair's group of source rows); or, for a src element that is not finite,
// *dst = 1 (dst: an int flag per row, its row stride 0) and *job.any = 1 (where the job has it).
enum class RowOp { kCopy, kAdd, kCheck };

// One row of pair p: dst_t elements from od, src_t elements from os.
template <typename dst_t, typename src_t, RowOp kOp>
__device__ __forceinline__ void move_row(const RowPair& p, int64_t od, int64_t os, int lane, int* any) {
  constexpr int last = kRowDims - 1;  // the row's dim
  dst_t* d = reinterpret_cast<dst_t*>(p.dst) + od;
  const src_t* s = reinterpret_cast<const src_t*>(p.src) + os;
  for (int64_t e = lane % p.lanes; e < p.len; e += p.lanes) {
    if constexpr (kOp == RowOp::kCheck) {
      const float x = static_cast<float>(s[e * p.ss[last]]);
      if (!(x - x == 0.0f)) {  // inf - inf and NaN - NaN are NaN
        *d = 1;
        if (any != nullptr) *any = 1;
      }
    } else if constexpr (kOp == RowOp::kAdd) {
      float v = static_cast<float>(s[e * p.ss[last]]);
      for (int64_t j = 1; j < p.group; ++j) v += static_cast<float>(s[e * p.ss[last] + j * p.gs]);
      d[e * p.ds[last]] = d[e * p.ds[last]] + v;
    } else {
      d[e * p.ds[last]] = s[e * p.ss[last]];
    }
  }
}

template <RowOp kOp>
__global__ void __launch_bounds__(kRowThreads) rows_kernel(RowJob job) {
  const RowPair& p = job.pair[blockIdx.y];
  const int lane = threadIdx.x % 32;
  const int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int64_t row = warp * (32 / p.lanes) + lane / p.lanes;
  if (row >= p.row_count()) return;
  int64_t od = 0, os = 0;
  for (int64_t i = kRowDims - 2, rest = row; i >= 0; --i) {
    const int64_t k = rest % p.rows[i];
    rest /= p.rows[i];
    od += k * p.ds[i];
    os += k * p.ss[i];
  }
  if constexpr (kOp == RowOp::kCopy) {
    move_row<uint16_t, uint16_t, kOp>(p, od, os, lane, job.any);
  } else {
    using dst_t = typename std::conditional<kOp == RowOp::kAdd, float, int>::type;
    switch (p.source) {
      case RowSource::kFloat: move_row<dst_t, float, kOp>(p, od, os, lane, job.any); break;
      case RowSource::kBFloat16: move_row<dst_t, c10::BFloat16, kOp>(p, od, os, lane, job.any); break;
      case RowSource::kHalf: move_row<dst_t, c10::Half, kOp>(p, od, os, lane, job.any); break;
    }
  }
}

// Calls launch(kernel) with the rows_kernel of op.
template <typename Launch>
void with_rows_kernel(RowOp op, Launch&& launch) {
  switch (op) {
    case RowOp::kCopy: return launch(rows_kernel<RowOp::kCopy>);
    case RowOp::kAdd: return launch(rows_kernel<RowOp::kAdd>);
    case RowOp::kCheck: return launch(rows_kernel<RowOp::kCheck>);
  }
}

}  // namespace views
}  // namespace dilated_attention

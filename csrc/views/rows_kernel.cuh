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
// Each row (every index but the last) of the pair blockIdx.y gets `lanes` threads of a warp over its
// elements (32 for rows of 32 accesses or more, fewer for short rows: a warp then moves several
// rows), each lane up to 16 bytes at once where the row, the strides and the addresses allow (a
// head-dim-64 bfloat16 row: 8 lanes of 16 bytes, 4 rows a warp), a row's offsets found in 32-bit
// arithmetic over the dims left after merging those that step evenly (add_row_pair). Compiled
// for the CPU emulation of the tests as well (tests/cuda_emulation/run_rows.cpp); the launch is in
// rows_cuda.cu.
#pragma once

#include <type_traits>

#include "views/device.cuh"
#include "views/rows.h"  // kRowPairs

namespace dilated_attention {
namespace views {

constexpr int kRowDims = 6;       // dims of a tensor at the most, the row included
constexpr int kRowThreads = 128;  // threads a block: four rows

// The source elements of an add or a check, per pair (a copy moves words whatever the dtypes).
enum class RowSource { kFloat, kBFloat16, kHalf };

// What rows_kernel does with each element: dst = src; dst = dst + src (in float32, src converted
// first; the sum of the pair's group of source rows); or, for a src element that is not finite,
// *dst = 1 (dst: an int flag per row, its row stride 0) and *job.any = 1 (where the job has it).
enum class RowOp { kCopy, kAdd, kCheck };

// A tensor of at most kRowDims dims as the job takes it: its data, the bytes of one element, and
// its sizes and strides (elements), padded in front with size-1 dims. The last dim is the row.
struct RowTensor {
  void* data;
  int64_t elem_bytes;
  int64_t size[kRowDims];
  int64_t stride[kRowDims];
};

// One (dst, src) pair: rows[0] x ... x rows[nd - 1] rows of len elements each (the tensors' other
// dims, size-1 dims dropped and dims that step evenly in both tensors merged, so that a row's index
// takes few divisions); strides in elements of the type the kernel moves. Each lane moves vec
// consecutive elements of a row at once (16 bytes where the row, the strides and the addresses
// allow, vec_width): len, the row strides and gs are multiples of vec.
struct RowPair {
  char* dst;
  const char* src;
  int64_t rows[kRowDims - 1];
  int nd;         // row dims in use
  int64_t nrows;  // rows[0] x ... x rows[nd - 1]
  int64_t len;
  int64_t ds[kRowDims], ss[kRowDims];  // per row dim, then (index kRowDims - 1) along the row
  int64_t group, gs;  // an add: the sum of group source rows, gs elements apart, added to each row
  RowSource source;   // an add's or a check's source elements
  int vec;            // elements a lane moves at once: 1, 2, 4 or 8
  int lanes;          // threads a row: a power of two, at most 32
};

struct RowJob {
  RowPair pair[kRowPairs];
  int count = 0;
  int64_t max_warps = 0;  // the most warps a pair needs: the grid's x covers them
  int* any = nullptr;     // a check's flag set by every non-finite entry of every pair (or none)
};
static_assert(sizeof(RowJob) <= 4096, "rows_kernel's argument must fit the 4 KiB of a kernel's parameters");

// The elements a lane moves at once in a row of len elements, strides[0 .. n) apart (the row dims'
// and an add's group stride), from and to addresses a and b, bytes of at most `most` elements
// (dst and src) within 16: the largest power of two dividing all of them, else 1. A row that is not
// contiguous in both tensors takes 1.
inline int vec_width(int64_t len, bool contiguous, const int64_t* strides, int n, uintptr_t a,
                     int64_t a_bytes, uintptr_t b, int64_t b_bytes, int most) {
  if (!contiguous) return 1;
  int v = most;
  auto fits = [&](int w) {
    if (len % w != 0 || a % (uintptr_t)(w * a_bytes) != 0 || b % (uintptr_t)(w * b_bytes) != 0) return false;
    for (int i = 0; i < n; ++i)
      if (strides[i] % w != 0) return false;
    return true;
  };
  while (v > 1 && !fits(v)) v /= 2;
  return v;
}

// Adds dst <- src to job for op. A copy moves 16-bit words, for elements of the same size (a
// multiple of 2 bytes) whose row is contiguous in both tensors or one element long. source: the
// elements of an add or a check; group, group_stride: an add of the sum of group rows of src,
// group_stride elements apart (src the first of them). False where the pair does not fit (the job
// is full, the sizes differ, or words cannot be used): the caller then moves that pair itself.
inline bool add_row_pair(RowJob& job, const RowTensor& dst, const RowTensor& src, RowOp op,
                         RowSource source = RowSource::kFloat, int64_t group = 1, int64_t group_stride = 0) {
  if (job.count >= kRowPairs) return false;
  const bool words = op == RowOp::kCopy, check = op == RowOp::kCheck;
  RowPair p;
  p.dst = static_cast<char*>(dst.data);
  p.src = static_cast<const char*>(src.data);
  p.group = group;
  p.gs = group_stride;
  p.source = source;
  constexpr int e = kRowDims - 1;  // the row's dim
  for (int i = 0; i < kRowDims; ++i)
    if (dst.size[i] != src.size[i]) return false;
  int64_t ds[kRowDims], ss[kRowDims];
  for (int i = 0; i < kRowDims; ++i) {
    ds[i] = dst.stride[i];
    ss[i] = src.stride[i];
  }
  p.len = dst.size[e];
  int64_t src_bytes = src.elem_bytes, dst_bytes = dst.elem_bytes;
  if (words) {
    if (dst.elem_bytes != src.elem_bytes || dst.elem_bytes % 2 != 0) return false;
    const int64_t w = dst.elem_bytes / 2;  // words an element
    if (p.len > 1 && (ds[e] != 1 || ss[e] != 1)) return false;
    for (int i = 0; i < e; ++i) {
      ds[i] *= w;
      ss[i] *= w;
    }
    p.len *= w;
    ds[e] = ss[e] = 1;
    src_bytes = dst_bytes = 2;
  }
  // the row dims, outermost first: size-1 dims dropped, a dim merged into the next where it steps
  // as the next's whole extent in both tensors
  p.nd = 0;
  for (int i = 0; i < e; ++i) {
    if (dst.size[i] == 1) continue;
    const int k = p.nd - 1;
    if (k >= 0 && p.ds[k] == ds[i] * dst.size[i] && p.ss[k] == ss[i] * dst.size[i]) {
      p.rows[k] *= dst.size[i];
      p.ds[k] = ds[i];
      p.ss[k] = ss[i];
      continue;
    }
    p.rows[p.nd] = dst.size[i];
    p.ds[p.nd] = ds[i];
    p.ss[p.nd] = ss[i];
    ++p.nd;
  }
  p.ds[e] = ds[e];
  p.ss[e] = ss[e];
  p.nrows = 1;
  for (int i = 0; i < p.nd; ++i) p.nrows *= p.rows[i];
  const int64_t rows = p.nrows;
  // 16 bytes a lane at the most; an add's float32 dst takes at most 4 elements, a check's dst (a
  // flag of stride 0) any
  const int64_t widest = words ? 2 : src_bytes;
  int most = int(16 / widest);
  if (!words && !check && most > 4) most = 4;
  int64_t strides[2 * kRowDims + 1];
  int n = 0;
  for (int i = 0; i < p.nd; ++i) {
    strides[n++] = p.ss[i];
    if (!check) strides[n++] = p.ds[i];
  }
  if (group > 1) strides[n++] = group_stride;
  const bool contiguous = p.ss[e] == 1 && (check || p.ds[e] == 1);
  p.vec = vec_width(p.len, contiguous, strides, n, reinterpret_cast<uintptr_t>(p.src), src_bytes,
                    check ? 0 : reinterpret_cast<uintptr_t>(p.dst), check ? 1 : dst_bytes, most);
  const int64_t units = p.len / p.vec;
  p.lanes = 1;
  while (p.lanes < 32 && p.lanes < units) p.lanes *= 2;
  const int64_t per_warp = 32 / p.lanes;
  const int64_t warps = (rows + per_warp - 1) / per_warp;
  job.pair[job.count++] = p;
  if (warps > job.max_warps) job.max_warps = warps;
  return true;
}

// V elements of type T loaded or stored at once (one access of V * sizeof(T) bytes, aligned).
template <typename T, int V>
struct alignas(sizeof(T) * V) RowVec {
  T x[V];
};

// One row of pair p: dst_t elements from od, src_t elements from os, V at a time.
template <typename dst_t, typename src_t, RowOp kOp, int V>
__device__ __forceinline__ void move_row(const RowPair& p, int64_t od, int64_t os, int lane, int* any) {
  constexpr int last = kRowDims - 1;  // the row's dim
  dst_t* d = reinterpret_cast<dst_t*>(p.dst) + od;
  const src_t* s = reinterpret_cast<const src_t*>(p.src) + os;
  const int64_t ds = V == 1 ? p.ds[last] : 1, ss = V == 1 ? p.ss[last] : 1;
  for (int64_t e = (lane % p.lanes) * V; e < p.len; e += p.lanes * V) {
    const RowVec<src_t, V> x =
        V == 1 ? RowVec<src_t, V>{{s[e * ss]}} : *reinterpret_cast<const RowVec<src_t, V>*>(s + e);
    if constexpr (kOp == RowOp::kCheck) {
      bool bad = false;
      for (int i = 0; i < V; ++i) {
        const float f = static_cast<float>(x.x[i]);
        bad = bad || !(f - f == 0.0f);  // inf - inf and NaN - NaN are NaN
      }
      if (bad) {
        *d = 1;
        if (any != nullptr) *any = 1;
      }
    } else if constexpr (kOp == RowOp::kAdd) {
      RowVec<float, V> sum;
      for (int i = 0; i < V; ++i) sum.x[i] = static_cast<float>(x.x[i]);
      for (int64_t j = 1; j < p.group; ++j) {
        const RowVec<src_t, V> y = V == 1 ? RowVec<src_t, V>{{s[e * ss + j * p.gs]}}
                                          : *reinterpret_cast<const RowVec<src_t, V>*>(s + e + j * p.gs);
        for (int i = 0; i < V; ++i) sum.x[i] += static_cast<float>(y.x[i]);
      }
      if constexpr (V == 1) {
        d[e * ds] = d[e * ds] + sum.x[0];
      } else {
        RowVec<float, V>* dv = reinterpret_cast<RowVec<float, V>*>(d + e);
        RowVec<float, V> y = *dv;
        for (int i = 0; i < V; ++i) y.x[i] = y.x[i] + sum.x[i];
        *dv = y;
      }
    } else {
      if constexpr (V == 1)
        d[e * ds] = x.x[0];
      else
        *reinterpret_cast<RowVec<dst_t, V>*>(d + e) = x;
    }
  }
}

// One row of pair p at its vector width.
template <typename dst_t, typename src_t, RowOp kOp>
__device__ __forceinline__ void move_row_at_width(const RowPair& p, int64_t od, int64_t os, int lane,
                                                  int* any) {
  switch (p.vec) {
    case 8:
      if constexpr (sizeof(src_t) == 2 && (kOp != RowOp::kAdd))
        return move_row<dst_t, src_t, kOp, 8>(p, od, os, lane, any);
      break;
    case 4:
      if constexpr (sizeof(src_t) <= 4) return move_row<dst_t, src_t, kOp, 4>(p, od, os, lane, any);
      break;
    case 2: return move_row<dst_t, src_t, kOp, 2>(p, od, os, lane, any);
    default: break;
  }
  move_row<dst_t, src_t, kOp, 1>(p, od, os, lane, any);
}

// The element offsets in dst and src of row `row` of pair p (I: the index arithmetic's type).
template <typename I>
__device__ __forceinline__ void row_offsets(const RowPair& p, I row, int64_t& od, int64_t& os) {
  od = os = 0;
  for (int i = p.nd - 1; i >= 0; --i) {
    const I n = static_cast<I>(p.rows[i]), k = row % n;
    row /= n;
    od += static_cast<int64_t>(k) * p.ds[i];
    os += static_cast<int64_t>(k) * p.ss[i];
  }
}

template <RowOp kOp>
__global__ void __launch_bounds__(kRowThreads) rows_kernel(RowJob job) {
  const RowPair& p = job.pair[blockIdx.y];
  const int lane = threadIdx.x % 32;
  const int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int64_t row = warp * (32 / p.lanes) + lane / p.lanes;
  if (row >= p.nrows) return;
  int64_t od, os;
  if (p.nrows <= INT32_MAX)  // a row's offsets in 32-bit arithmetic
    row_offsets<uint32_t>(p, static_cast<uint32_t>(row), od, os);
  else
    row_offsets<int64_t>(p, row, od, os);
  if constexpr (kOp == RowOp::kCopy) {
    move_row_at_width<uint16_t, uint16_t, kOp>(p, od, os, lane, job.any);
  } else {
    using dst_t = typename std::conditional<kOp == RowOp::kAdd, float, int>::type;
    switch (p.source) {
      case RowSource::kFloat: move_row_at_width<dst_t, float, kOp>(p, od, os, lane, job.any); break;
      case RowSource::kBFloat16:
        move_row_at_width<dst_t, c10::BFloat16, kOp>(p, od, os, lane, job.any);
        break;
      case RowSource::kHalf: move_row_at_width<dst_t, c10::Half, kOp>(p, od, os, lane, job.any); break;
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

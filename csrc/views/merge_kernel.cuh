// The fused log-sum-exp merge of merge.h on CUDA: up to kMergeCalls kernel calls merged into the
// views driver's accumulators in one launch, one warp per row (bb, j, t) of a call (lanes over the
// head dim), blockIdx.y the call and the grid's x covering the call of the most rows. Each row takes
// merge_rule.h's merge_weights and CorrectedRow, as the CPU loop of merge_cpu.cpp does. The calls of
// one launch must write disjoint rows of the accumulators (merge_calls_'s caller promises it); they
// share their dtypes (the accumulators' acc_t, the calls' out scalar_t) and `first`. Compiled for
// the CPU emulation of the tests as well (tests/cuda_emulation/run_merge.cpp); the launch is in
// merge_cuda.cu.
#pragma once

#include "views/device.cuh"
#include "views/merge_rule.h"

namespace dilated_attention {
namespace views {

constexpr int kMergeThreads = 256;  // threads a block: eight rows

// One call of a launch: the accumulators out (C, Bb, m, n, D) and lse (C, Bb, m, n), the call's out
// (C, Bb, n, m, D) and lse (C, Bb, n, m) in acc_t, strides in elements; rows = C Bb m n; nf its
// non-finite corrections (nf.any null: none).
template <typename scalar_t, typename acc_t>
struct MergeTensors {
  acc_t* oa;
  acc_t* la;
  const scalar_t* oc;
  const acc_t* lc;
  int64_t Bb, m, n, D, rows;
  int64_t so[5], sl[4], sc[5], slc[4];
  NonFiniteRows<scalar_t> nf;
};

// The kernel's argument: the calls of one launch.
template <typename scalar_t, typename acc_t>
struct MergeJob {
  MergeTensors<scalar_t, acc_t> call[kMergeCalls];
  int count = 0;
  int64_t max_rows = 0;  // the most rows a call has: the grid's x covers them
  bool first = false;    // the accumulators hold nothing yet at the calls' rows: the calls' values are copied
};

// The kernel parameters stay within the 4 KiB that every architecture and toolkit takes.
static_assert(sizeof(MergeJob<c10::BFloat16, float>) <= 4096, "merge kernel argument above 4 KiB");
static_assert(sizeof(MergeJob<double, double>) <= 4096, "merge kernel argument above 4 KiB");

// The grid of job: x over the rows of its largest call (a warp a row), y over its calls.
template <typename scalar_t, typename acc_t>
dim3 merge_grid(const MergeJob<scalar_t, acc_t>& job) {
  const int64_t threads = job.max_rows * 32;
  return dim3(static_cast<unsigned>((threads + kMergeThreads - 1) / kMergeThreads),
              static_cast<unsigned>(job.count));
}

// Calls launch(job) for the calls make(0), ..., make(count - 1) (MergeTensors with rows set), in
// jobs of up to kMergeCalls calls, in order; calls of no rows take no place, a job of none no launch.
template <typename scalar_t, typename acc_t, typename Make, typename Launch>
void merge_in_jobs(int64_t count, bool first, Make&& make, Launch&& launch) {
  MergeJob<scalar_t, acc_t> job;
  job.first = first;
  auto flush = [&] {
    if (job.max_rows > 0) launch(static_cast<const MergeJob<scalar_t, acc_t>&>(job));
    job.count = 0;
    job.max_rows = 0;
  };
  for (int64_t i = 0; i < count; ++i) {
    const MergeTensors<scalar_t, acc_t> t = make(i);
    if (t.rows == 0) continue;
    if (job.count == kMergeCalls) flush();
    job.call[job.count++] = t;
    if (t.rows > job.max_rows) job.max_rows = t.rows;
  }
  flush();
}

// Row warp of call blockIdx.y; lane 0 stores the merged lse after every lane has read the old one.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kMergeThreads) merge_kernel(MergeJob<scalar_t, acc_t> job) {
  const MergeTensors<scalar_t, acc_t>& s = job.call[blockIdx.y];
  const int64_t row = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= s.rows) return;  // the whole warp: a warp is one row
  const int64_t bb = row / (s.m * s.n), j = (row / s.n) % s.m, t = row % s.n;
  acc_t* o = s.oa + batch_offset(bb, s.Bb, s.so) + j * s.so[2] + t * s.so[3];
  acc_t* l = s.la + batch_offset(bb, s.Bb, s.sl) + j * s.sl[2] + t * s.sl[3];
  const scalar_t* c = s.oc + batch_offset(bb, s.Bb, s.sc) + t * s.sc[2] + j * s.sc[3];
  const CorrectedRow<scalar_t, acc_t> corrected(s.nf, bb, j, t);
  const acc_t b = corrected.lse(s.lc[batch_offset(bb, s.Bb, s.slc) + t * s.slc[2] + j * s.slc[3]]);
  const bool first = job.first;
  acc_t lse = b, wa = 0, wb = 1;
  if (!first) merge_weights<acc_t>(*l, b, &lse, &wa, &wb);
  for (int64_t d = lane; d < s.D; d += 32) {
    const acc_t v = corrected.out(static_cast<acc_t>(c[d * s.sc[4]]), d) * wb;
    o[d * s.so[4]] = first ? v : o[d * s.so[4]] * wa + v;
  }
  __syncwarp();
  if (lane == 0) *l = lse;
}

}  // namespace views
}  // namespace dilated_attention

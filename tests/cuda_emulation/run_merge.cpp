// Runs merge_kernel.cuh (the views driver's log-sum-exp merge of kernel calls into its
// accumulators) on the CPU through cuda_emulation.h, for tests without a GPU
// (tests/backends/test_views_merge.py loads it with ctypes). It splits the calls into launches with
// merge_in_jobs and sizes each grid with merge_grid, as merge_cuda.cu does, and runs the grid block
// by block. Build:
//   c++ -std=c++17 -O1 -shared -fPIC -DDA_CUDA_EMULATION -I<csrc> -I<tests/cuda_emulation> -I<cuda include> -I<torch include>
//       tests/cuda_emulation/run_merge.cpp -o run_merge.so
#ifndef DA_CUDA_EMULATION
#error "build with -DDA_CUDA_EMULATION"
#endif

#include "views/merge_kernel.cuh"

using dilated_attention::views::kMergeCalls;
using dilated_attention::views::kMergeThreads;
using dilated_attention::views::merge_grid;
using dilated_attention::views::merge_in_jobs;
using dilated_attention::views::merge_kernel;
using dilated_attention::views::MergeJob;
using dilated_attention::views::MergeTensors;
using dilated_attention::views::NonFiniteRows;

namespace {

constexpr int kMeta = 45;  // values of meta per call
constexpr int kPtrs = 9;   // pointers per call

// Call i: meta holds C, Bb, m, n, D, the strides of out_acc (5), lse_acc (4), out_c (5), lse_c (4),
// then the corrections: present, values present (causal masking), mk, g, causal, and the strides
// of qbad (4), kbad (4), vbad (4), v (5); ptrs holds out_acc, lse_acc, out_c, lse_c, any, qbad,
// kbad, vbad, v (lse_c in the accumulators' dtype).
template <typename scalar_t, typename acc_t>
MergeTensors<scalar_t, acc_t> call(int64_t i, const int64_t* meta, void** ptrs) {
  const int64_t* m = meta + kMeta * i;
  void** p = ptrs + kPtrs * i;
  MergeTensors<scalar_t, acc_t> t{};
  t.oa = static_cast<acc_t*>(p[0]);
  t.la = static_cast<acc_t*>(p[1]);
  t.oc = static_cast<const scalar_t*>(p[2]);
  t.lc = static_cast<const acc_t*>(p[3]);
  t.Bb = m[1];
  t.m = m[2];
  t.n = m[3];
  t.D = m[4];
  t.rows = m[0] * m[1] * m[2] * m[3];
  for (int d = 0; d < 5; ++d) t.so[d] = m[5 + d], t.sc[d] = m[14 + d];
  for (int d = 0; d < 4; ++d) t.sl[d] = m[10 + d], t.slc[d] = m[19 + d];
  NonFiniteRows<scalar_t>& nf = t.nf;
  nf = NonFiniteRows<scalar_t>{};
  if (m[23]) {
    nf.any = static_cast<const int*>(p[4]);
    nf.qbad = static_cast<const int*>(p[5]);
    nf.kbad = static_cast<const int*>(p[6]);
    for (int d = 0; d < 4; ++d) nf.sq[d] = m[28 + d], nf.sk[d] = m[32 + d];
    if (m[24]) {
      nf.vbad = static_cast<const int*>(p[7]);
      nf.v = static_cast<const scalar_t*>(p[8]);
      for (int d = 0; d < 4; ++d) nf.sv[d] = m[36 + d];
      for (int d = 0; d < 5; ++d) nf.svv[d] = m[40 + d];
    }
    nf.Bb = m[1];
    nf.mk = m[25];
    nf.g = m[26];
    nf.causal = m[27] != 0;
  }
  return t;
}

template <typename scalar_t, typename acc_t>
int run(int count, bool first, const int64_t* meta, void** ptrs) {
  int launches = 0;
  merge_in_jobs<scalar_t, acc_t>(
      count, first, [&](int64_t i) { return call<scalar_t, acc_t>(i, meta, ptrs); },
      [&](const MergeJob<scalar_t, acc_t>& job) {
        ++launches;
        const dim3 grid = merge_grid(job);
        for (unsigned y = 0; y < grid.y; ++y)
          for (unsigned x = 0; x < grid.x; ++x)
            da_emu::run_block(grid, dim3(x, y, 1), kMergeThreads,
                              [&] { merge_kernel<scalar_t, acc_t>(job); });
      });
  return launches;
}

template <typename acc_t>
int run_acc(int src, int count, bool first, const int64_t* meta, void** ptrs) {
  switch (src) {
    case 0: return run<float, acc_t>(count, first, meta, ptrs);
    case 1: return run<c10::BFloat16, acc_t>(count, first, meta, ptrs);
    case 2: return run<c10::Half, acc_t>(count, first, meta, ptrs);
    case 3: return run<double, acc_t>(count, first, meta, ptrs);
    default: return -1;
  }
}

}  // namespace

// Merges `count` calls (meta and ptrs as call() reads them); acc: the accumulators' dtype (0
// float32, 1 float64), src: the calls' out (0 float32, 1 bfloat16, 2 float16, 3 float64). Returns
// the launches it took, or -1 for a dtype it does not know.
extern "C" int da_emu_merge(int acc, int src, int count, int first, const int64_t* meta, void** ptrs) {
  if (acc == 0) return run_acc<float>(src, count, first != 0, meta, ptrs);
  if (acc == 1) return run_acc<double>(src, count, first != 0, meta, ptrs);
  return -1;
}

// The calls one launch merges at the most, and the bytes of its kernel argument (float32
// accumulators, bfloat16 calls).
extern "C" int da_emu_merge_limits(int64_t* out) {
  out[0] = kMergeCalls;
  out[1] = sizeof(MergeJob<c10::BFloat16, float>);
  return 0;
}

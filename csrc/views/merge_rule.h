// One row of the log-sum-exp merge (merge.h), shared by the CPU loop and the CUDA kernel.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define DA_MERGE_HD __host__ __device__ __forceinline__
#else
#define DA_MERGE_HD inline
#endif

namespace dilated_attention {
namespace views {

// Calls one CUDA launch of the merge takes at the most (merge_kernel.cuh MergeJob, within the 4 KiB
// of a kernel's arguments); the driver's launch count reads it too (_C.merge_calls).
constexpr int kMergeCalls = 8;

// The offset of entry i of a view's two batch dims (C, Bb), the first two of its strides s.
DA_MERGE_HD int64_t batch_offset(int64_t i, int64_t Bb, const int64_t* s) {
  return (i / Bb) * s[0] + (i % Bb) * s[1];
}

// The merged lse of a (accumulator) and b (call) and the weights exp(a - lse), exp(b - lse) of
// the two parts: weights 0 where both are -inf, NaN where either is NaN (as torch.logaddexp).
template <typename acc_t>
DA_MERGE_HD void merge_weights(acc_t a, acc_t b, acc_t* lse, acc_t* wa, acc_t* wb) {
  if (a != a || b != b) {
    *lse = a + b;
    *wa = *lse;
    *wb = *lse;
    return;
  }
  const acc_t mx = a > b ? a : b;
  if (mx == -INFINITY) {
    *lse = mx;
    *wa = 0;
    *wb = 0;
    return;
  }
  if (a == b && mx == INFINITY) {
    *lse = mx;
  } else {
    const acc_t d = a > b ? b - a : a - b;
    *lse = mx + log1p(exp(d));
  }
  *wa = exp(a - *lse);
  *wb = exp(b - *lse);
}

// The corrections for non-finite inputs of one kernel call (backends/driver.py's _NonFinite), read by the
// merge of the call's rows; int flags per row (1: the row holds a non-finite entry), set on the
// device, never read on the host. The call's batch dims are two, (C, Bb): entry bb of the pair is
// (bb / Bb, bb % Bb). A row (bb, j, t) of the call reads its query row and the key rows
// x of key/value head u = t / g, x <= j with causal masking, every x without:
//
// * any row it reads of q or k holds a non-finite entry: its out and lse are NaN;
// * causal masking: the kernel read v with its non-finite entries taken as 0 (0 * inf kept out of
//   the masked weights); the non-finite entries of the values it reads are added to its out.
template <typename scalar_t>
struct NonFiniteRows {
  const int* any;   // nonzero where some row holds a non-finite entry; nullptr: no corrections
  const int* qbad;  // (C, Bb, m, n)
  int64_t sq[4];
  const int* kbad;  // (C, Bb, mk, nk)
  int64_t sk[4];
  const int* vbad;  // (C, Bb, mk, nk); nullptr without causal masking
  int64_t sv[4];
  const scalar_t* v;  // the values (C, Bb, mk, nk, D) as the inputs hold them
  int64_t svv[5];
  int64_t Bb, mk, g;
  bool causal;

  // Whether the merge corrects its rows at all (one read of the flag).
  DA_MERGE_HD bool active() const { return any != nullptr && *any != 0; }

  // The last key row that row j reads.
  DA_MERGE_HD int64_t last(int64_t j) const { return causal && j < mk - 1 ? j : mk - 1; }

  // Whether row (bb, j, t) reads a query or key row with a non-finite entry.
  DA_MERGE_HD bool reads_nonfinite(int64_t bb, int64_t j, int64_t t) const {
    if (qbad[batch_offset(bb, Bb, sq) + j * sq[2] + t * sq[3]]) return true;
    const int* k = kbad + batch_offset(bb, Bb, sk) + (t / g) * sk[3];
    const int64_t end = last(j);
    for (int64_t x = 0; x <= end; ++x)
      if (k[x * sk[2]]) return true;
    return false;
  }

  // The sum of the non-finite entries d of the values that row (bb, j, t) reads (0 where none,
  // or without causal masking).
  template <typename acc_t>
  DA_MERGE_HD acc_t nonfinite_values(int64_t bb, int64_t j, int64_t t, int64_t d) const {
    acc_t s = 0;
    if (vbad == nullptr) return s;
    const int64_t u = t / g, end = last(j);
    const int* bad = vbad + batch_offset(bb, Bb, sv) + u * sv[3];
    const scalar_t* vals = v + batch_offset(bb, Bb, svv) + u * svv[3] + d * svv[4];
    for (int64_t x = 0; x <= end; ++x) {
      if (!bad[x * sv[2]]) continue;
      const acc_t e = static_cast<acc_t>(vals[x * svv[2]]);
      if (!(e - e == 0)) s += e;  // inf - inf and NaN - NaN are NaN
    }
    return s;
  }
};

// A call's row (bb, j, t) as the merge takes it: its lse b and out entries c (in acc_t), corrected
// for non-finite inputs (fix active).
template <typename scalar_t, typename acc_t>
struct CorrectedRow {
  const NonFiniteRows<scalar_t>& fix;
  int64_t bb, j, t;
  bool active, nan;

  DA_MERGE_HD CorrectedRow(const NonFiniteRows<scalar_t>& f, int64_t bb_, int64_t j_, int64_t t_)
      : fix(f), bb(bb_), j(j_), t(t_), active(f.active()), nan(active && f.reads_nonfinite(bb_, j_, t_)) {}

  DA_MERGE_HD acc_t lse(acc_t b) const { return nan ? static_cast<acc_t>(NAN) : b; }

  DA_MERGE_HD acc_t out(acc_t c, int64_t d) const {
    if (nan) return static_cast<acc_t>(NAN);
    return active ? c + fix.template nonfinite_values<acc_t>(bb, j, t, d) : c;
  }
};

}  // namespace views
}  // namespace dilated_attention

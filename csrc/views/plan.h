// The kernel calls of every driver that runs a kernel per call, as strided views of q, k and v (no
// gathers): the one plan, used by the sdpa backend's C++ driver (views.cpp, varlen.cpp through it)
// and, through the extension's plan() (dilated_attention.cpp), by the Python driver
// (dilated_attention/backends/strided.py decodes it into its Call tuples).
//
// A branch (w, r) cuts each sequence of n positions into segments of L = min(w, n) positions (and a
// shorter last one, a separate part, when n % L != 0); the sequences of a packed batch follow each
// other, each with parts of its own. A kernel call takes n heads whose phase and head index both
// step by a constant:
//
//     element [bb, j, t, e] = segment[bb][p0 + t * dp + j * r, c0 + t * dc, e]
//
// * r < Hq: the heads of one phase o (dp = 0, heads o::r) in one call, grouped-query attention
//   kept where the kernel takes it (native_gqa) and the key/value heads step evenly; or, where
//   that takes fewer calls (r = 8 and Hq = 12: 2 calls instead of 8), the heads along their
//   phases, as for r >= Hq;
// * r >= Hq: head h reads its own phase h mod r; the heads i, i + G, ... share one call (dp = dc
//   = G for q), split where the phase wraps at r or the number of rows m of a head changes;
// * everything else splits into the longest runs of heads that step evenly (a key/value head
//   read by several query heads of a call is a stride-0 head, "expanded").
//
// Grouped-query heads whose key/value heads do not step evenly along a phase or from one phase to
// the next (Hq = 12, Hkv = 4, r = 2: phase o reads key/value heads 0, 0, 1, 2, 2, 3) split a branch
// into more calls than the same branch with every query head its own key/value head. A driver
// that can run a branch on k and v with their heads repeated to Hq (repeat_kv: views.cpp repeats
// them once per direction and sums dk and dv per key/value head once) gets that branch planned for
// Hkv = Hq where that makes fewer driver calls (driver_calls below, one batch entry), or as many
// and fewer of them gathered, and, once some branch reads them, every branch where they cost no more
// (its calls then repeat nothing of their own); Plan::repeated says so. The Python drivers plan without repeat_kv
// (they read k and v as they are). Repeating costs one copy of k and v (g = Hq / Hkv times their
// size) for every such branch together; gathering a call's key/value heads by a list of head
// indices instead would need calls that are no longer strided views, a gather by index in the
// rows kernel and an indexed add of the gradients back.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace dilated_attention {
namespace views {

// rows segments of length positions each, the first at position start.
struct Part {
  int64_t start, rows, length;
};

// Head t < n of a call reads phase p0 + t * dp of head c0 + t * dc (dc = dp = 0 with n > 1: a
// stride-0 view, several heads of the call reading the same head and phase).
struct Strided {
  int64_t p0, dp, c0, dc, n;
};

// One kernel call: m rows of every segment of part, query heads q, key/value heads kv
// (q.n == kv.n * g: query head t reads key/value head t / g).
struct Call {
  Part part;
  int64_t r, m;
  Strided q, kv;
  int64_t g;
};

// The calls of every branch, in branch order.
struct Plan {
  std::vector<std::vector<Call>> branches;
  // Per branch: whether its calls read k and v with their heads repeated to Hq (head h of those is
  // key/value head h / (Hq / Hkv)): the plan of Hkv = Hq, only with repeat_kv.
  std::vector<char> repeated;

  bool any_repeated() const {
    for (const char r : repeated)
      if (r) return true;
    return false;
  }
};

// The plan of the sequences of lengths (a packed batch: they follow each other, the first at
// position 0), Hq query and Hkv key/value heads and the branches (segment_lengths,
// dilation_rates), cached per key (thread-safe). native_gqa: the kernel takes fewer key/value
// heads than query heads. A bad argument (a negative length, Hq not a multiple of Hkv >= 1, w or
// r < 1, lists of two lengths) throws c10::ValueError naming it. repeat_kv: the driver can run a
// branch on k and v repeated to Hq heads, and does where that makes fewer calls (Plan::repeated).
std::shared_ptr<const Plan> plan_branches(at::IntArrayRef lengths, int64_t Hq, int64_t Hkv,
                                          at::IntArrayRef segment_lengths, at::IntArrayRef dilation_rates,
                                          bool native_gqa, bool repeat_kv = false);

// The plan of one sequence of N positions (a batch of such sequences runs each call per batch entry
// or folded, folds() below).
inline std::shared_ptr<const Plan> plan_branches(int64_t N, int64_t Hq, int64_t Hkv,
                                                 at::IntArrayRef segment_lengths,
                                                 at::IntArrayRef dilation_rates, bool native_gqa,
                                                 bool repeat_kv = false) {
  return plan_branches(at::IntArrayRef(&N, 1), Hq, Hkv, segment_lengths, dilation_rates, native_gqa,
                       repeat_kv);
}

// What the plan cache holds and has done since it was last cleared: every plan_branches call
// counts, from C++ (the views ops) or Python.
struct PlanCacheInfo {
  int64_t hits, misses, entries, max_entries;
};
PlanCacheInfo plan_cache_info();
// Empties the plan cache and zeroes its counts.
void plan_cache_clear();

// Whether the segments of call fold with the batch dim of a contiguous (B, N, ...) tensor into
// one dim (one batch, one segment per row, or segments that tile the sequence); otherwise the
// driver runs the call once per batch entry.
inline bool folds(const Call& c, int64_t B, int64_t N) {
  return B == 1 || c.part.rows == 1 || (c.part.start == 0 && c.part.rows * c.part.length == N);
}

// One kernel call of a driver: call c of the plan at batch entry b (b < 0: every batch entry at
// once, where folds() holds), or, with count > 1, the count calls c, c + step, ... of a branch whose
// phases and heads step evenly (the phases of a branch: phase o + 1 reads the next position and the
// next heads), in one kernel call whose batch dim is that index. With several batch entries or
// segments the index and those are two batch dims, which no one stride spans: the driver then
// gathers the run's rows into one contiguous batch (views.cpp Run).
struct DriverCall {
  Call c;
  int64_t index;  // of c among the branch's plan calls
  int64_t b;
  int64_t count = 1;
  int64_t step_p = 0, step_q = 0, step_kv = 0;  // per index: the phase, the q and k/v heads
  // Whether some key/value row this call reads (in its batch entries) is read by an earlier call of
  // the branch after the last call that has adds_first (grouped-query heads: key/value heads shared
  // across calls): a driver that adds the calls' gradients into dk and dv in one batch of moves runs
  // the adds pending before this call's first. Without it, the gradient rows of those calls are
  // disjoint.
  bool adds_first = false;

  // The entries of the batch dim each of the count calls runs over, for B sequences: batch entry
  // b's segments, or every batch entry folded with the segments (b < 0).
  int64_t batch(int64_t B) const { return b >= 0 ? c.part.rows : B * c.part.rows; }
  // Whether the count calls and their batch entries are both several: no one stride spans them,
  // and the driver gathers the rows into one contiguous batch.
  bool gathers(int64_t B) const { return count > 1 && batch(B) > 1; }
};

// The kernel calls of a branch's plan calls for a batch of B sequences of N positions: one per
// call and batch entry where the call does not fold, the calls that extend one another in one;
// adds_first set where a call's key/value rows meet those of the calls since the last it is set on.
std::vector<DriverCall> driver_calls(const std::vector<Call>& calls, int64_t B, int64_t N);

}  // namespace views
}  // namespace dilated_attention

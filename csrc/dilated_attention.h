/*
 * Index arithmetic of dilated attention (LongNet, Ding et al. 2023, Eq. 10-15), shared by the
 * CPU and CUDA kernels. Plain C: usable from C++ and from CUDA device code.
 *
 * A branch is (w, r): segment length w >= 1, dilation rate 1 <= r <= w. Position p lies in
 * segment s(p) = p / w at index t(p) = p % w. Head h uses the phase o(h) = h % r. The branch
 * covers (p, h) when t(p) % r == o(h); a covered query attends to every covered key of its own
 * segment (and, when causal, only keys x <= p). The last segment may be shorter than w.
 *
 * Inside one segment the covered positions form an arithmetic progression
 *     seg_first + j * r,  j = 0 .. seg_count - 1
 * and j is the position's "dilated index". Dilation keeps order, so causal masking is
 * j_key <= j_query.
 */
#ifndef DILATED_ATTENTION_H_
#define DILATED_ATTENTION_H_

#include <stdint.h>

#ifdef __CUDACC__
#define DA_HD __host__ __device__ __forceinline__
#else
#define DA_HD static inline
#endif

/* Most branches one call may have (the CUDA kernels keep them in a by-value struct). */
#define DA_MAX_BRANCHES 16
/* Largest head dimension the kernels accept. */
#define DA_MAX_HEAD_DIM 256

typedef struct {
  int64_t n;                  /* number of branches */
  int64_t w[DA_MAX_BRANCHES]; /* segment lengths */
  int64_t r[DA_MAX_BRANCHES]; /* dilation rates */
} da_branches;

/*
 * The covered positions of one segment that fall inside a block [a0, a1) of positions.
 *   seg_first, seg_count: all covered positions of the segment (phase o, step r);
 *   first, count:         those inside the block (also step r);
 *   j0:                   dilated index of `first` within the segment.
 */
typedef struct {
  int64_t seg_first;
  int64_t seg_count;
  int64_t first;
  int64_t count;
  int64_t j0;
} da_group;

DA_HD int64_t da_min64(int64_t a, int64_t b) {
  return a < b ? a : b;
}
DA_HD int64_t da_max64(int64_t a, int64_t b) {
  return a > b ? a : b;
}
DA_HD int64_t da_ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

/* Fill g for segment s, block [a0, a1), sequence length N, branch (w, r), phase o. */
DA_HD void da_group_at(int64_t s, int64_t a0, int64_t a1, int64_t N, int64_t w, int64_t r, int64_t o,
                       da_group* g) {
  const int64_t seg_start = s * w;
  const int64_t seg_end = da_min64(seg_start + w, N);
  g->seg_first = seg_start + o;
  g->seg_count = g->seg_first < seg_end ? da_ceil_div(seg_end - g->seg_first, r) : 0;
  const int64_t lo = da_max64(a0, seg_start);
  const int64_t hi = da_min64(a1, seg_end);
  const int64_t rel = lo - g->seg_first;
  g->j0 = rel <= 0 ? 0 : da_ceil_div(rel, r);
  g->first = g->seg_first + g->j0 * r;
  g->count = g->first < hi ? da_ceil_div(hi - g->first, r) : 0;
}

/* First and last segment index touched by the block [a0, a1), a1 > a0. */
DA_HD int64_t da_first_segment(int64_t a0, int64_t w) {
  return a0 / w;
}
DA_HD int64_t da_last_segment(int64_t a1, int64_t w) {
  return (a1 - 1) / w;
}

/* Number of keys a query of dilated index jq sees in a segment of seg_count covered keys. */
DA_HD int64_t da_keys_for_query(int64_t jq, int64_t seg_count, int is_causal) {
  return is_causal ? da_min64(jq + 1, seg_count) : seg_count;
}

/* First dilated query index that sees the key of dilated index jk. */
DA_HD int64_t da_first_query_for_key(int64_t jk, int is_causal) {
  return is_causal ? jk : 0;
}

#endif /* DILATED_ATTENTION_H_ */

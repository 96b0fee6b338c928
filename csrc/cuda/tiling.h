/*
 * How the CUDA kernels cut the work into thread blocks, and the index arithmetic they use to walk
 * the branches. C++ with DA_HD functions: the kernels use it on the device, the host uses it to
 * choose a tiling, and a CPU test (tests/test_cuda.py) compiles it with a C++ compiler to check,
 * without a GPU, that the walk visits every (query, key) pair of every branch exactly once.
 *
 * Rows. A thread block owns M = warps * rows_per_warp "rows": positions of one head (queries in
 * the forward and dq kernels, keys in the dk/dv kernel). They are the positions of residue c
 * modulo a stride R inside an aligned block of span = M * R positions:
 *     tile = c * tiles_per_residue + t,   base = t * span + c,   row j at base + j * R.
 * Row j belongs to warp j / rows_per_warp (layout "contiguous") or to warp j % warps (layout
 * "interleaved", each warp then holds the positions of one residue modulo warps * R). Every
 * position of [0, N) belongs to exactly one row of one tile; rows at >= N are padding.
 *
 * The other side. For a branch (w, r), head phase o = h % r and a segment s that the tile's rows
 * touch, the covered positions of the segment are seg_first + j * r, j < seg_count; a row is
 * "active" when it is one of them (its dilated index j is then its row index in the branch). The
 * kernels stream the "other" side (keys for a query tile, queries for a key tile) over a range of
 * dilated indices [o_begin, o_end) in chunks, and mask the pairs that the branch does not contain
 * (inactive row, index past the range, causal order).
 *
 * Why the layout matters: a warp's rows share the keys they read only when they are active in the
 * same segment. For LongNet's branches (w = w0 * 2^i, r = 2^i) the interleaved layout with
 * R = w0 / M puts a whole tile in one segment of every branch and gives each warp one residue
 * modulo 4R, so every branch with r <= 4R keeps a warp fully active or fully idle.
 * da_choose_tiling estimates the work of a few candidate tilings and keeps the cheapest; the
 * result never changes what is computed, only how fast.
 */
#ifndef DILATED_ATTENTION_CUDA_TILING_H_
#define DILATED_ATTENTION_CUDA_TILING_H_

#include "../dilated_attention.h"

/* The side of the attention matrix that a kernel's rows are. */
#define DA_ROWS_ARE_QUERIES 0 /* forward and dq: rows are queries, the walk streams keys */
#define DA_ROWS_ARE_KEYS 1    /* dk/dv: rows are keys, the walk streams queries */

/*
 * A piece (dilated_attention::piece_fwd / piece_bwd: a rank's queries of one head phase of a
 * segment that spans ranks, against one run of its keys) is dense attention of nq queries over nk
 * keys, both already sparsified, key j visible to query i when j <= i + offset under causal
 * masking. The kernels run it as the walk of one segment: one branch (w >= nq, nk; r = 1) in which
 * every row is active, whose other side has the indices [0, nk) (query rows) or [0, nq) (key
 * rows), and whose causal order is compared with the offset. nk = 0: the op itself (every branch
 * and segment as above, causal order without an offset).
 */
typedef struct {
  int64_t nq, nk, offset;
} da_piece;

/* The causal offset of the walk's order: the piece's, 0 for the op. */
DA_HD int64_t da_causal_offset(const da_piece* pc) {
  return pc->nk > 0 ? pc->offset : 0;
}

typedef struct {
  int64_t R;                 /* stride between the positions of a tile's rows */
  int64_t warps;             /* warps per thread block */
  int64_t rows_per_warp;     /* rows per warp; M = warps * rows_per_warp */
  int64_t interleaved;       /* 1: row j belongs to warp j % warps; 0: to warp j / rows_per_warp */
  int64_t tiles_per_residue; /* ceil(N / (M * R)) */
} da_tiling;

/* Rows per thread block. */
DA_HD int64_t da_tile_rows(const da_tiling* t) {
  return t->warps * t->rows_per_warp;
}

/* Number of thread blocks (tiles) for a sequence of N positions. */
DA_HD int64_t da_num_tiles(const da_tiling* t) {
  return t->R * t->tiles_per_residue;
}

/* First row position of tile `tile` (may be >= N: an empty tile). */
DA_HD int64_t da_tile_base(const da_tiling* t, int64_t tile) {
  const int64_t c = tile / t->tiles_per_residue, i = tile % t->tiles_per_residue;
  return i * da_tile_rows(t) * t->R + c;
}

/* Position of row `i` of warp `warp` in the tile whose first row is at `base` (may be >= N). */
DA_HD int64_t da_row_position(const da_tiling* t, int64_t base, int64_t warp, int64_t i) {
  const int64_t j = t->interleaved ? i * t->warps + warp : warp * t->rows_per_warp + i;
  return base + j * t->R;
}

/* Position of the last row below N of the tile starting at base < N. */
DA_HD int64_t da_tile_last(const da_tiling* t, int64_t base, int64_t N) {
  const int64_t j = da_min64(da_tile_rows(t) - 1, (N - 1 - base) / t->R);
  return base + j * t->R;
}

/*
 * The walk's functions below take its integer type I: int64_t (the sm80 kernels, the host) or
 * int32_t (the sm90 producer warp, which keeps few registers). The walk sees every branch with its
 * segment length and rate clamped to N (da_branch_at), so that every index it holds is below
 * 2 N < 2^31 (N < 2^30 is checked at the op's entry for CUDA) and 32 bits hold them.
 * da_same<I>::type: a parameter that does not take part in deducing I.
 */
template <typename I>
struct da_same {
  typedef I type;
};

/*
 * Branch bi of br as the walk sees it for head h: its segment length *w and rate *r clamped to N,
 * which changes nothing (a segment of w >= N is the whole sequence; a rate r >= N covers one
 * position of a segment, as r = N does), and the head's phase *o = h mod r of the rate itself
 * (o >= N: the branch covers no position of the head's).
 */
template <typename I>
DA_HD void da_branch_at(const da_branches* br, I bi, I h, I N, I* w, I* r, I* o) {
  const int64_t bw = br->w[bi], br_ = br->r[bi];
  *w = bw < N ? (I)bw : N;
  *r = br_ < N ? (I)br_ : N;
  *o = br_ > h ? h : h % (I)br_;
}

/* End of segment s of a branch of segment length w (the last segment may be shorter). */
template <typename I>
DA_HD I da_segment_end(I s, I w, I N) {
  const I start = s * w; /* <= N: s never exceeds (N - 1) / w */
  return w >= N - start ? N : start + w;
}

/*
 * The range [*o_begin, *o_end) of dilated indices of the other side that the rows of the tile
 * [base, last] can meet in segment s of branch (w, r) at phase o; *seg_first receives the
 * segment's first covered position. Returns 0 when the range is empty. Causal: for query rows it
 * stops after the last row's index (keys beyond it are masked for every row); for key rows it
 * starts at the first row's index (each shifted by the piece's offset). A piece's other side has
 * its own length (pc->nk keys or pc->nq queries).
 */
template <typename I>
DA_HD int da_segment_range(I base, I last, I N, I w, I r, I o, I s, int is_causal, int rows_are,
                           const da_piece* pc, I* seg_first, I* o_begin, I* o_end) {
  const I seg_start = s * w, seg_end = da_segment_end(s, w, N);
  const I first = seg_start + o, off = (I)da_causal_offset(pc);
  if (o >= w || first >= seg_end) return 0;
  const I count =
      pc->nk > 0 ? (I)(rows_are == DA_ROWS_ARE_QUERIES ? pc->nk : pc->nq) : (seg_end - first + r - 1) / r;
  I lo = 0, hi = count;
  if (is_causal && rows_are == DA_ROWS_ARE_QUERIES) {
    const I top = last < seg_end - 1 ? last : seg_end - 1; /* no row of this tile lies beyond top */
    if (top < first) return 0;
    const I reach = (top - first) / r + 1 + off;
    hi = count < reach ? count : reach;
    if (hi <= 0) return 0;
  } else if (is_causal) {
    const I bottom = base > seg_start ? base : seg_start; /* no row of this tile lies below bottom */
    const I from = (bottom > first ? (bottom - first) / r : 0) - off;
    lo = from > 0 ? from : 0;
    if (lo >= count) return 0;
  }
  *seg_first = first;
  *o_begin = lo;
  *o_end = hi;
  return 1;
}

/* Dilated index of position p in segment s of branch (w, r) at phase o, or -1 when the branch
 * does not cover p there (p outside [0, N), in another segment, or at another phase). */
template <typename I>
DA_HD I da_row_index(I p, I N, I s, I w, I r, I o) {
  if (p < 0 || p >= N || p / w != s) return -1;
  const I rel = p - s * w - o;
  if (rel < 0 || rel % r != 0) return -1;
  return rel / r;
}

/* Whether the row of dilated index jrow (-1: inactive) meets the other side's index j; off is the
 * causal offset (da_causal_offset). */
template <typename I>
DA_HD int da_pair_active(I jrow, I j, I o_end, int is_causal, int rows_are, I off) {
  if (jrow < 0 || j >= o_end) return 0;
  if (!is_causal) return 1;
  return rows_are == DA_ROWS_ARE_QUERIES ? j <= jrow + off : jrow <= j + off;
}

/*
 * The walk's position: (head of the group gi, branch bi, segment s) and, once da_walk_candidate
 * has found a segment whose range is not empty, that segment's branch (w, r), phase o, first
 * covered position and range of the other side.
 */
template <typename I>
struct da_walk_of {
  I gi, bi, s, s_end;
  I w, r, o; /* da_branch_at's */
  I seg_first, o_begin, o_end;
};
typedef da_walk_of<int64_t> da_walk;

template <typename I>
DA_HD void da_walk_begin(da_walk_of<I>* st) {
  st->gi = 0;
  st->bi = 0;
  st->s = -1;
}

/*
 * Moves the walk to the first segment at or after its position (heads h0 .. h0+G-1 in order, then
 * branches, then the segments that the rows [base, last] touch) whose range is not empty, and
 * fills its fields; returns 0 when nothing is left. The caller then checks whether any row of the
 * block is active there (da_row_index) and, if none is, increments s and calls again.
 */
template <typename I>
DA_HD int da_walk_candidate(da_walk_of<I>* st, const da_branches* br, typename da_same<I>::type G,
                            typename da_same<I>::type h0, typename da_same<I>::type base,
                            typename da_same<I>::type last, typename da_same<I>::type N, int is_causal,
                            int rows_are, const da_piece* pc) {
  for (;;) {
    if (st->gi >= G) return 0;
    if (st->bi >= br->n) {
      ++st->gi;
      st->bi = 0;
      st->s = -1;
      continue;
    }
    I w, r, o;
    da_branch_at<I>(br, st->bi, h0 + st->gi, N, &w, &r, &o);
    if (st->s < 0) {
      st->s = base / w;
      st->s_end = last / w + 1;
    }
    if (st->s >= st->s_end) {
      ++st->bi;
      st->s = -1;
      continue;
    }
    if (da_segment_range<I>(base, last, N, w, r, o, st->s, is_causal, rows_are, pc, &st->seg_first,
                            &st->o_begin, &st->o_end)) {
      st->w = w;
      st->r = r;
      st->o = o;
      return 1;
    }
    ++st->s;
  }
}

/*
 * Per warp and chunk [o0, o0 + ot) of the other side, from the warp's active rows (any, all, and
 * the least and largest dilated index among them): whether no pair of the warp can be active (the
 * warp skips the chunk), and whether some pair may be inactive (the warp must mask). off is the
 * causal offset (da_causal_offset).
 */
template <typename I>
DA_HD int da_chunk_skip(int rows_are, int is_causal, I o0, I ot, int warp_any, I warp_jmin, I warp_jmax,
                        I off) {
  if (!warp_any) return 1;
  if (!is_causal) return 0;
  return rows_are == DA_ROWS_ARE_QUERIES ? o0 > warp_jmax + off : o0 + ot - 1 < warp_jmin - off;
}

template <typename I>
DA_HD int da_chunk_needs_mask(int rows_are, int is_causal, I o0, I ot, I o_end, int warp_all, I warp_jmin,
                              I warp_jmax, I off) {
  if (!warp_all || o0 + ot > o_end) return 1;
  if (!is_causal) return 0;
  return rows_are == DA_ROWS_ARE_QUERIES ? o0 + ot - 1 > warp_jmin + off : o0 < warp_jmax - off;
}

/* ------------------------------------------------------------------------------------------ */
/* Choosing a tiling (host)                                                                     */
/* ------------------------------------------------------------------------------------------ */

DA_HD int64_t da_gcd64(int64_t a, int64_t b) {
  while (b != 0) {
    const int64_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}

/* Expected number of segments of length w that an aligned block of `span` positions meets. */
DA_HD double da_segments_met(int64_t span, int64_t w, int64_t N) {
  if (w >= N || span <= 1) return 1.0;
  if (w % span == 0) return 1.0;
  if (span % w == 0) return (double)(span / w);
  return 1.0 + (double)span / (double)w;
}

/*
 * Estimated cost of a tiling, in units of "one row meets one key on the tensor cores": for every
 * branch, the warps that have an active row run all their rows against the keys of every segment
 * they touch (inactive rows are computed and masked), and every thread block that has an active
 * row loads those keys once (weighted as one warp's work on them) and walks the segment.
 *
 * Causal: a warp runs only the chunks up to the largest dilated index of its active rows (query
 * rows; from the least one for key rows), so of a segment's `keys` it runs about
 * (keys + spread) / 2, where `spread` is the distance in dilated indices between the first and
 * the last of its active rows there (at most keys). A layout whose warps spread their rows over a
 * whole segment (interleaved, or a large stride) thus gains almost nothing from the causal order;
 * without this term the model would pick it for LongNet's branches at N >= 128K and compute
 * about 1.6x the useful pairs.
 */
static inline double da_tiling_cost(const da_tiling* t, int64_t N, const da_branches* br, int is_causal) {
  const int64_t M = da_tile_rows(t), span = M * t->R;
  const int64_t row_step = t->interleaved ? t->warps * t->R : t->R; /* inside one warp */
  const int64_t warp_span = t->interleaved ? span : t->rows_per_warp * t->R;
  const double tiles = (double)(t->R * da_ceil_div(N, span));
  double cost = 0.0;
  for (int64_t i = 0; i < br->n; ++i) {
    const int64_t w = br->w[i], r = br->r[i];
    const int64_t weff = w < N ? w : N;
    const double keys = (double)da_ceil_div(weff, r);
    /* With w % r == 0 the phase of a position in its segment is p % r for every segment. */
    const int regular = (w >= N) || (w % r == 0);
    const int64_t gw = regular ? da_gcd64(row_step, r) : 1;
    const int64_t gc = regular ? da_gcd64(t->R, r) : 1;
    /* A warp's rows meet min(rows, r / g) of the r phases: the chance that one is the head's. */
    const double p_warp = (double)da_min64(t->rows_per_warp, r / gw) / (double)r;
    const double p_tile = (double)da_min64(M, r / gc) / (double)r;
    double warp_keys = keys, tile_keys = keys;
    if (is_causal) {
      /* The active rows of a warp (of a tile) follow each other every `every` rows. */
      const int64_t every_w = regular ? r / gw : 1, every_c = regular ? r / gc : 1;
      const int64_t warp_spread = (t->rows_per_warp - 1) / every_w * every_w * row_step;
      const int64_t tile_spread = (M - 1) / every_c * every_c * t->R;
      warp_keys = 0.5 * (keys + (double)da_min64(warp_spread, weff) / (double)r);
      tile_keys = 0.5 * (keys + (double)da_min64(tile_spread, weff) / (double)r);
    }
    const double compute = (double)t->warps * p_warp * da_segments_met(warp_span, weff, N) * warp_keys *
                           (double)t->rows_per_warp;
    const double walk =
        p_tile * da_segments_met(span, weff, N) * (tile_keys + 16.0) * (double)t->rows_per_warp;
    cost += tiles * (compute + walk);
  }
  return cost;
}

/*
 * The cheapest tiling among R in {1, 2, 4, ...} and the branches' dilation rates, in both layouts,
 * for thread blocks of `warps` warps of `rows_per_warp` rows. Deterministic; ties keep the smaller
 * R and the contiguous layout.
 */
static inline da_tiling da_choose_tiling(int64_t N, const da_branches* br, int is_causal, int64_t warps,
                                         int64_t rows_per_warp) {
  da_tiling best;
  best.R = 1;
  best.warps = warps;
  best.rows_per_warp = rows_per_warp;
  best.interleaved = 0;
  best.tiles_per_residue = da_ceil_div(N, warps * rows_per_warp);
  double best_cost = da_tiling_cost(&best, N, br, is_causal);
  int64_t cand[64];
  int nc = 0;
  for (int64_t R = 2; R <= N && R <= ((int64_t)1 << 20) && nc < 40; R *= 2) cand[nc++] = R;
  for (int64_t i = 0; i < br->n && nc < 64; ++i)
    if (br->r[i] > 1 && br->r[i] <= N && (br->r[i] & (br->r[i] - 1)) != 0) cand[nc++] = br->r[i];
  for (int k = 0; k < nc; ++k) {
    for (int64_t il = 0; il <= 1; ++il) {
      da_tiling t = best;
      t.R = cand[k];
      t.interleaved = il;
      t.tiles_per_residue = da_ceil_div(N, warps * rows_per_warp * t.R);
      const double c = da_tiling_cost(&t, N, br, is_causal);
      if (c < best_cost * (1.0 - 1e-9)) {
        best = t;
        best_cost = c;
      }
    }
  }
  return best;
}

/* A tiling with a given R and layout (for tests and for the DILATED_ATTENTION_CUDA_TILING knob). */
static inline da_tiling da_make_tiling(int64_t N, int64_t R, int64_t interleaved, int64_t warps,
                                       int64_t rows_per_warp) {
  da_tiling t;
  t.R = R < 1 ? 1 : R;
  t.warps = warps;
  t.rows_per_warp = rows_per_warp;
  t.interleaved = interleaved ? 1 : 0;
  t.tiles_per_residue = da_ceil_div(N, warps * rows_per_warp * t.R);
  return t;
}

#endif /* DILATED_ATTENTION_CUDA_TILING_H_ */

// The kernels' tile sizes, and their vectors: Vec<T, B>, B bytes of T (GCC vector extensions), with
// the micro-kernel's register block and a vectorised 2^x.
#pragma once

#include <math.h>
#include <stdint.h>

#include <cmath>
#include <type_traits>

#include "isa.h"

namespace dilated_attention {
namespace cpu {

// Tile sizes: QT queries (forward: vector lanes) against KF keys in the forward; KB keys (vector
// lanes) against QT queries in the backward. A forward block spans QB positions (see
// block_size(), forward.cpp). Rows are padded to PAD_BYTES, the widest vector, whatever width a call runs at.
enum { QT = 64, KB = 64, KF = 64, PAD_BYTES = 64 };

// Long sums go in two levels, so that their rounding error does not grow with the segment length:
// the forward merges a query tile's online-softmax state into the block's every SUM_TILES key
// tiles, and the backward adds a key tile's dk and dv into their rows every SUM_TILES query tiles
// (and each key tile's share of dq on its own). 8 tiles are 512 keys or queries.
enum { SUM_TILES = 8 };

/*
 * Vectors of B bytes (GCC vector extensions): 64 for AVX-512, 32 for AVX2, 16 for SSE2 and NEON.
 * The kernels are templates over B, instantiated once per instruction set at the width of its
 * registers (see isa.h): a vector wider than the registers is split into
 * pieces that spill, and broadcasts to it are built lane by lane. MR x NV is the micro-kernel's
 * register block (MR rows of C, NV vectors each): MR * NV accumulators, NV loads of B and one
 * broadcast of A about fill the 32 (AVX-512, NEON) or 16 (AVX2, SSE2) vector registers.
 */
template <typename T, int B>
struct Vec {
  enum { W = B / (int)sizeof(T) };
  typedef T v __attribute__((vector_size(B)));
  typedef T vu __attribute__((vector_size(B), aligned(sizeof(T)), may_alias));
  typedef std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t> U;
  typedef U vi __attribute__((vector_size(B)));
#if defined(__x86_64__)
  // AVX2: 3 x 4 (one spill at most) was the fastest of 2x4, 2x8, 3x4, 4x2, 4x3, 4x4, 6x2, 8x1 on a
  // Zen 1 EPYC, by 15-25% over the next.
  enum { MR = B == 64 ? 4 : B == 32 ? 3 : 4, NV = B == 64 ? 4 : B == 32 ? 4 : 2 };
#else
  enum { MR = 4, NV = B == 16 ? 4 : 2 };
#endif

  DA_INLINE v load(const T* p) { return *(const vu*)p; }
  DA_INLINE void store(T* p, v x) { *(vu*)p = x; }
  DA_INLINE v set(T x) { return v{} + x; }  // outside hot loops: -0 becomes +0
  DA_INLINE v iota() {
    v x;
    for (int i = 0; i < W; ++i) x[i] = (T)i;
    return x;
  }

  /* 2^x. float: n = round(x) (x + 1.5 * 2^23 puts it in the low mantissa bits), f = x - n exactly,
   * 2^f by a degree-6 polynomial (relative error about 1e-7 in float arithmetic), times 2^n built in
   * the exponent bits; x <= -127 gives 0 (so -inf gives 0), NaN stays NaN; 15 vector operations.
   * double (for gradcheck): libm's exp2, lane by lane. */
  DA_INLINE v exp2v(v x) {
    if constexpr (sizeof(T) == 4) {
      const v lo = set(-127.0f), hi = set(127.0f), magic = set(12582912.0f);  // 1.5 * 2^23
      x = x < lo ? lo : x;  // NaN compares false and stays NaN
      x = x > hi ? hi : x;
      const v t = x + magic;
      const v f = x - (t - magic);
      v p = set(1.5353361959569156e-4f);
      p = p * f + 1.3398875016719103e-3f;
      p = p * f + 9.6184369176626205e-3f;
      p = p * f + 5.5503323674201965e-2f;
      p = p * f + 2.4022647738456726e-1f;
      p = p * f + 6.9314718246459961e-1f;
      p = p * f + 1.0f;
      return p * (v)(((vi)t - 0x4B400000u + 127u) << 23);
    } else {
      for (int i = 0; i < W; ++i) x[i] = ::exp2(x[i]);
      return x;
    }
  }
};

/* Rows are padded to this many values of T (PAD_BYTES), a multiple of every vector width. */
template <typename T>
constexpr int64_t pad_values() {
  return PAD_BYTES / (int64_t)sizeof(T);
}

template <typename T>
DA_INLINE T neg_inf() {
  return -INFINITY;
}

}  // namespace cpu
}  // namespace dilated_attention

// CPU implementation of dilated_attention::decode_step: one new token per sequence against the
// bounded cache of dilated_attention.decode.BoundedDilatedKVCache (SPEC section 8).
//
// The cache of a layer is (B, Hkv, T, D), contiguous. Branch i owns rows[i] = min(G, r_i) rows of
// lengths[i] slots from offset sum_{i' < i} rows[i'] * lengths[i'] on (G = Hq / Hkv): the key at
// position x of the current segment (t = x % w) sits in row ((t % r) - j * G) mod r of kv head j
// when that row is below rows[i], at slot t / r. The new token at position p (t = p % w) is first
// written there, then its query heads read, in every branch, the slots 0 .. t / r of that one row:
// contiguous keys, read in place. Query head j * G + g covers p in branch i when (j*G + g) % r ==
// t % r; all heads of a group that read the same row share each key they load (GQA).
//
// Work: items of (sequence, kv head, branch, chunk of keys); each keeps an online softmax per head
// (max, sum, unnormalised output, base-2 scores), and a second pass merges the items of every
// (sequence, kv head) by their log-sum-exp. When B * Hkv is small the rows are split into chunks so
// that every thread has work (FlashDecoding's split-K). Scores in float32 (float64 for float64);
// half types are converted a tile at a time. A position p < 0 is a sequence without a token this
// step: out = 0, lse = -inf, nothing written.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <stdint.h>
#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "../checks.h"

#if defined(__GNUC__) && !defined(__clang__)
// Vectors stay inside always-inlined helpers; the ABI note about wide vector arguments does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace dilated_attention {
namespace {

enum { TILE = 64 };  // keys per online-softmax tile

struct Item {
  int64_t b, j, row_offset, start, len;  // the keys [start, start + len) of the row at row_offset
  int64_t r, phase;                      // query head j * G + g reads them when (j * G + g) % r == phase
  bool reads(int64_t G, int64_t g) const { return (j * G + g) % r == phase; }
};

// Online-softmax state of one head: base-2 max m, sum l, unnormalised output acc[D].
template <typename T>
struct State {
  T m, l;
  T* acc;
};

/*
 * The larger of a and b, NaN where either is: a NaN score makes its row NaN (as in every other
 * path), where std::max and a plain comparison would skip a tile or item whose scores are all NaN
 * (a NaN query) as empty and give out 0, lse -inf.
 */
template <typename T>
static inline T max_or_nan(T a, T b) {
  return (a != a || a > b) ? a : b;
}

/* out = sum_d a[d] * b[d], in 8 independent partial sums (double and the vector tails). */
template <typename T>
static inline T dot(const T* a, const T* b, int64_t D) {
  T s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t d = 0;
  for (; d + 8 <= D; d += 8)
    for (int u = 0; u < 8; ++u) s[u] += a[d + u] * b[d + u];
  for (; d < D; ++d) s[0] += a[d] * b[d];
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

/* One tile of n keys/values (double rows of D) into the states of the heads in `qs`: libm exp2. */
static void tile_f64(const double* K, const double* V, int64_t n, int64_t D, const double* const* qs,
                     State<double>* st, int nh, double* scores) {
  for (int h = 0; h < nh; ++h) {
    double* s = scores + h * TILE;
    double mx = -INFINITY;
    for (int64_t i = 0; i < n; ++i) {
      s[i] = dot(qs[h], K + i * D, D);
      mx = max_or_nan(mx, s[i]);
    }
    State<double>& S = st[h];
    const double mnew = max_or_nan(S.m, mx);
    if (mnew == -INFINITY) continue;
    const double alpha = S.m == -INFINITY ? 0.0 : std::exp2(S.m - mnew);
    double sum = 0;
    for (int64_t i = 0; i < n; ++i) {
      s[i] = std::exp2(s[i] - mnew);
      sum += s[i];
    }
    S.l = S.l * alpha + sum;
    S.m = mnew;
    for (int64_t d = 0; d < D; ++d) S.acc[d] *= alpha;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t d = 0; d < D; ++d) S.acc[d] += s[i] * V[i * D + d];
  }
}

/*
 * float tiles with vectors of VB bytes (GCC vector extensions), compiled once per instruction set
 * (AVX-512, AVX2 + FMA, baseline) by the entry points below and chosen once per process. Scores
 * are base 2; 2^x by a degree-6 polynomial (relative error about 1e-7; x <= -127 gives 0, NaN
 * stays NaN), as the main CPU kernel computes it.
 */
template <int VB>
struct FV {
  enum { W = VB / 4 };
  typedef float v __attribute__((vector_size(VB)));
  typedef float vu __attribute__((vector_size(VB), aligned(4), may_alias));
  typedef uint32_t vi __attribute__((vector_size(VB)));
};

#define DEC_INLINE static inline __attribute__((always_inline))

template <int VB>
DEC_INLINE typename FV<VB>::v exp2v(typename FV<VB>::v x) {
  typedef typename FV<VB>::v v;
  typedef typename FV<VB>::vi vi;
  const v lo = v{} - 127.0f, hi = v{} + 127.0f, magic = v{} + 12582912.0f;  // 1.5 * 2^23
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const v t = x + magic;
  const v f = x - (t - magic);
  v p = v{} + 1.5353361959569156e-4f;
  p = p * f + 1.3398875016719103e-3f;
  p = p * f + 9.6184369176626205e-3f;
  p = p * f + 5.5503323674201965e-2f;
  p = p * f + 2.4022647738456726e-1f;
  p = p * f + 6.9314718246459961e-1f;
  p = p * f + 1.0f;
  return p * (v)(((vi)t - 0x4B400000u + 127u) << 23);
}

/* The sum of a vector's lanes, by halves (no lane-by-lane chain). */
template <int VB>
DEC_INLINE float hsum(typename FV<VB>::v x) {
  if constexpr (VB <= 16) {
    float s = 0;
    for (int u = 0; u < FV<VB>::W; ++u) s += x[u];
    return s;
  } else {
    typename FV<VB / 2>::v lo, hi;
    memcpy(&lo, &x, VB / 2);
    memcpy(&hi, (const char*)&x + VB / 2, VB / 2);
    return hsum<VB / 2>(lo + hi);
  }
}

template <int VB>
DEC_INLINE void tile_f32(const float* K, const float* V, int64_t n, int64_t D, const float* const* qs,
                         State<float>* st, int nh, float* scores) {
  typedef typename FV<VB>::v v;
  typedef typename FV<VB>::vu vu;
  const int W = FV<VB>::W;
  const int64_t Dv = D / W * W;
  // Scores: each key is loaded once for every head of the group.
  for (int64_t i = 0; i < n; ++i) {
    const float* k = K + i * D;
    for (int h = 0; h < nh; ++h) {
      const float* q = qs[h];
      v a0{}, a1{};
      int64_t d = 0;
      for (; d + 2 * W <= Dv; d += 2 * W) {
        a0 += *(const vu*)(q + d) * *(const vu*)(k + d);
        a1 += *(const vu*)(q + d + W) * *(const vu*)(k + d + W);
      }
      if (d < Dv) a0 += *(const vu*)(q + d) * *(const vu*)(k + d);
      float s = hsum<VB>(a0 + a1);
      for (d = Dv; d < D; ++d) s += q[d] * k[d];
      scores[h * TILE + i] = s;
    }
  }
  for (int h = 0; h < nh; ++h) {
    float* s = scores + h * TILE;
    float mx = -INFINITY;
    for (int64_t i = 0; i < n; ++i) mx = max_or_nan(mx, s[i]);
    State<float>& S = st[h];
    const float mnew = max_or_nan(S.m, mx);
    if (mnew == -INFINITY) {
      for (int64_t i = 0; i < n; ++i) s[i] = 0;
      continue;
    }
    const float alpha = S.m == -INFINITY ? 0.0f : std::exp2(S.m - mnew);
    v sum{};
    int64_t i = 0;
    for (; i + W <= n; i += W) {
      const v e = exp2v<VB>(*(const vu*)(s + i) - mnew);
      *(vu*)(s + i) = e;
      sum += e;
    }
    float tot = hsum<VB>(sum);
    for (; i < n; ++i) {
      s[i] = std::exp2(s[i] - mnew);
      tot += s[i];
    }
    S.l = S.l * alpha + tot;
    S.m = mnew;
    if (alpha != 1.0f)
      for (int64_t d = 0; d < D; ++d) S.acc[d] *= alpha;
  }
  // Outputs: each value row is loaded once for every head of the group.
  for (int64_t i = 0; i < n; ++i) {
    const float* vr = V + i * D;
    for (int h = 0; h < nh; ++h) {
      const float p = scores[h * TILE + i];
      float* acc = st[h].acc;
      int64_t d = 0;
      for (; d < Dv; d += W) *(vu*)(acc + d) += p * *(const vu*)(vr + d);
      for (; d < D; ++d) acc[d] += p * vr[d];
    }
  }
}

typedef void (*TileF32)(const float*, const float*, int64_t, int64_t, const float* const*, State<float>*, int,
                        float*);

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && !defined(DA_NO_ISA_DISPATCH)
__attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma"),
               noinline)) static void tile_f32_avx512(const float* K, const float* V, int64_t n, int64_t D,
                                                      const float* const* qs, State<float>* st, int nh,
                                                      float* scores) {
  tile_f32<64>(K, V, n, D, qs, st, nh, scores);
}
__attribute__((target("avx2,fma"), noinline)) static void tile_f32_avx2(const float* K, const float* V,
                                                                        int64_t n, int64_t D,
                                                                        const float* const* qs,
                                                                        State<float>* st, int nh,
                                                                        float* scores) {
  tile_f32<32>(K, V, n, D, qs, st, nh, scores);
}
#endif
static void tile_f32_base(const float* K, const float* V, int64_t n, int64_t D, const float* const* qs,
                          State<float>* st, int nh, float* scores) {
  tile_f32<16>(K, V, n, D, qs, st, nh, scores);
}

/* The widest float tile this CPU runs (DILATED_ATTENTION_CPU_ISA may name a narrower one). */
static TileF32 float_tile() {
  static const TileF32 chosen = [] {
    const char* env = getenv("DILATED_ATTENTION_CPU_ISA");
    const std::string want = env ? env : "auto";
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && !defined(DA_NO_ISA_DISPATCH)
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
    if (avx512 && (want == "auto" || want.empty() || want == "avx512")) return &tile_f32_avx512;
    if (avx2 && want != "baseline") return &tile_f32_avx2;
#endif
    (void)want;
    return &tile_f32_base;
  }();
  return chosen;
}

template <typename T>
static void tile(const T* K, const T* V, int64_t n, int64_t D, const T* const* qs, State<T>* st, int nh,
                 T* scores) {
  if constexpr (std::is_same_v<T, double>)
    tile_f64(K, V, n, D, qs, st, nh, scores);
  else
    float_tile()(K, V, n, D, qs, st, nh, scores);
}

template <typename scalar_t>
static void decode_kernel(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                          const at::Tensor& pos, const std::vector<int64_t>& segs,
                          const std::vector<int64_t>& rates, const std::vector<int64_t>& rows,
                          const std::vector<int64_t>& lengths, double scale, at::Tensor& out,
                          at::Tensor& lse) {
  using T = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = kc.size(1), Tn = kc.size(2);
  const int64_t G = Hq / Hkv;
  const int64_t* P = pos.data_ptr<int64_t>();
  std::vector<int64_t> offsets(segs.size());
  for (size_t i = 0, o = 0; i < segs.size(); ++i) {
    offsets[i] = (int64_t)o;
    o += rows[i] * lengths[i];
  }
  // The items: per (b, j, branch) the row read and its keys, in chunks.
  std::vector<Item> items;
  std::vector<int64_t> first(B * Hkv + 1, 0);
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b)
    if (P[b] >= 0)
      for (size_t i = 0; i < segs.size(); ++i) total += (P[b] % segs[i]) / rates[i] + 1;
  const int64_t threads = at::get_num_threads();
  int64_t chunk = total + 1;
  if (B * Hkv < threads && total > 0) {  // split-K: about two items per thread
    const int64_t per_bh = total * Hkv / std::max<int64_t>(1, B * Hkv);
    chunk = std::max<int64_t>(256, per_bh * B * Hkv / (2 * threads) + 1);
  }
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < Hkv; ++j) {
      first[b * Hkv + j] = (int64_t)items.size();
      if (P[b] < 0) continue;
      for (size_t i = 0; i < segs.size(); ++i) {
        const int64_t w = segs[i], r = rates[i], t = P[b] % w;
        const int64_t row = (((t % r) - j * G) % r + r) % r;
        if (row >= rows[i]) continue;  // no head of this group reads this phase
        const int64_t n = t / r + 1;
        for (int64_t s0 = 0; s0 < n; s0 += chunk)
          items.push_back({b, j, offsets[i] + row * lengths[i], s0, std::min(chunk, n - s0), r, t % r});
      }
    }
  first[B * Hkv] = (int64_t)items.size();
  const int64_t NI = (int64_t)items.size();
  // Per item and head of its group: m, l, acc[D].
  std::vector<T> part((size_t)std::max<int64_t>(1, NI * G * (D + 2)));
  const scalar_t* Kp = kc.data_ptr<scalar_t>();
  const scalar_t* Vp = vc.data_ptr<scalar_t>();
  const scalar_t* Qp = q.data_ptr<scalar_t>();
  const T qscale = (T)(scale * M_LOG2E);  // base-2 scores
  at::parallel_for(0, NI, 1, [&](int64_t lo, int64_t hi) {
    std::vector<T> qbuf(G * D), scores(G * TILE), kt, vt;
    if (!std::is_same_v<scalar_t, T>) {
      kt.resize(TILE * D);
      vt.resize(TILE * D);
    }
    std::vector<const T*> qs(G);
    std::vector<int> hs;
    hs.reserve(G);
    std::vector<State<T>> st(G);
    for (int64_t it = lo; it < hi; ++it) {
      const Item& I = items[it];
      int nh = 0;
      hs.clear();
      for (int64_t g = 0; g < G; ++g)
        if (I.reads(G, g)) {
          const scalar_t* qh = Qp + (I.b * Hq + I.j * G + g) * D;
          for (int64_t d = 0; d < D; ++d) qbuf[nh * D + d] = (T)qh[d] * qscale;
          qs[nh] = qbuf.data() + nh * D;
          T* base = part.data() + (it * G + g) * (D + 2);
          std::fill(base, base + D + 2, T(0));
          st[nh] = {-INFINITY, 0, base + 2};
          hs.push_back((int)g);
          ++nh;
        }
      const int64_t rowbase = ((I.b * Hkv + I.j) * Tn + I.row_offset + I.start) * D;
      for (int64_t s0 = 0; s0 < I.len; s0 += TILE) {
        const int64_t n = std::min<int64_t>(TILE, I.len - s0);
        const scalar_t* K = Kp + rowbase + s0 * D;
        const scalar_t* V = Vp + rowbase + s0 * D;
        if constexpr (std::is_same_v<scalar_t, T>) {
          tile<T>(K, V, n, D, qs.data(), st.data(), nh, scores.data());
        } else {
          for (int64_t e = 0; e < n * D; ++e) {
            kt[e] = (T)K[e];
            vt[e] = (T)V[e];
          }
          tile<T>(kt.data(), vt.data(), n, D, qs.data(), st.data(), nh, scores.data());
        }
      }
      for (int h = 0; h < nh; ++h) {
        T* base = part.data() + (it * G + hs[h]) * (D + 2);
        base[0] = st[h].m;
        base[1] = st[h].l;
      }
      for (int64_t g = 0; g < G; ++g)
        if (!I.reads(G, g)) part[(it * G + g) * (D + 2)] = -INFINITY;
    }
  });
  // Merge the items of every (b, j) per head.
  scalar_t* O = out.data_ptr<scalar_t>();
  T* L = lse.data_ptr<T>();
  at::parallel_for(0, B * Hkv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<T> acc(D);
    for (int64_t bj = lo; bj < hi; ++bj)
      for (int64_t g = 0; g < G; ++g) {
        T M = -INFINITY;
        for (int64_t it = first[bj]; it < first[bj + 1]; ++it)
          M = max_or_nan(M, part[(it * G + g) * (D + 2)]);
        const int64_t b = bj / Hkv, h = (bj % Hkv) * G + g;
        scalar_t* o = O + (b * Hq + h) * D;
        if (M == -INFINITY) {
          for (int64_t d = 0; d < D; ++d) o[d] = (scalar_t)0;
          L[b * Hq + h] = -INFINITY;
          continue;
        }
        std::fill(acc.begin(), acc.end(), T(0));
        T l = 0;
        for (int64_t it = first[bj]; it < first[bj + 1]; ++it) {
          const T* base = part.data() + (it * G + g) * (D + 2);
          if (base[0] == -INFINITY) continue;
          const T f = std::exp2(base[0] - M);
          l += base[1] * f;
          for (int64_t d = 0; d < D; ++d) acc[d] += base[2 + d] * f;
        }
        for (int64_t d = 0; d < D; ++d) o[d] = (scalar_t)(acc[d] / l);
        L[b * Hq + h] = (M + std::log2(l)) * (T)M_LN2;
      }
  });
}

/* Write the new token's key and value of every sequence into the rows of every branch. */
template <typename scalar_t>
static void write_kernel(const at::Tensor& k, const at::Tensor& v, at::Tensor& kc, at::Tensor& vc,
                         const at::Tensor& pos, const std::vector<int64_t>& segs,
                         const std::vector<int64_t>& rates, const std::vector<int64_t>& rows,
                         const std::vector<int64_t>& lengths, int64_t G) {
  const int64_t B = k.size(0), Hkv = k.size(1), D = k.size(2), Tn = kc.size(2);
  const int64_t* P = pos.data_ptr<int64_t>();
  const scalar_t* Ks = k.data_ptr<scalar_t>();
  const scalar_t* Vs = v.data_ptr<scalar_t>();
  scalar_t* Kd = kc.data_ptr<scalar_t>();
  scalar_t* Vd = vc.data_ptr<scalar_t>();
  for (int64_t b = 0; b < B; ++b) {
    if (P[b] < 0) continue;
    int64_t off = 0;
    for (size_t i = 0; i < segs.size(); ++i) {
      const int64_t w = segs[i], r = rates[i], t = P[b] % w;
      for (int64_t j = 0; j < Hkv; ++j) {
        const int64_t row = (((t % r) - j * G) % r + r) % r;
        if (row >= rows[i]) continue;
        const int64_t dst = ((b * Hkv + j) * Tn + off + row * lengths[i] + t / r) * D;
        const int64_t src = (b * Hkv + j) * D;
        std::copy(Ks + src, Ks + src + D, Kd + dst);
        std::copy(Vs + src, Vs + src + D, Vd + dst);
      }
      off += rows[i] * lengths[i];
    }
  }
}

}  // namespace

/* Checks shared by every device (see the schema in the TORCH_LIBRARY_FRAGMENT below). */
void check_decode_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kc,
                       const at::Tensor& vc, const at::Tensor& pos, at::IntArrayRef segs,
                       at::IntArrayRef rates, at::IntArrayRef lengths, double softmax_scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3,
              "decode_step: q (B, Hq, D), k and v (B, Hkv, D) must be 3-D, got q ", q.sizes(), ", k ",
              k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(kc.dim() == 4 && kc.sizes() == vc.sizes(),
              "decode_step: k_cache and v_cache must be (B, Hkv, T, D) of one shape, got ", kc.sizes(),
              " and ", vc.sizes());
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = kc.size(1);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(1) == Hkv && k.size(2) == D &&
                  kc.size(0) == B && kc.size(3) == D && Hkv > 0 && Hq % Hkv == 0,
              "decode_step: shapes must agree (q (B, Hq, D), k, v (B, Hkv, D), caches (B, Hkv, T, D), Hq a "
              "multiple of Hkv), got q ",
              q.sizes(), ", k ", k.sizes(), ", k_cache ", kc.sizes());
  check_dtype(q, "decode_step");
  TORCH_CHECK(D >= 1 && D <= DA_MAX_HEAD_DIM, "decode_step: head dim must be in [1, ", DA_MAX_HEAD_DIM,
              "], got ", D);
  check_scale(softmax_scale, q.scalar_type(), "decode_step");
  for (const at::Tensor* t : {&k, &v, &kc, &vc})
    TORCH_CHECK(t->scalar_type() == q.scalar_type() && t->device() == q.device(),
                "decode_step: every tensor must have q's dtype and device (", dtype_name(q.scalar_type()),
                ", ", q.device(), "), got ", dtype_name(t->scalar_type()), ", ", t->device());
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous(),
              "decode_step: k_cache and v_cache must be contiguous, got strides ", kc.strides(), " and ",
              vc.strides());
  TORCH_CHECK(pos.dim() == 1 && pos.size(0) == B && pos.scalar_type() == at::kLong,
              "decode_step: pos must be an int64 (B,) tensor, got ", dtype_name(pos.scalar_type()), " ",
              pos.sizes());
  TORCH_CHECK(pos.device() == q.device(), "decode_step: pos must be on q's device ", q.device(), ", got ",
              pos.device());
  TORCH_CHECK(
      segs.size() == rates.size() && segs.size() == lengths.size() && !segs.empty(),
      "decode_step: segment_lengths, dilation_rates and slot_lengths must have one entry per branch, got ",
      segs, ", ", rates, " and ", lengths);
  const int64_t G = Hq / Hkv;
  int64_t total = 0;
  for (size_t i = 0; i < segs.size(); ++i) {
    TORCH_CHECK(segs[i] >= 1 && rates[i] >= 1 && rates[i] <= segs[i] && lengths[i] >= 1 &&
                    lengths[i] <= (segs[i] + rates[i] - 1) / rates[i],
                "decode_step: branch ", i,
                " must have 1 <= r <= w and 1 <= slots <= ceil(w / r), got w=", segs[i], " r=", rates[i],
                " slots=", lengths[i]);
    total += std::min(G, rates[i]) * lengths[i];
  }
  TORCH_CHECK(kc.size(2) == total, "decode_step: the caches must have ", total,
              " slots for these branches, got ", kc.size(2));
}

std::tuple<at::Tensor, at::Tensor> decode_step_cpu(const at::Tensor& q_, const at::Tensor& k_,
                                                   const at::Tensor& v_, at::Tensor& k_cache,
                                                   at::Tensor& v_cache, const at::Tensor& pos_,
                                                   at::IntArrayRef segment_lengths,
                                                   at::IntArrayRef dilation_rates,
                                                   at::IntArrayRef slot_lengths, double softmax_scale) {
  check_decode_step(q_, k_, v_, k_cache, v_cache, pos_, segment_lengths, dilation_rates, slot_lengths,
                    softmax_scale);
  const at::Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous(), pos = pos_.contiguous();
  const std::vector<int64_t> segs(segment_lengths.begin(), segment_lengths.end());
  const std::vector<int64_t> rates(dilation_rates.begin(), dilation_rates.end());
  const std::vector<int64_t> lengths(slot_lengths.begin(), slot_lengths.end());
  const int64_t G = q.size(1) / k_cache.size(1);
  std::vector<int64_t> rows(segs.size());
  for (size_t i = 0; i < segs.size(); ++i) rows[i] = std::min(G, rates[i]);
  const int64_t* P = pos.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b)
    for (size_t i = 0; i < segs.size(); ++i)
      TORCH_CHECK(P[b] < 0 || (P[b] % segs[i]) / rates[i] < lengths[i], "decode_step: position ", P[b],
                  " of sequence ", b, " is beyond the cache's slots (", lengths[i], " for branch w=", segs[i],
                  ", r=", rates[i], ")");
  const auto acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(acc));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "decode_step_cpu", [&] {
    write_kernel<scalar_t>(k, v, k_cache, v_cache, pos, segs, rates, rows, lengths, G);
    decode_kernel<scalar_t>(q, k_cache, v_cache, pos, segs, rates, rows, lengths, softmax_scale, out, lse);
  });
  return {out, lse};
}

TORCH_LIBRARY_FRAGMENT(dilated_attention, m) {
  m.def(
      "decode_step(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor pos, "
      "int[] segment_lengths, int[] dilation_rates, int[] slot_lengths, float softmax_scale) "
      "-> (Tensor out, Tensor lse)");
}

TORCH_LIBRARY_IMPL(dilated_attention, CPU, m) {
  m.impl("decode_step", &decode_step_cpu);
}

}  // namespace dilated_attention

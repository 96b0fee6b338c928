// CUDA kernels of dilated_attention::decode_step (see csrc/cpu/decode_cpu.cpp for the slot layout of
// the bounded cache). Three launches on the stream:
//   decode_write_kernel   (B blocks): the new token's key and value into its slot of every branch;
//   decode_partial_kernel (B * Hkv, branches * G, S blocks of one warp): query head j*G + g over the
//                         keys of split s of the one row it reads in branch i (slots 0 .. t / r),
//                         read in place; lanes hold the head dimension (D <= 256: 8 values each),
//                         scores reduced across the warp, online softmax; writes (m, l, acc[D]);
//   decode_merge_kernel   (B * Hq blocks of one warp): the partial results of a head merged by
//                         their log-sum-exp into out and lse.
// Splitting the rows (S > 1) is FlashDecoding's split-K, for when B * Hkv is small. Accumulation in
// float (double for double). Compiled for the CPU emulation of the tests as well
// (tests/cuda_emulation/run_decode.cpp). The launches are in decode_launch.cu, the host side in
// decode_cuda.cpp.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <stdint.h>

#include <cmath>

#include "../dilated_attention.h"
#include "common.cuh"
#include "decode_params.h"

namespace dilated_attention {
namespace cuda {

// The larger of a and b, NaN where either is: a NaN score makes its row NaN (as in every other path),
// where a plain comparison would skip keys or partial results whose scores are all NaN (a NaN query)
// as empty and give out 0, lse -inf. As max_or_nan of csrc/cpu/decode_cpu.cpp.
template <typename T>
__host__ __device__ __forceinline__ T decode_max_or_nan(T a, T b) {
  return (a != a || a > b) ? a : b;
}

template <typename scalar_t>
__global__ void decode_write_kernel(DecodeParams p) {
  const int64_t b = blockIdx.x;
  const int64_t x = p.pos[b];
  if (x < 0) return;
  const scalar_t* k = static_cast<const scalar_t*>(p.k);
  const scalar_t* v = static_cast<const scalar_t*>(p.v);
  scalar_t* kc = static_cast<scalar_t*>(p.kc);
  scalar_t* vc = static_cast<scalar_t*>(p.vc);
  const int64_t n = p.nbr * p.Hkv * p.D;
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) {
    const int64_t i = e / (p.Hkv * p.D), j = (e / p.D) % p.Hkv, d = e % p.D;
    const int64_t r = p.r[i], t = x % p.w[i];
    const int64_t row = (((t % r) - j * p.G) % r + r) % r;
    if (row >= p.rows[i]) continue;
    const int64_t dst = ((b * p.Hkv + j) * p.T + p.off[i] + row * p.len[i] + t / r) * p.D + d;
    const int64_t src = (b * p.Hkv + j) * p.D + d;
    kc[dst] = k[src];
    vc[dst] = v[src];
  }
}

template <typename scalar_t, typename acc_t>
__device__ void decode_partial_one(const DecodeParams& p, int64_t ig) {
  constexpr int NU = kDecodeMaxD / kDecodeLanes;
  const int64_t bj = blockIdx.x, b = bj / p.Hkv, j = bj % p.Hkv;
  const int64_t i = ig / p.G, g = ig % p.G, s = blockIdx.z;
  const int lane = (int)threadIdx.x;
  acc_t* res = static_cast<acc_t*>(p.part) + ((bj * p.nbr * p.G + ig) * p.S + s) * (p.D + 2);
  const int64_t x = p.pos[b];
  const int64_t r = p.r[i];
  const int64_t t = x >= 0 ? x % p.w[i] : 0;
  acc_t m = -INFINITY, l = 0, acc[NU];
  for (int u = 0; u < NU; ++u) acc[u] = 0;
  if (x >= 0 && (j * p.G + g) % r == t % r) {  // head j*G + g covers the position in branch i
    const int64_t n = t / r + 1, per = (n + p.S - 1) / p.S;
    const int64_t k0 = s * per, k1 = k0 + per < n ? k0 + per : n;
    const int64_t base = ((b * p.Hkv + j) * p.T + p.off[i] + (g % r) * p.len[i]) * p.D;
    const scalar_t* q = static_cast<const scalar_t*>(p.q) + (b * p.Hq + j * p.G + g) * p.D;
    const scalar_t* kc = static_cast<const scalar_t*>(p.kc) + base;
    const scalar_t* vc = static_cast<const scalar_t*>(p.vc) + base;
    acc_t qv[NU];
    for (int u = 0; u < NU; ++u) {
      const int64_t d = lane + u * kDecodeLanes;
      qv[u] = d < p.D ? static_cast<acc_t>(q[d]) * (acc_t)p.scale : (acc_t)0;
    }
    for (int64_t key = k0; key < k1; ++key) {
      acc_t sc = 0;
      for (int u = 0; u < NU; ++u) {
        const int64_t d = lane + u * kDecodeLanes;
        if (d < p.D) sc += qv[u] * static_cast<acc_t>(kc[key * p.D + d]);
      }
      for (int o = kDecodeLanes / 2; o > 0; o /= 2) sc += __shfl_xor_sync(DA_FULL_MASK, sc, o);
      const acc_t mn = decode_max_or_nan(m, sc);
      const acc_t alpha = m == -INFINITY ? (acc_t)0 : (acc_t)exp(m - mn);
      const acc_t pr = (acc_t)exp(sc - mn);
      l = l * alpha + pr;
      for (int u = 0; u < NU; ++u) {
        const int64_t d = lane + u * kDecodeLanes;
        if (d < p.D) acc[u] = acc[u] * alpha + pr * static_cast<acc_t>(vc[key * p.D + d]);
      }
      m = mn;
    }
  }
  if (lane == 0) {
    res[0] = m;
    res[1] = l;
  }
  for (int u = 0; u < NU; ++u) {
    const int64_t d = lane + u * kDecodeLanes;
    if (d < p.D) res[2 + d] = acc[u];
  }
}

// Query head j*G + g (ig = i * G + g: branch i) over split s of the keys its row holds in branch
// i: (m, l, acc[D]) into part. The (branch, head) pairs run in blockIdx.y steps of gridDim.y (at
// most 65535 blocks along y; any number of query heads per kv head).
template <typename scalar_t, typename acc_t>
__global__ void decode_partial_kernel(DecodeParams p) {
  for (int64_t ig = blockIdx.y; ig < p.nbr * p.G; ig += gridDim.y) decode_partial_one<scalar_t, acc_t>(p, ig);
}

template <typename scalar_t, typename acc_t>
__global__ void decode_merge_kernel(DecodeParams p) {
  constexpr int NU = kDecodeMaxD / kDecodeLanes;
  const int64_t bh = blockIdx.x, b = bh / p.Hq, h = bh % p.Hq, j = h / p.G, g = h % p.G;
  const int lane = (int)threadIdx.x;
  const acc_t* part = static_cast<const acc_t*>(p.part);
  const int64_t stride = p.D + 2;
  auto at = [&](int64_t i, int64_t s) {
    return part + (((b * p.Hkv + j) * p.nbr * p.G + i * p.G + g) * p.S + s) * stride;
  };
  acc_t M = -INFINITY;
  for (int64_t i = 0; i < p.nbr; ++i)
    for (int64_t s = 0; s < p.S; ++s) M = decode_max_or_nan(M, at(i, s)[0]);
  scalar_t* out = static_cast<scalar_t*>(p.out) + bh * p.D;
  acc_t* lse = static_cast<acc_t*>(p.lse);
  if (M == -INFINITY) {
    for (int64_t d = lane; d < p.D; d += kDecodeLanes) out[d] = scalar_t(0);
    if (lane == 0) lse[bh] = -INFINITY;
    return;
  }
  acc_t l = 0, acc[NU];
  for (int u = 0; u < NU; ++u) acc[u] = 0;
  for (int64_t i = 0; i < p.nbr; ++i)
    for (int64_t s = 0; s < p.S; ++s) {
      const acc_t* e = at(i, s);
      if (e[0] == -INFINITY) continue;
      const acc_t f = (acc_t)exp(e[0] - M);
      l += e[1] * f;
      for (int u = 0; u < NU; ++u) {
        const int64_t d = lane + u * kDecodeLanes;
        if (d < p.D) acc[u] += e[2 + d] * f;
      }
    }
  for (int u = 0; u < NU; ++u) {
    const int64_t d = lane + u * kDecodeLanes;
    if (d < p.D) out[d] = scalar_t(acc[u] / l);
  }
  if (lane == 0) lse[bh] = M + (acc_t)log(l);
}

}  // namespace cuda
}  // namespace dilated_attention

// The tensor maps of the sm90 kernels' tensor-copy (TMA) loads: one per (tensor, dilation rate),
// describing the rows of a dilated sub-sequence as one dimension of a strided box. Host code
// (tc90_dispatch.cu encodes them with the driver's cuTensorMapEncodeTiled), read by the kernels
// (tc90_kernels.cuh) and by the CPU emulation (which stores the same description in the map).
//
// A (B, rows, H, D) tensor t with strides (sb, sn, sh, 1) seen with rate r as five dimensions,
// innermost first: d (D), h (H, stride sh), p (r, stride sn), j (J = rows / r rounded down, stride
// r sn), b (B, stride sb); element (d, h, p, j, b) is t[b][j r + p][h][d]. The rows of a chunk of a
// dilated sub-sequence, positions x0 + i r, are the box (PW, 1, 1, KT, 1) at (d0, h, x0 mod r,
// x0 / r, b): PW columns (one panel of the Sw90 layout, swizzled as the MMAs read it) of KT rows.
// Positions from J r on cannot be reached (that would read past the tensor's end in its last batch
// entry): a chunk that needs one is loaded with cp.async instead (tma_chunk_ok).
#pragma once

#include <stdint.h>

#include "launch.h"

namespace dilated_attention {
namespace cuda {

constexpr int kTmaMaxRates = 10;  // distinct dilation rates with maps (LongNet at 1M: 10); others by cp.async

// A tensor map's description (what cuTensorMapEncodeTiled takes; the emulation stores it).
struct TmaBox {
  const void* base;
  uint64_t dims[5];
  uint64_t strides[4];  // bytes, dims 1..4
  uint32_t box[5];
  int swizzle_bytes;  // 128 or 64: the panel's row
};

// The maps of one kernel launch: map[t][i] for tensor t (0, 1: k and v, or q and dout) and the
// rate rate[i], whose j dimension has J[i] rows.
struct TmaMaps {
  alignas(64) unsigned char map[2][kTmaMaxRates][128];  // CUtensorMap: 128 bytes, 64-byte aligned
  int64_t rate[kTmaMaxRates];
  int64_t J[kTmaMaxRates];
  int count;
};

// The description of tensor t ((B, rows, H, D), 2-byte elements) for rate r and boxes of PW
// columns and box_rows rows; false where it has none (fewer rows than r, a stride TMA cannot take).
inline bool tma_box(const Tensor4& t, int64_t B, int64_t rows, int64_t H, int64_t D, int64_t r, int PW,
                    int box_rows, TmaBox* out) {
  const int64_t J = rows / r;
  if (J < 1 || r < 1 || (reinterpret_cast<uintptr_t>(t.data) & 15)) return false;
  // A dimension of one index may have any stride in the tensor: give it a valid one.
  const int64_t sh = H > 1 ? t.sh : 8, sn = t.sn, sb = B > 1 ? t.sb : 8;
  const int64_t s[4] = {2 * sh, 2 * sn, 2 * r * sn, 2 * sb};
  for (int64_t v : s)
    if (v <= 0 || v % 16 || v >= (int64_t(1) << 40)) return false;
  out->base = t.data;
  const int64_t dims[5] = {D, H, r, J, B};
  for (int i = 0; i < 5; ++i) {
    if (dims[i] < 1 || dims[i] > (int64_t(1) << 32)) return false;
    out->dims[i] = (uint64_t)dims[i];
  }
  for (int i = 0; i < 4; ++i) out->strides[i] = (uint64_t)s[i];
  out->box[0] = (uint32_t)PW;
  out->box[1] = out->box[2] = out->box[4] = 1;
  out->box[3] = (uint32_t)box_rows;
  out->swizzle_bytes = PW * 2;
  return true;
}

// The maps of tensors a and b ((B, rows, H, D)) for every distinct rate of the branches (at most
// kTmaMaxRates), encoded by encode(const TmaBox&, void* map) -> bool; a rate whose maps cannot be
// made is left out (its chunks load with cp.async).
template <typename Encode>
inline void tma_make_maps(TmaMaps* m, const da_branches& br, const Tensor4& a, const Tensor4& b, int64_t B,
                          int64_t rows, int64_t H, int64_t D, int PW, int box_rows, Encode encode) {
  m->count = 0;
  for (int64_t i = 0; i < br.n && m->count < kTmaMaxRates; ++i) {
    const int64_t r = br.r[i];
    bool seen = false;
    for (int k = 0; k < m->count; ++k) seen = seen || m->rate[k] == r;
    if (seen) continue;
    TmaBox ba, bb;
    if (!tma_box(a, B, rows, H, D, r, PW, box_rows, &ba) || !tma_box(b, B, rows, H, D, r, PW, box_rows, &bb))
      continue;
    if (!encode(ba, m->map[0][m->count]) || !encode(bb, m->map[1][m->count])) continue;
    m->rate[m->count] = r;
    m->J[m->count] = (int64_t)ba.dims[3];
    m->count++;
  }
}

}  // namespace cuda
}  // namespace dilated_attention

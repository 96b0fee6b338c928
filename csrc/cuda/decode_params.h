// What the host side of dilated_attention::decode_step (decode_cuda.cpp) passes to its kernels
// (decode.cuh): a plain struct, passed by value. No CUDA or torch headers, so that the host code,
// the kernels and their CPU emulation (tests/cuda_emulation/run_decode.cpp) share it.
#pragma once

#include <stdint.h>

#include "../dilated_attention.h"

namespace dilated_attention {
namespace cuda {

enum { kDecodeMaxD = 256, kDecodeLanes = 32 };

struct DecodeParams {
  const void* q;  // (B, Hq, D)
  const void* k;  // (B, Hkv, D)
  const void* v;
  void* kc;  // (B, Hkv, T, D)
  void* vc;
  const int64_t* pos;  // (B,)
  void* part;          // (B * Hkv, nbr * G, S, D + 2) of acc_t
  void* out;           // (B, Hq, D)
  void* lse;           // (B, Hq) of acc_t
  int64_t B, Hq, Hkv, D, T, G, nbr, S;
  int64_t w[DA_MAX_BRANCHES], r[DA_MAX_BRANCHES], rows[DA_MAX_BRANCHES], len[DA_MAX_BRANCHES],
      off[DA_MAX_BRANCHES];
  double scale;
};

}  // namespace cuda
}  // namespace dilated_attention

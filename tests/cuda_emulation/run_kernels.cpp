// Runs the CUDA kernels of csrc/cuda on the CPU through cuda_emulation.h, for tests without a GPU
// (tests/test_cuda.py loads it with ctypes). It mirrors what dilated_attention_cuda.cpp does on the
// host (tiling, the delta pass, the dq and dk/dv passes) for contiguous (B, N, H, D) tensors (or,
// after da_emu_varlen, packed sequences of (1, T, H, D) tensors; after da_emu_piece, a piece of
// N queries over nk keys: k, v, dk, dv of (B, nk, Hkv, D)), with attention dropout after
// da_emu_dropout, and
// guards every buffer: outputs start as NaN bytes and every buffer is fenced by canary bytes that
// must survive the run. Build:
//   c++ -std=c++17 -O1 -shared -fPIC -DDA_CUDA_EMULATION -I<csrc> -I<tests/cuda_emulation> -I<cuda include> -I<torch include>
//       tests/cuda_emulation/run_kernels.cpp -o run_kernels.so
#ifndef DA_CUDA_EMULATION
#error "build with -DDA_CUDA_EMULATION"
#endif

#include <stdio.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "cuda/simt.cu"
#include "cuda/tc90_kernels.cuh"
#include "cuda/tc_kernels.cuh"

namespace dilated_attention {
namespace cuda {
namespace {

constexpr size_t kFence = 4096;
constexpr unsigned char kCanary = 0xA5;

// A copy of a buffer between two fences of canary bytes.
struct Guarded {
  std::vector<unsigned char> mem;
  size_t bytes;
  Guarded(const void* src, size_t n, bool output) : mem(n + 2 * kFence, kCanary), bytes(n) {
    if (output)
      memset(data(), 0xff, n);
    else if (n)
      memcpy(data(), src, n);
  }
  unsigned char* data() { return mem.data() + kFence; }
  bool fences_intact() const {
    for (size_t i = 0; i < kFence; ++i)
      if (mem[i] != kCanary || mem[kFence + bytes + i] != kCanary) return false;
    return true;
  }
};

Tensor4 contiguous4(void* data, int64_t N, int64_t H, int64_t D) {
  return Tensor4{data, N * H * D, H * D, D};
}

template <typename Kernel>
void run_grid(Kernel kernel, dim3 grid, size_t smem, const Params& p, int threads = 128) {
  if (smem > da_emu::kSharedBytes - da_emu::kDynamicOffset)
    da_emu::fail("kernel needs more shared memory than sm90 has");
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x)
        da_emu::run_block(grid, dim3(x, y, z), threads, [&] { kernel(p); }, smem);
}

// Whether the sm90 kernels get tensor maps (da_emu_tma): with them every chunk that a map reaches
// loads by the tensor copy engine, without them every chunk loads by cp.async.
bool& tma_on() {
  static bool on = true;
  return on;
}

// The emulation's encoding of a tensor map (cuda_emulation.h TmaDesc).
bool emu_encode(const TmaBox& b, void* map) {
  da_emu::TmaDesc d;
  d.base = b.base;
  for (int i = 0; i < 5; ++i) {
    d.dims[i] = b.dims[i];
    d.box[i] = b.box[i];
  }
  for (int i = 0; i < 4; ++i) d.strides[i] = b.strides[i];
  d.swizzle_bytes = b.swizzle_bytes;
  memcpy(map, &d, sizeof(d));
  return true;
}

// An sm90 kernel of pass `pass` with its tensor maps (tc90_maps, as the host makes them).
template <typename L, typename Kernel>
void run_grid90(Kernel kernel, int pass, int box_rows, dim3 grid, size_t smem, const Params& p) {
  static_assert(sizeof(da_emu::TmaDesc) <= 128, "a tensor map holds the emulation's description");
  TmaMaps maps;
  maps.count = 0;
  if (tma_on()) tc90_maps<L>(&maps, pass, p, box_rows, emu_encode);
  run_grid([&](const Params& q) { kernel(q, maps); }, grid, smem, p, kTc90Threads);
}

struct Problem4 {
  int dtype;   // 0 float16, 1 bfloat16, 2 float32, 3 float64
  int family;  // 0 tensor cores (sm80), 1 SIMT, 2 tensor cores (sm90: wgmma)
  int64_t B, N, Hq, Hkv, D;
  da_branches br;
  int causal;
  double scale;
  int64_t R, interleaved, rows_per_warp, other_tile;
};

// Packed sequences for the next calls (da_emu_varlen): cu_seqlens (S + 1 values), or none.
struct Packed {
  std::vector<int32_t> cu;
};
Packed& packed() {
  static Packed p;
  return p;
}

// A piece for the next calls (da_emu_piece): N queries over nk keys (tiling.h), or nk = 0.
da_piece& piece() {
  static da_piece pc = {0, 0, 0};
  return pc;
}

// Whether the next calls' lse is float64 whatever the dtype (the op's float64_lse; da_emu_lse64).
bool& lse64() {
  static bool on = false;
  return on;
}

// Attention dropout of the next calls (da_emu_dropout); threshold 0: none.
da_dropout& dropout() {
  static da_dropout d = da_dropout_make(0.0, 0, 0);
  return d;
}

// Rows of keys: N, or a piece's nk.
int64_t key_rows(int64_t N) {
  return piece().nk > 0 ? piece().nk : N;
}

size_t elem_size(int dtype) {
  return dtype == 0 || dtype == 1 ? 2 : dtype == 2 ? 4 : 8;
}

int setup(const Problem4& P, Params* p, char* err, int errlen) {
  memset(p, 0, sizeof(*p));
  p->B = P.B;
  p->N = P.N;
  p->Hq = P.Hq;
  p->Hkv = P.Hkv;
  p->D = P.D;
  p->G = P.Hq / P.Hkv;
  p->br = P.br;
  p->is_causal = P.causal;
  p->scale = P.scale;
  p->num_seqs = P.B;
  p->drop = dropout();
  int64_t tile_rows = P.N;  // the longest sequence
  if (piece().nk > 0) {     // as the host launches a piece: one branch, R = 1 unless forced
    if (!packed().cu.empty() || p->drop.threshold != 0) {
      snprintf(err, errlen, "a piece takes no packed sequences and no dropout");
      return 1;
    }
    const int64_t nk = piece().nk, offset = da_min64(da_max64(piece().offset, -P.N), nk);  // as checks.h
    p->piece = da_piece{P.N, nk, offset};
    p->br.n = 1;
    p->br.w[0] = da_max64(P.N, piece().nk);
    p->br.r[0] = 1;
  }
  const std::vector<int32_t>& cu = packed().cu;
  if (!cu.empty()) {
    if (P.B != 1 || cu.front() != 0 || cu.back() != P.N) {
      snprintf(err, errlen, "packed sequences need B = 1 and cu_seqlens from 0 to N");
      return 1;
    }
    p->cu_seqlens = cu.data();
    p->num_seqs = (int64_t)cu.size() - 1;
    tile_rows = 0;
    for (size_t i = 0; i + 1 < cu.size(); ++i) tile_rows = std::max<int64_t>(tile_rows, cu[i + 1] - cu[i]);
  }
  const int64_t rpw = P.family != 1 ? 16 : P.rows_per_warp;
  const int64_t warps = P.family == 2 ? kTc90Warps : 4;  // the sm90 blocks own 8 warps of rows
  if (P.family != 1 && (P.dtype > 1 || P.D < 32 || P.D > 256 || P.D % 8)) {
    snprintf(err, errlen, "the tensor-core kernels take float16/bfloat16 and D in 32..256, D %% 8 == 0");
    return 1;
  }
  if (P.family == 1 && (rpw < 1 || rpw > 4 || P.other_tile < 1 || P.other_tile > 32)) {
    snprintf(err, errlen, "SIMT: rows_per_warp in 1..4 and other_tile in 1..32");
    return 1;
  }
  if (piece().nk > 0)
    p->tiling = da_make_tiling(tile_rows, P.R > 0 ? P.R : 1, P.R > 0 ? P.interleaved : 0, warps, rpw);
  else
    p->tiling = P.R > 0 ? da_make_tiling(tile_rows, P.R, P.interleaved, warps, rpw)
                        : da_choose_tiling(tile_rows, &P.br, P.causal, warps, rpw);
  p->other_tile = (int)P.other_tile;
  return 0;
}

// The params of the dk/dv pass: a piece's rows there are its nk keys.
Params key_params(const Params& p) {
  Params k = p;
  if (p.piece.nk > 0) {
    const da_tiling& t = p.tiling;
    k.tiling = da_make_tiling(p.piece.nk, t.R, t.interleaved, t.warps, t.rows_per_warp);
  }
  return k;
}

// The sm80 forward, or the sm90 (wgmma) one where sm90.
template <typename T, int DP, bool DROP>
void tc_forward_dp(const Params& p, bool sm90) {
  const dim3 grid((unsigned)da_num_tiles(&p.tiling), (unsigned)p.Hq, (unsigned)p.num_seqs);
  if (sm90)
    run_grid90<Sw90<DP>>(tc90_fwd_kernel<T, DP, DROP>, kFwd, Tc90FwdCfg<DP>::KT, grid, Tc90FwdCfg<DP>::SMEM,
                         p);
  else
    run_grid(tc_fwd_kernel<T, DP, DROP>, grid, TcFwdCfg<DP>::SMEM, p);
}

template <typename T, bool DROP>
void tc_forward_with(const Params& p, bool sm90) {
  switch (tc_padded_dim(p.D)) {
    case 32: tc_forward_dp<T, 32, DROP>(p, sm90); break;
    case 64: tc_forward_dp<T, 64, DROP>(p, sm90); break;
    case 96: tc_forward_dp<T, 96, DROP>(p, sm90); break;
    case 128: tc_forward_dp<T, 128, DROP>(p, sm90); break;
    case 192: tc_forward_dp<T, 192, DROP>(p, sm90); break;
    default: tc_forward_dp<T, 256, DROP>(p, sm90); break;
  }
}

// The instantiation with or without dropout, as the host launches it (tc_dropout).
template <typename T>
void tc_forward(const Params& p, bool sm90) {
  if (tc_dropout(p))
    tc_forward_with<T, true>(p, sm90);
  else
    tc_forward_with<T, false>(p, sm90);
}

// The sm80 backward passes, or the sm90 (wgmma) ones where sm90.
template <typename T, int DP, bool DROP>
void tc_backward_dp(const Params& p, bool sm90) {
  const dim3 grid((unsigned)da_num_tiles(&p.tiling), (unsigned)p.Hq, (unsigned)p.num_seqs);
  const Params pk = key_params(p);
  const dim3 grid_kv((unsigned)da_num_tiles(&pk.tiling), (unsigned)(p.Hkv * TcDkvCfg<DP>::CHUNKS),
                     (unsigned)p.num_seqs);
  if (sm90) {
    using C = Tc90DkvCfg<DP>;
    run_grid90<Sw90<DP>>(tc90_dq_kernel<T, DP, DROP>, kDq, Tc90DqCfg<DP>::KT, grid, Tc90DqCfg<DP>::SMEM, p);
    run_grid90<Sw90<DP, C::PW>>(tc90_dkv_kernel<T, DP, DROP>, kDkv, C::QT, grid_kv, C::SMEM, pk);
  } else {
    run_grid(tc_dq_kernel<T, DP, DROP>, grid, TcDqCfg<DP>::SMEM, p);
    run_grid(tc_dkv_kernel<T, DP, DROP>, grid_kv, TcDkvCfg<DP>::SMEM, pk);
  }
}

template <typename T, bool DROP>
void tc_backward_with(const Params& p, bool sm90) {
  switch (tc_padded_dim(p.D)) {
    case 32: tc_backward_dp<T, 32, DROP>(p, sm90); break;
    case 64: tc_backward_dp<T, 64, DROP>(p, sm90); break;
    case 96: tc_backward_dp<T, 96, DROP>(p, sm90); break;
    case 128: tc_backward_dp<T, 128, DROP>(p, sm90); break;
    case 192: tc_backward_dp<T, 192, DROP>(p, sm90); break;
    default: tc_backward_dp<T, 256, DROP>(p, sm90); break;
  }
}

template <typename T>
void tc_backward(const Params& p, bool sm90) {
  if (tc_dropout(p))
    tc_backward_with<T, true>(p, sm90);
  else
    tc_backward_with<T, false>(p, sm90);
}

template <typename scalar_t, typename acc_t>
void simt_forward(const Params& p) {
  const size_t smem = simt_smem_elems<acc_t>(p.D, p.tiling.rows_per_warp, p.other_tile, kFwd) * sizeof(acc_t);
  run_grid(simt_fwd_kernel<scalar_t, acc_t>,
           dim3((unsigned)da_num_tiles(&p.tiling), (unsigned)p.Hq, (unsigned)p.num_seqs), smem, p);
}

template <typename scalar_t, typename acc_t>
void simt_backward(const Params& p) {
  const size_t s_dq = simt_smem_elems<acc_t>(p.D, p.tiling.rows_per_warp, p.other_tile, kDq) * sizeof(acc_t);
  const size_t s_kv = simt_smem_elems<acc_t>(p.D, p.tiling.rows_per_warp, p.other_tile, kDkv) * sizeof(acc_t);
  run_grid(simt_dq_kernel<scalar_t, acc_t>,
           dim3((unsigned)da_num_tiles(&p.tiling), (unsigned)p.Hq, (unsigned)p.num_seqs), s_dq, p);
  const Params pk = key_params(p);
  run_grid(simt_dkv_kernel<scalar_t, acc_t>,
           dim3((unsigned)da_num_tiles(&pk.tiling), (unsigned)p.Hkv, (unsigned)p.num_seqs), s_kv, pk);
}

template <typename scalar_t, typename acc_t>
void delta_pass(const Params& p) {
  const int64_t rows = p.B * p.N * p.Hq;
  run_grid(delta_kernel_impl<scalar_t, acc_t>, dim3((unsigned)da_ceil_div(rows, 4), 1, 1), 0, p);
}

Problem4 problem(int dtype, int family, int64_t B, int64_t N, int64_t Hq, int64_t Hkv, int64_t D, int64_t nb,
                 const int64_t* w, const int64_t* r, int causal, double scale, int64_t R, int64_t interleaved,
                 int64_t rows_per_warp, int64_t other_tile) {
  Problem4 P;
  P.dtype = dtype;
  P.family = family;
  P.B = B;
  P.N = N;
  P.Hq = Hq;
  P.Hkv = Hkv;
  P.D = D;
  P.br.n = nb;
  for (int64_t i = 0; i < nb; ++i) {
    P.br.w[i] = w[i];
    P.br.r[i] = r[i];
  }
  P.causal = causal;
  P.scale = scale;
  P.R = R;
  P.interleaved = interleaved;
  P.rows_per_warp = rows_per_warp;
  P.other_tile = other_tile;
  return P;
}

}  // namespace
}  // namespace cuda
}  // namespace dilated_attention

using namespace dilated_attention::cuda;

// Scheduling of the emulation (cuda_emulation.h): order 0 by thread, 1 reversed, 2 shuffled with
// `seed`; eager: cp.async copies land when issued instead of at wait_group.
extern "C" void da_emu_options(int order, unsigned seed, int eager) {
  da_emu::options().order = order;
  da_emu::options().seed = seed;
  da_emu::options().eager_copies = eager != 0;
}

// The SIMT kernels' float scores for the calls that follow: summed in double (0, as on A100/H100)
// or in compensated float (1, as on GPUs with slow double arithmetic); simt.cu simt_score.
extern "C" void da_emu_scores(int compensated) {
  da_emu::options().compensated_scores = compensated != 0;
}

// Packed sequences for the calls that follow: cu_seqlens[0..S] (0 .. N, non-decreasing), which the
// calls then take with B = 1; S < 0 returns to fixed-length batches.
extern "C" void da_emu_varlen(const int32_t* cu_seqlens, int64_t S) {
  packed().cu.assign(cu_seqlens, cu_seqlens + (S < 0 ? 0 : S + 1));
}

// A piece of N queries over nk keys with a causal offset for the calls that follow (their
// branches are then ignored); nk = 0 returns to the op.
extern "C" void da_emu_piece(int64_t nk, int64_t offset) {
  piece() = da_piece{0, nk < 0 ? 0 : nk, offset};
}

// Attention dropout with probability p (0 <= p < 1; 0: none), seed and offset for the calls that
// follow, forward and backward (the op's dropout_p, dropout_seed, dropout_offset).
extern "C" void da_emu_dropout(double p, int64_t seed, int64_t offset) {
  dropout() = da_dropout_make(p, (uint64_t)seed, (uint64_t)offset);
}

// Tensor maps for the sm90 kernels of the calls that follow (on != 0, the default) or none (every
// chunk by cp.async).
extern "C" void da_emu_tma(int on) {
  tma_on() = on != 0;
}

// The chunks that the sm90 kernels' consumer warpgroups skipped and computed since the last call,
// counted once per warpgroup: out[2 pass + 0] skipped, out[2 pass + 1] computed, pass kFwd, kDq,
// kDkv; the counts restart from zero.
extern "C" void da_emu_tc90_chunks(long long* out) {
  for (int pass = 0; pass < 3; ++pass)
    for (int k = 0; k < 2; ++k) {
      out[2 * pass + k] = tc90_emu_chunks()[pass][k];
      tc90_emu_chunks()[pass][k] = 0;
    }
}

// lse in float64 (on != 0) or in the accumulation dtype for the calls that follow; dlse and delta
// stay in the accumulation dtype.
extern "C" void da_emu_lse64(int on) {
  lse64() = on != 0;
}

// Forward: out (B, N, Hq, D) and lse (B, Hq, N) from contiguous q, k, v. Returns 0 or 1 (err set).
extern "C" int da_emu_forward(int dtype, int family, int64_t B, int64_t N, int64_t Hq, int64_t Hkv, int64_t D,
                              int64_t nb, const int64_t* w, const int64_t* r, int causal, double scale,
                              int64_t R, int64_t interleaved, int64_t rows_per_warp, int64_t other_tile,
                              const void* q, const void* k, const void* v, void* out, void* lse, char* err,
                              int errlen) {
  const Problem4 P = problem(dtype, family, B, N, Hq, Hkv, D, nb, w, r, causal, scale, R, interleaved,
                             rows_per_warp, other_tile);
  Params p;
  if (setup(P, &p, err, errlen)) return 1;
  const size_t es = elem_size(dtype), ls = dtype == 3 || lse64() ? 8 : 4;
  const int64_t Nk = key_rows(N);
  Guarded gq(q, B * N * Hq * D * es, false), gk(k, B * Nk * Hkv * D * es, false),
      gv(v, B * Nk * Hkv * D * es, false);
  Guarded go(nullptr, B * N * Hq * D * es, true), gl(nullptr, B * Hq * N * ls, true);
  p.q = contiguous4(gq.data(), N, Hq, D);
  p.k = contiguous4(gk.data(), Nk, Hkv, D);
  p.v = contiguous4(gv.data(), Nk, Hkv, D);
  p.out = contiguous4(go.data(), N, Hq, D);
  p.lse = gl.data();
  p.lse_f64 = lse64();
  if (family != 1) {
    if (dtype == 0)
      tc_forward<__half>(p, family == 2);
    else
      tc_forward<__nv_bfloat16>(p, family == 2);
  } else {
    switch (dtype) {
      case 0: simt_forward<c10::Half, float>(p); break;
      case 1: simt_forward<c10::BFloat16, float>(p); break;
      case 2: simt_forward<float, float>(p); break;
      default: simt_forward<double, double>(p); break;
    }
  }
  for (Guarded* g : {&gq, &gk, &gv, &go, &gl})
    if (!g->fences_intact()) {
      snprintf(err, errlen, "a kernel wrote outside its buffers");
      return 1;
    }
  memcpy(out, go.data(), go.bytes);
  memcpy(lse, gl.data(), gl.bytes);
  return 0;
}

// Backward: dq, dk, dv from dout, q, k, v, out, lse and dlse (may be null).
extern "C" int da_emu_backward(int dtype, int family, int64_t B, int64_t N, int64_t Hq, int64_t Hkv,
                               int64_t D, int64_t nb, const int64_t* w, const int64_t* r, int causal,
                               double scale, int64_t R, int64_t interleaved, int64_t rows_per_warp,
                               int64_t other_tile, const void* dout, const void* q, const void* k,
                               const void* v, const void* out, const void* lse, const void* dlse, void* dq,
                               void* dk, void* dv, char* err, int errlen) {
  const Problem4 P = problem(dtype, family, B, N, Hq, Hkv, D, nb, w, r, causal, scale, R, interleaved,
                             rows_per_warp, other_tile);
  Params p;
  if (setup(P, &p, err, errlen)) return 1;
  const size_t es = elem_size(dtype), as = dtype == 3 ? 8 : 4, ls = lse64() ? 8 : as;
  const int64_t Nk = key_rows(N);
  const size_t nq = B * N * Hq * D * es, nk = B * Nk * Hkv * D * es, nl = B * Hq * N * ls,
               na = B * Hq * N * as;
  Guarded gdo(dout, nq, false), gq(q, nq, false), gk(k, nk, false), gv(v, nk, false), go(out, nq, false);
  Guarded gl(lse, nl, false), gdl(dlse, dlse ? na : 0, false), gdelta(nullptr, na, true);
  Guarded gdq(nullptr, nq, true), gdk(nullptr, nk, true), gdv(nullptr, nk, true);
  p.q = contiguous4(gq.data(), N, Hq, D);
  p.k = contiguous4(gk.data(), Nk, Hkv, D);
  p.v = contiguous4(gv.data(), Nk, Hkv, D);
  p.out = contiguous4(go.data(), N, Hq, D);
  p.dout = contiguous4(gdo.data(), N, Hq, D);
  p.dq = contiguous4(gdq.data(), N, Hq, D);
  p.dk = contiguous4(gdk.data(), Nk, Hkv, D);
  p.dv = contiguous4(gdv.data(), Nk, Hkv, D);
  p.lse = gl.data();
  p.lse_f64 = lse64();
  p.delta = gdelta.data();
  p.dlse = dlse ? gdl.data() : nullptr;
  // float16/bfloat16: delta from the forward's float32 out, as the host does (bwd_sequences in
  // dilated_attention_cuda.cpp): one forward more with out_f32, its out taken where its rounding is
  // the given out and the given out elsewhere.
  std::vector<float> out_read;
  if (dtype <= 1) {
    const size_t n = (size_t)(B * N * Hq * D);
    Guarded go32(nullptr, n * 4, true), gl32(nullptr, (size_t)(B * Hq * N) * (lse64() ? 8 : 4), true);
    Params pf = p;
    pf.out = contiguous4(go32.data(), N, Hq, D);
    pf.out_f32 = 1;
    pf.lse = gl32.data();
    if (family != 1) {
      if (dtype == 0)
        tc_forward<__half>(pf, family == 2);
      else
        tc_forward<__nv_bfloat16>(pf, family == 2);
    } else if (dtype == 0) {
      simt_forward<c10::Half, float>(pf);
    } else {
      simt_forward<c10::BFloat16, float>(pf);
    }
    if (!go32.fences_intact() || !gl32.fences_intact()) {
      snprintf(err, errlen, "a kernel wrote outside its buffers");
      return 1;
    }
    out_read.resize(n);
    const float* o32 = reinterpret_cast<const float*>(go32.data());
    const uint16_t* o16 = reinterpret_cast<const uint16_t*>(go.data());
    for (size_t i = 0; i < n; ++i) {
      const float given = da_emu::bits_to_float(o16[i], dtype == 1);
      uint16_t rounded;
      if (dtype == 0) {
        const __half h = __float2half_rn(o32[i]);
        memcpy(&rounded, &h, 2);
      } else {
        const __nv_bfloat16 h = __float2bfloat16_rn(o32[i]);
        memcpy(&rounded, &h, 2);
      }
      out_read[i] = rounded == o16[i] ? o32[i] : given;
    }
    p.out = contiguous4(out_read.data(), N, Hq, D);
    p.out_f32 = 1;
  }
  switch (dtype) {
    case 0: delta_pass<c10::Half, float>(p); break;
    case 1: delta_pass<c10::BFloat16, float>(p); break;
    case 2: delta_pass<float, float>(p); break;
    default: delta_pass<double, double>(p); break;
  }
  if (family != 1) {
    if (dtype == 0)
      tc_backward<__half>(p, family == 2);
    else
      tc_backward<__nv_bfloat16>(p, family == 2);
  } else {
    switch (dtype) {
      case 0: simt_backward<c10::Half, float>(p); break;
      case 1: simt_backward<c10::BFloat16, float>(p); break;
      case 2: simt_backward<float, float>(p); break;
      default: simt_backward<double, double>(p); break;
    }
  }
  for (Guarded* g : {&gdo, &gq, &gk, &gv, &go, &gl, &gdl, &gdelta, &gdq, &gdk, &gdv})
    if (!g->fences_intact()) {
      snprintf(err, errlen, "a kernel wrote outside its buffers");
      return 1;
    }
  memcpy(dq, gdq.data(), nq);
  memcpy(dk, gdk.data(), nk);
  memcpy(dv, gdv.data(), nk);
  return 0;
}

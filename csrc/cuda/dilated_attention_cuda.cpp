// CUDA implementation of dilated_attention::fwd, bwd, varlen_fwd, varlen_bwd, piece_fwd and
// piece_bwd: argument checks, the choice between the tensor-core and the SIMT kernels, and their
// launch on the current stream under a device guard. The kernels are in tc_kernels.cuh
// (float16/bfloat16 on sm80+) and simt.cu (everything else); tiling.h says how the work is cut into
// thread blocks.
//
// Semantics are those of the CPU kernel (csrc/cpu/forward.cpp and backward.cpp, SPEC sections 2-3):
// out (B, N, Hq, D) contiguous in the input dtype, lse (B, Hq, N) float32 (float64 for float64
// inputs); rows that no branch covers get out = 0 and lse = -inf. Attention dropout (dropout_p,
// dropout_seed, dropout_offset of fwd, bwd, varlen_fwd, varlen_bwd) draws the CPU kernel's mask
// (csrc/dropout.h, keyed by the rows of the (B, N, ...) tensors, or of a packed call's (1, T, ...)
// view), so both devices drop the same weights; the pieces take no dropout, as on the CPU.
//
// The pieces of sequence parallelism (piece_fwd/piece_bwd, those of csrc/cpu/piece.cpp: dense
// attention of q (B, nq, Hq, D) over k, v (B, nk, Hkv, D), key j visible to query i when
// j <= i + causal_offset under causal masking) run the same kernels as one segment of one branch
// (w = max(nq, nk), r = 1; tiling.h da_piece): the forward and dq launches have the nq queries as
// rows, the dk/dv launch the nk keys, each with a contiguous tiling of stride 1. A piece without
// keys launches nothing: out = 0 and lse = -inf, zero gradients.
//
// The packed (varlen) forms run the same kernels: their thread blocks take one sequence each along
// the grid's z (sequence_rows in common.cuh), with the tiling of the longest sequence; blocks whose
// rows lie past their sequence's end return at once. cu_seqlens is read once on the host to check
// it (a small copy that waits for the stream).
//
// The backward is deterministic: dq and dk/dv are computed by two
// passes that each own their output rows, without atomics (bitwise reproducible run to run).
//
// Two environment variables change how (never what) the kernels compute, for tests and tuning:
//   DILATED_ATTENTION_CUDA_SIMT=1       use the SIMT kernels for float16/bfloat16 too;
//   DILATED_ATTENTION_CUDA_TILING=R[,I] rows of a thread block at stride R, interleaved over the
//                                       warps if I is 1 (tiling.h); default: chosen per call.
//   DILATED_ATTENTION_CUDA_SM90=1       on sm90, the tensor-core kernels are the warpgroup ones
//                                       (tc90_kernels.cuh, wgmma), where the build has sm_90a
//                                       code; not yet verified on a GPU, so off by default.
//   DILATED_ATTENTION_CUDA_TMA=0        their chunks load by cp.async, never by the tensor copy
//                                       engine (for comparisons).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include "../checks.h"
#include "launch.h"

namespace dilated_attention {
namespace {

using cuda::DType;
using cuda::Params;
using cuda::Tensor4;

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kHalf: return DType::kHalf;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kFloat: return DType::kFloat;
    default: return DType::kDouble;
  }
}

Tensor4 tensor4(const at::Tensor& t) {
  return Tensor4{t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)};
}

// Environment variable `name` as 0 or 1; `unset` where it is not set (or empty).
bool env_flag(const char* name, bool unset = false) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return unset;
  const std::string s(v);
  if (s == "1" || s == "true" || s == "yes" || s == "on") return true;
  if (s == "0" || s == "false" || s == "no" || s == "off") return false;
  TORCH_CHECK(false, "dilated_attention: environment variable ", name, " must be 0 or 1, got '", s, "'");
}

// DILATED_ATTENTION_CUDA_TILING=R or R,I: a forced tiling, or false when unset.
bool env_tiling(int64_t* R, int64_t* interleaved) {
  const char* v = std::getenv("DILATED_ATTENTION_CUDA_TILING");
  if (v == nullptr || *v == '\0') return false;
  char* end = nullptr;
  const long long r = std::strtoll(v, &end, 10);
  long long il = 0;
  bool ok = end != v && r >= 1 && r <= (1LL << 30);
  if (ok && *end == ',') {
    const char* s = end + 1;
    il = std::strtoll(s, &end, 10);
    ok = end != s && (il == 0 || il == 1);
  }
  ok = ok && *end == '\0';
  TORCH_CHECK(ok,
              "dilated_attention: DILATED_ATTENTION_CUDA_TILING must be 'R' or 'R,I' with an "
              "integer stride 1 <= R <= 2^30 and I in {0, 1}, got '",
              v, "'");
  *R = r;
  *interleaved = il;
  return true;
}

// The tiling of sequences of up to `rows` rows (every sequence of a packed batch uses its
// longest's) for thread blocks of `warps` warps that own rows. Every row of a piece is active in
// its one segment: stride 1, contiguous.
da_tiling make_tiling(int64_t rows, const Problem& P, bool piece, int64_t rows_per_warp, int64_t warps = 4) {
  int64_t R = 1, il = 0;
  if (env_tiling(&R, &il)) return da_make_tiling(rows, R, il, warps, rows_per_warp);
  if (piece) return da_make_tiling(rows, 1, 0, warps, rows_per_warp);
  return da_choose_tiling(rows, &P.branches, P.is_causal ? 1 : 0, warps, rows_per_warp);
}

// Rows of one kind (`what`, called `symbol`) must fit the kernels' 32-bit indices.
void check_rows(int64_t n, const char* what, const char* symbol) {
  TORCH_CHECK(n <= std::numeric_limits<int32_t>::max() / 2, "dilated_attention: on CUDA ", what,
              " must be below 2^30, got ", symbol, " = ", n);
}

// Limits of the launch grid and of the kernels' 32-bit indices (the length N is checked apart:
// check_rows).
void check_grid(const Problem& P) {
  TORCH_CHECK(P.B <= 65535, "dilated_attention: on CUDA the batch size must be at most 65535, got ", P.B);
  TORCH_CHECK(P.Hq <= 32767, "dilated_attention: on CUDA the number of heads must be at most 32767, got ",
              P.Hq);
}

void check_sizes(const Problem& P) {
  check_rows(P.N, "the sequence length", "N");
  check_grid(P);
}

// The sequences of a call as the kernels see them: cu_seqlens (device, int32) or null for B
// sequences, how many, the query rows of the longest (which size the tiling of the forward and dq
// launches) and its key rows (the dk/dv launch's), and the piece (nk = 0: the op).
struct Seqs {
  const int32_t* cu_seqlens;
  int64_t count;
  int64_t max_len;
  int64_t max_keys;
  da_piece piece;
};

Seqs fixed_seqs(const Problem& P) {
  return Seqs{nullptr, P.B, P.N, P.N, da_piece{0, 0, 0}};
}

Seqs packed_seqs(const at::Tensor& cu_seqlens, int64_t T, int64_t max_seqlen) {
  const std::vector<Sequence> seqs = varlen_sequences(cu_seqlens, T, max_seqlen);
  int64_t longest = 0;
  for (const Sequence& sq : seqs) longest = std::max(longest, sq.len);
  TORCH_CHECK(seqs.size() <= 65535,
              "dilated_attention: on CUDA a packed batch holds at most 65535 sequences, got ", seqs.size());
  return Seqs{cu_seqlens.data_ptr<int32_t>(), (int64_t)seqs.size(), longest, longest, da_piece{0, 0, 0}};
}

// A piece (P from check_piece_inputs: N = nq) as the kernels run it: B sequences of nq query rows
// and nk >= 1 key rows, and *P made the one segment of one branch (w = max(nq, nk), r = 1) that
// holds them, with the offset clamped (piece_offset).
Seqs piece_seqs(Problem* P, int64_t nk, bool is_causal, int64_t causal_offset) {
  P->branches.n = 1;
  P->branches.w[0] = std::max(P->N, nk);
  P->branches.r[0] = 1;
  P->is_causal = is_causal;
  return Seqs{nullptr, P->B, P->N, nk, da_piece{P->N, nk, piece_offset(is_causal, causal_offset, P->N, nk)}};
}

Params base_params(const Problem& P, const Seqs& S) {
  Params p;
  std::memset(&p, 0, sizeof(p));
  p.B = P.B;
  p.N = P.N;
  p.Hq = P.Hq;
  p.Hkv = P.Hkv;
  p.D = P.D;
  p.G = P.Hq / P.Hkv;
  p.br = P.branches;
  p.is_causal = P.is_causal ? 1 : 0;
  p.scale = P.scale;
  p.cu_seqlens = S.cu_seqlens;
  p.num_seqs = S.count;
  p.piece = S.piece;
  return p;
}

// What the kernels need to know of the device (only c10/cuda and the CUDA runtime are used, so
// that the build needs no CUDA library headers beyond the runtime's).
struct Device {
  int major;     // compute capability
  int max_smem;  // opt-in shared memory per block, bytes
  bool sm90;     // the tensor-core passes run the warpgroup kernels (tc90_kernels.cuh)
};

Device device_info(int index) {
  Device d;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, index));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&d.max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, index));
  const bool want_sm90 = env_flag("DILATED_ATTENTION_CUDA_SM90");  // a bad value is an error on any GPU
  d.sm90 = d.major == 9 && want_sm90 && cuda::tc90_available(index);
  return d;
}

// Whether the tensor-core kernels can run these inputs on this device.
bool tc_eligible(const Problem& P, DType t, const Device& prop) {
  if (t != DType::kHalf && t != DType::kBFloat16) return false;
  if (prop.major < 8) return false;
  if (P.D < 32 || P.D > 256 || P.D % 8 != 0) return false;
  return !env_flag("DILATED_ATTENTION_CUDA_SIMT");
}

// The tensor-core kernels copy 16-byte chunks: every stride that is used must be a multiple of 8
// elements and the data 16-byte aligned. Returns t itself or an aligned contiguous copy.
at::Tensor tc_ready(const at::Tensor& t) {
  bool ok = t.stride(3) == 1 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int d = 0; d < 3 && ok; ++d) ok = t.size(d) <= 1 || t.stride(d) % 8 == 0;
  if (ok) return t;
  return at::empty(t.sizes(), t.options()).copy_(t);
}

// SIMT: the largest rows per warp and keys per step whose shared memory fits the device.
void simt_plan(const Problem& P, DType t, const Device& prop, int kernel, int64_t* rpw, int* other_tile) {
  static const int kPlans[][2] = {{4, 32}, {2, 32}, {4, 16}, {2, 16}, {1, 16}, {1, 8}};
  for (const auto& plan : kPlans) {
    if (t == DType::kDouble && plan[0] > 2) continue;  // keeps the double accumulators in registers
    if (cuda::simt_smem_bytes(P.D, t, plan[0], plan[1], kernel) <= prop.max_smem) {
      *rpw = plan[0];
      *other_tile = plan[1];
      return;
    }
  }
  TORCH_CHECK(false, "dilated_attention: the SIMT CUDA kernel for head dim ", P.D, " in ",
              t == DType::kDouble ? "float64" : "float32 accumulation",
              " needs more shared memory than the device offers (", prop.max_smem, " bytes per block)");
}

cuda::TcConfig tc_call(int kernel, DType t, const Params& p, const Device& prop, bool launch,
                       cudaStream_t stream) {
  const bool half = t == DType::kHalf;
  if (prop.sm90) return cuda::tc90_call(kernel, half, p, launch, stream);
  switch (kernel) {
    case cuda::kFwd: return half ? cuda::tc_fwd_f16(p, launch, stream) : cuda::tc_fwd_bf16(p, launch, stream);
    case cuda::kDq: return half ? cuda::tc_dq_f16(p, launch, stream) : cuda::tc_dq_bf16(p, launch, stream);
    default: return half ? cuda::tc_dkv_f16(p, launch, stream) : cuda::tc_dkv_bf16(p, launch, stream);
  }
}

// Whether the tensor-core kernel `kernel` fits in the device's shared memory (it always does on
// sm80/sm90; the check keeps other parts safe).
bool tc_fits(int kernel, DType t, const Params& p, const Device& prop) {
  const cuda::TcConfig cfg = tc_call(kernel, t, p, prop, false, nullptr);
  if (cfg.smem_bytes <= prop.max_smem) return true;
  TORCH_WARN_ONCE("dilated_attention: the tensor-core CUDA kernel for head dim ", p.D, " needs ",
                  cfg.smem_bytes, " bytes of shared memory per block, the device offers ", prop.max_smem,
                  "; using the SIMT kernel instead (slower)");
  return false;
}

// Launches kernel `kernel` (forward, dq or dk/dv) with the tensor cores or SIMT; p holds S
// (base_params). Its rows are the queries of each sequence, or their keys for the dk/dv kernel.
void run(int kernel, const Problem& P, const Seqs& S, DType t, Params p, bool use_tc, const Device& prop,
         cudaStream_t stream) {
  const int64_t rows = kernel == cuda::kDkv ? S.max_keys : S.max_len;
  const bool piece = S.piece.nk > 0;
  if (use_tc) {
    const cuda::TcConfig cfg = tc_call(kernel, t, p, prop, false, nullptr);  // 4 warps (sm80) or 8 (sm90)
    p.tiling = make_tiling(rows, P, piece, cfg.rows_per_warp, cfg.warps);
    TORCH_CHECK(da_num_tiles(&p.tiling) <= std::numeric_limits<int32_t>::max(),
                "dilated_attention: too many thread blocks for ", rows, " rows");
    const bool tma = env_flag("DILATED_ATTENTION_CUDA_TMA", true);  // a bad value is an error on any GPU
    p.tma = prop.sm90 && tma;
    tc_call(kernel, t, p, prop, true, stream);
    if (p.tma && cuda::tma_refused())
      TORCH_WARN_ONCE(
          "dilated_attention: the CUDA driver refused a tensor map of the sm90 kernels; their chunks "
          "load by cp.async instead of the tensor copy engine (slower, the same results)");
  } else {
    int64_t rpw = 4;
    simt_plan(P, t, prop, kernel, &rpw, &p.other_tile);
    p.tiling = make_tiling(rows, P, piece, rpw);
    TORCH_CHECK(da_num_tiles(&p.tiling) <= std::numeric_limits<int32_t>::max(),
                "dilated_attention: too many thread blocks for ", rows, " rows");
    if (kernel == cuda::kFwd)
      cuda::simt_fwd(p, t, stream);
    else if (kernel == cuda::kDq)
      cuda::simt_dq(p, t, stream);
    else
      cuda::simt_dkv(p, t, stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The forward of the sequences S of (B, N, ...) inputs into out (B, N, Hq, D) and lse (B, Hq, N),
// with attention dropout `drop`; k and v have S.max_keys rows for a piece.
void fwd_sequences(const Problem& P, const Seqs& S, at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor& out,
                   at::Tensor& lse, const da_dropout& drop) {
  const DType t = dtype_of(q);
  const Device prop = device_info(q.device().index());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  Params p = base_params(P, S);
  p.drop = drop;
  bool use_tc = tc_eligible(P, t, prop);
  if (use_tc) {
    q = tc_ready(q);
    k = tc_ready(k);
    v = tc_ready(v);
  }
  p.q = tensor4(q);
  p.k = tensor4(k);
  p.v = tensor4(v);
  p.out = tensor4(out);
  p.out_f32 = out.scalar_type() != q.scalar_type();  // the backward's float32 recomputation
  p.lse = lse.data_ptr();
  p.lse_f64 = lse.scalar_type() == at::kDouble;
  use_tc = use_tc && tc_fits(cuda::kFwd, t, p, prop);
  run(cuda::kFwd, P, S, t, p, use_tc, prop, stream);
}

// No attention dropout: a piece's, which takes none.
da_dropout no_dropout() {
  return da_dropout_make(0.0, 0, 0);
}

// The forward's outputs for q (B, N, Hq, D): out (B, N, Hq, D) in q's dtype, lse (B, Hq, N)
// (float64 with float64_lse).
std::tuple<at::Tensor, at::Tensor> forward_outputs(const Problem& P, const at::Tensor& q, bool float64_lse) {
  return {at::empty({P.B, P.N, P.Hq, P.D}, q.options()),
          at::empty({P.B, P.Hq, P.N}, q.options().dtype(lse_dtype(q.scalar_type(), float64_lse)))};
}

std::tuple<at::Tensor, at::Tensor> fwd_cuda(const at::Tensor& q_in, const at::Tensor& k_in,
                                            const at::Tensor& v_in, at::IntArrayRef segment_lengths,
                                            at::IntArrayRef dilation_rates, bool is_causal,
                                            double softmax_scale, bool float64_lse, double dropout_p,
                                            int64_t dropout_seed, int64_t dropout_offset) {
  const Problem P = check_inputs(q_in, k_in, v_in, segment_lengths, dilation_rates, is_causal, softmax_scale);
  const da_dropout drop = dropout_params(dropout_p, dropout_seed, dropout_offset);
  TORCH_CHECK(q_in.device().is_cuda(), "dilated_attention: expected CUDA tensors, got ", q_in.device());
  check_sizes(P);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in),
                   v = last_dim_contiguous(v_in);
  auto [out, lse] = forward_outputs(P, q, float64_lse);
  if (P.B == 0 || P.N == 0) return {out, lse};
  fwd_sequences(P, fixed_seqs(P), q, k, v, out, lse, drop);
  return {out, lse};
}

// The packed form (SPEC section 7): q (T, Hq, D), k and v (T, Hkv, D), cu_seqlens int32 (S + 1,);
// out (T, Hq, D), lse (Hq, T).
std::tuple<at::Tensor, at::Tensor> varlen_fwd_cuda(const at::Tensor& q_in, const at::Tensor& k_in,
                                                   const at::Tensor& v_in, const at::Tensor& cu_seqlens,
                                                   int64_t max_seqlen, at::IntArrayRef segment_lengths,
                                                   at::IntArrayRef dilation_rates, bool is_causal,
                                                   double softmax_scale, bool float64_lse, double dropout_p,
                                                   int64_t dropout_seed, int64_t dropout_offset) {
  const Problem P = check_varlen_inputs(q_in, k_in, v_in, cu_seqlens, max_seqlen, segment_lengths,
                                        dilation_rates, is_causal, softmax_scale);
  const da_dropout drop = dropout_params(dropout_p, dropout_seed, dropout_offset);
  TORCH_CHECK(q_in.device().is_cuda(), "dilated_attention: expected CUDA tensors, got ", q_in.device());
  check_sizes(P);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor cu = cu_seqlens.contiguous();
  const Seqs S = packed_seqs(cu, P.N, max_seqlen);
  const at::Tensor q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in),
                   v = last_dim_contiguous(v_in);
  at::Tensor out = at::empty({P.N, P.Hq, P.D}, q.options());
  at::Tensor lse = at::empty({P.Hq, P.N}, q.options().dtype(lse_dtype(q.scalar_type(), float64_lse)));
  if (P.N == 0) return {out, lse};
  at::Tensor out4 = out.unsqueeze(0), lse3 = lse.unsqueeze(0);
  fwd_sequences(P, S, q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), out4, lse3, drop);
  return {out, lse};
}

// The backward of the sequences S of (B, N, ...) inputs with the forward's attention dropout
// `drop`: dq, dk, dv of the inputs' shapes (k and v have S.max_keys rows for a piece, which has at
// least one query and one key).
std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_sequences(const Problem& P, const Seqs& S, at::Tensor dout,
                                                             at::Tensor q, at::Tensor k, at::Tensor v,
                                                             const at::Tensor& out, const at::Tensor& lse,
                                                             const at::Tensor& dlse, const da_dropout& drop) {
  at::Tensor dq = at::empty({P.B, P.N, P.Hq, P.D}, q.options());
  at::Tensor dk = at::empty({P.B, k.size(1), P.Hkv, P.D}, q.options());
  at::Tensor dv = at::empty({P.B, k.size(1), P.Hkv, P.D}, q.options());
  if (P.B == 0 || P.N == 0) return {dq, dk, dv};
  at::Tensor delta = at::empty(lse.sizes(), lse.options().dtype(lse_dtype(q.scalar_type())));

  const DType t = dtype_of(q);
  const Device prop = device_info(q.device().index());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  // float16/bfloat16: delta from the forward's float32 out (out_for_backward in
  // csrc/cpu/backward.cpp says why), recomputed by one forward; taken where its rounding
  // is the given out, and the given out elsewhere (the backward takes any out).
  at::Tensor out_read = out;
  if (t == DType::kHalf || t == DType::kBFloat16) {
    at::Tensor out32 = at::empty(out.sizes(), out.options().dtype(at::kFloat));
    at::Tensor lse32 = at::empty(lse.sizes(), lse.options().dtype(at::kFloat));
    fwd_sequences(P, S, q, k, v, out32, lse32, drop);
    out_read = at::where(out32.to(out.scalar_type()) == out, out32, out.to(at::kFloat));
  }
  Params p = base_params(P, S);
  p.drop = drop;
  p.out = tensor4(out_read);
  p.out_f32 = out_read.scalar_type() != q.scalar_type();
  p.dout = tensor4(dout);
  p.lse = lse.data_ptr();
  p.lse_f64 = lse.scalar_type() == at::kDouble;
  p.delta = delta.data_ptr();
  p.dlse = dlse.defined() ? dlse.data_ptr() : nullptr;
  cuda::delta_kernel(p, t, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  bool use_tc = tc_eligible(P, t, prop);
  if (use_tc) {
    q = tc_ready(q);
    k = tc_ready(k);
    v = tc_ready(v);
    dout = tc_ready(dout);
  }
  p.q = tensor4(q);
  p.k = tensor4(k);
  p.v = tensor4(v);
  p.dout = tensor4(dout);
  p.dq = tensor4(dq);
  p.dk = tensor4(dk);
  p.dv = tensor4(dv);
  const bool tc_dq = use_tc && tc_fits(cuda::kDq, t, p, prop);
  const bool tc_dkv = use_tc && tc_fits(cuda::kDkv, t, p, prop);
  run(cuda::kDq, P, S, t, p, tc_dq, prop, stream);
  run(cuda::kDkv, P, S, t, p, tc_dkv, prop, stream);
  return {dq, dk, dv};
}

// The backward of (B, N, ...) inputs as the op receives them (the fixed-length op and the pieces):
// their last dimension made contiguous and dlse converted to the accumulation dtype, then
// bwd_sequences. lse may be float64 for any inputs (the op's float64_lse).
std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_fixed(const Problem& P, const Seqs& S,
                                                         const at::Tensor& dout, const at::Tensor& q,
                                                         const at::Tensor& k, const at::Tensor& v,
                                                         const at::Tensor& out, const at::Tensor& lse,
                                                         const c10::optional<at::Tensor>& dlse_in,
                                                         const da_dropout& drop) {
  at::Tensor dlse;
  if (dlse_in.has_value() && dlse_in->defined()) dlse = dlse_in->to(lse_dtype(q.scalar_type())).contiguous();
  return bwd_sequences(P, S, last_dim_contiguous(dout), last_dim_contiguous(q), last_dim_contiguous(k),
                       last_dim_contiguous(v), last_dim_contiguous(out), lse.contiguous(), dlse, drop);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cuda(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse_in, const c10::optional<at::Tensor>& dlse_in,
    at::IntArrayRef segment_lengths, at::IntArrayRef dilation_rates, bool is_causal, double softmax_scale,
    double dropout_p, int64_t dropout_seed, int64_t dropout_offset) {
  const Problem P = check_inputs(q_in, k_in, v_in, segment_lengths, dilation_rates, is_causal, softmax_scale);
  check_backward_inputs(P, q_in, dout_in, out_in, lse_in, dlse_in);
  const da_dropout drop = dropout_params(dropout_p, dropout_seed, dropout_offset);
  TORCH_CHECK(q_in.device().is_cuda(), "dilated_attention: expected CUDA tensors, got ", q_in.device());
  check_sizes(P);
  const c10::cuda::CUDAGuard guard(q_in.device());
  return bwd_fixed(P, fixed_seqs(P), dout_in, q_in, k_in, v_in, out_in, lse_in, dlse_in, drop);
}

// The packed form: dout and out (T, Hq, D), lse and dlse (Hq, T); dq (T, Hq, D), dk and dv (T, Hkv, D).
std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_bwd_cuda(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse_in, const c10::optional<at::Tensor>& dlse_in,
    const at::Tensor& cu_seqlens, int64_t max_seqlen, at::IntArrayRef segment_lengths,
    at::IntArrayRef dilation_rates, bool is_causal, double softmax_scale, double dropout_p,
    int64_t dropout_seed, int64_t dropout_offset) {
  const Problem P = check_varlen_inputs(q_in, k_in, v_in, cu_seqlens, max_seqlen, segment_lengths,
                                        dilation_rates, is_causal, softmax_scale);
  const c10::optional<at::Tensor> dlse4 =
      check_varlen_backward_inputs(P, q_in, dout_in, out_in, lse_in, dlse_in);
  const da_dropout drop = dropout_params(dropout_p, dropout_seed, dropout_offset);
  TORCH_CHECK(q_in.device().is_cuda(), "dilated_attention: expected CUDA tensors, got ", q_in.device());
  check_sizes(P);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor cu = cu_seqlens.contiguous();
  const Seqs S = packed_seqs(cu, P.N, max_seqlen);
  at::Tensor dlse;
  if (dlse4.has_value()) dlse = dlse4->to(lse_dtype(q_in.scalar_type())).contiguous();
  auto grads =
      bwd_sequences(P, S, last_dim_contiguous(dout_in).unsqueeze(0), last_dim_contiguous(q_in).unsqueeze(0),
                    last_dim_contiguous(k_in).unsqueeze(0), last_dim_contiguous(v_in).unsqueeze(0),
                    last_dim_contiguous(out_in).unsqueeze(0), lse_in.contiguous().unsqueeze(0), dlse, drop);
  return {std::get<0>(grads).squeeze(0), std::get<1>(grads).squeeze(0), std::get<2>(grads).squeeze(0)};
}

// Checks of a piece's inputs on CUDA: those of the CPU piece (checks.h) and the CUDA limits.
Problem check_piece_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         double softmax_scale) {
  const Problem P = check_piece_inputs(q, k, v, softmax_scale);
  TORCH_CHECK(q.device().is_cuda(), "dilated_attention piece: expected CUDA tensors, got ", q.device());
  check_rows(P.N, "the number of queries of a piece", "nq");
  check_rows(k.size(1), "the number of keys of a piece", "nk");
  check_grid(P);
  return P;
}

// A piece (csrc/cpu/piece.cpp): out (B, nq, Hq, D), lse (B, Hq, nq); without keys out = 0 and
// lse = -inf.
std::tuple<at::Tensor, at::Tensor> piece_fwd_cuda(const at::Tensor& q_in, const at::Tensor& k_in,
                                                  const at::Tensor& v_in, bool is_causal,
                                                  int64_t causal_offset, double softmax_scale,
                                                  bool float64_lse) {
  Problem P = check_piece_cuda(q_in, k_in, v_in, softmax_scale);
  const int64_t nk = k_in.size(1);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in),
                   v = last_dim_contiguous(v_in);
  auto [out, lse] = forward_outputs(P, q, float64_lse);
  if (P.B == 0 || P.N == 0) return {out, lse};
  if (nk == 0) {
    out.zero_();
    lse.fill_(-std::numeric_limits<double>::infinity());
    return {out, lse};
  }
  const Seqs S = piece_seqs(&P, nk, is_causal, causal_offset);
  fwd_sequences(P, S, q, k, v, out, lse, no_dropout());
  return {out, lse};
}

// Its backward for any out and lse (B, Hq, nq): this piece's share of dq, dk, dv; zeros when it
// has no query or no key.
std::tuple<at::Tensor, at::Tensor, at::Tensor> piece_bwd_cuda(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse_in, const c10::optional<at::Tensor>& dlse_in,
    bool is_causal, int64_t causal_offset, double softmax_scale) {
  Problem P = check_piece_cuda(q_in, k_in, v_in, softmax_scale);
  check_backward_inputs(P, q_in, dout_in, out_in, lse_in, dlse_in);
  const int64_t nk = k_in.size(1);
  const c10::cuda::CUDAGuard guard(q_in.device());
  if (P.B == 0 || P.N == 0 || nk == 0)
    return {at::zeros_like(q_in), at::zeros_like(k_in), at::zeros_like(v_in)};
  const Seqs S = piece_seqs(&P, nk, is_causal, causal_offset);
  return bwd_fixed(P, S, dout_in, q_in, k_in, v_in, out_in, lse_in, dlse_in, no_dropout());
}

}  // namespace

TORCH_LIBRARY_IMPL(dilated_attention, CUDA, m) {
  m.impl("fwd", &fwd_cuda);
  m.impl("bwd", &bwd_cuda);
  m.impl("varlen_fwd", &varlen_fwd_cuda);
  m.impl("varlen_bwd", &varlen_bwd_cuda);
  m.impl("piece_fwd", &piece_fwd_cuda);
  m.impl("piece_bwd", &piece_bwd_cuda);
}

}  // namespace dilated_attention

// The kernels' own buffers (head_major.cpp): the head-major copies of q, k, v, dout and out, zeroed
// accumulators, and the argument structs' pointers and strides into them.
#pragma once

#include <ATen/ATen.h>

#include <stdint.h>

namespace dilated_attention {
namespace cpu {

/* A zeroed CPU tensor for the kernels' own buffers (huge pages on Linux where allowed). */
at::Tensor zeroed_buffer(at::IntArrayRef sizes, const at::TensorOptions& opt);

/* t (B, N, H, D) as a (B, N, H, Dp) view of a head-major (B, H, N, Dp) tensor of type st, rows zero
 * padded past D; t itself when it already is one. */
at::Tensor head_major_rows(const at::Tensor& t, at::ScalarType st, int64_t Dp);

/* out's head-major rows (head_major_rows) at the strides of dout's. */
at::Tensor rows_like(const at::Tensor& out, const at::Tensor& dout, at::ScalarType st, int64_t Dp);

template <typename T>
static void set_strides(const at::Tensor& t, int64_t* sb, int64_t* sn, int64_t* sh) {
  *sb = t.stride(0);
  *sn = t.stride(1);
  *sh = t.stride(2);
}

/* Point an argument struct (Fwd, Bwd, PieceArgs) at its q, k, v rows. */
template <typename T, typename Args>
static void point_qkv(Args* A, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  A->q = q.data_ptr<T>();
  A->k = k.data_ptr<T>();
  A->v = v.data_ptr<T>();
  set_strides<T>(q, &A->q_sb, &A->q_sn, &A->q_sh);
  set_strides<T>(k, &A->k_sb, &A->k_sn, &A->k_sh);
  set_strides<T>(v, &A->v_sb, &A->v_sn, &A->v_sh);
}

/* Point a backward's argument struct (Bwd, PieceArgs) at its rows and gradient accumulators. */
template <typename T, typename Args>
static void point_backward(Args* A, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& dout, const at::Tensor& dq, const at::Tensor& dk,
                           const at::Tensor& dv) {
  point_qkv<T>(A, q, k, v);
  A->dout = dout.data_ptr<T>();
  A->dq = dq.data_ptr<T>();
  A->dk = dk.data_ptr<T>();
  A->dv = dv.data_ptr<T>();
  set_strides<T>(dout, &A->do_sb, &A->do_sn, &A->do_sh);
  set_strides<T>(dq, &A->dq_sb, &A->dq_sn, &A->dq_sh);
  set_strides<T>(dk, &A->dk_sb, &A->dk_sn, &A->dk_sh);
  set_strides<T>(dv, &A->dv_sb, &A->dv_sn, &A->dv_sh);
}

}  // namespace cpu
}  // namespace dilated_attention

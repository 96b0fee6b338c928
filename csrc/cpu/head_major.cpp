// The kernels' own buffers (head_major.h): zeroed buffers and the head-major copies of the inputs.
#include <ATen/ATen.h>

#include <stdint.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "head_major.h"

namespace dilated_attention {
namespace cpu {

/*
 * A zeroed CPU tensor for the kernels' own buffers (the head-major copies and accumulators). On
 * Linux, one of 2 MiB or more is mapped afresh with MADV_HUGEPAGE (where the kernel's transparent
 * huge pages allow it): its first touch then faults once per 2 MiB rather than once per 4 KiB page,
 * and the mapping comes zeroed. Elsewhere, and if the mapping fails, at::zeros.
 */
at::Tensor zeroed_buffer(at::IntArrayRef sizes, const at::TensorOptions& opt) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const size_t huge = (size_t)2 << 20;
  const size_t bytes = (size_t)c10::multiply_integers(sizes) * opt.dtype().itemsize();
  if (bytes >= huge) {
    const size_t len = bytes + huge;  // room to start on a 2 MiB boundary
    void* base = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base != MAP_FAILED) {
      char* p = (char*)(((uintptr_t)base + huge - 1) & ~(uintptr_t)(huge - 1));
      madvise(p, bytes, MADV_HUGEPAGE);  // advice only: without it the buffer works the same
      return at::from_blob(p, sizes, [base, len](void*) { munmap(base, len); }, opt);
    }
  }
#endif
  return at::zeros(sizes, opt);
}

/*
 * t (B, N, H, D) as a (B, N, H, Dp) view of a head-major (B, H, N, Dp) tensor of type st, rows zero
 * padded past D; t itself when it already is one. The kernels walk one head's rows at a stride of r
 * rows: head-major, those rows lie r * Dp values apart rather than r * H * Dp (a power of two apart
 * for the usual H and D, so they fall into a few cache sets and on a new page each). With the copies
 * included, the forward took about 12% and the backward about 11% less time with two threads on a
 * 2-core AVX-512 VM (B=1, H=8, D=64, N=16K, medians of 4 interleaved runs). Cost: one pass over t,
 * and a copy of B * H * N * Dp values.
 */
at::Tensor head_major_rows(const at::Tensor& t, at::ScalarType st, int64_t Dp) {
  const at::Tensor th = t.transpose(1, 2);  // (B, H, N, D)
  if (t.scalar_type() == st && t.size(3) == Dp && th.is_contiguous()) return t;
  at::Tensor rows = zeroed_buffer({t.size(0), t.size(2), t.size(1), Dp}, t.options().dtype(st));
  rows.narrow(3, 0, t.size(3)).copy_(th);
  return rows.transpose(1, 2);
}

/* out's head-major rows (head_major_rows) at the strides of dout's, so that one offset finds a row
 * of either (the backward's dO (V - O)^T). */
at::Tensor rows_like(const at::Tensor& out, const at::Tensor& dout, at::ScalarType st, int64_t Dp) {
  at::Tensor rows = head_major_rows(out, st, Dp);
  if (rows.strides() == dout.strides()) return rows;
  at::Tensor same = at::empty_strided(dout.sizes(), dout.strides(), dout.options());
  return same.copy_(rows);
}

}  // namespace cpu
}  // namespace dilated_attention

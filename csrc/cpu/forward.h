// What the forward (forward.cpp) shares with the pieces' (piece.cpp) and the backward's
// recomputations (backward.cpp): a thread's forward scratch, and the forward of a call.
#pragma once

#include <ATen/ATen.h>

#include <stdint.h>

#include <vector>

#include "../checks.h"
#include "../dropout.h"
#include "tasks.h"
#include "vec.h"

namespace dilated_attention {
namespace cpu {

template <typename T>
struct FwdScratch {
  Arena<T> arena;
  T* m;                      // block state per position: the max (QB), and in double
  T* mlo;                    // the max's low part (QB): m + mlo is the reference pair (online_softmax)
  double *l, *acc;           // the denominator (QB) and the unnormalised output (QB, Dp)
  double *lw, *acctw, *ltw;  // Fwd::wide: the denominator summed in double (QB); acct and lt in double
  double* vw;                // Fwd::wide: the key tile's values in double (KF, Dp)
  std::vector<double> dbl;   // l, acc, lw, acctw, ltw, vw
  T *qt, *st, *stlo;         // (D, QT) queries, transposed; (KF, QT) scores, then weights; (KF, QT)
                             // the scores' low parts (float rows: the score is st + stlo)
  T *mt, *lt, *corr, *tmax;  // (QT) tile state
  T* mtlo;                   // (QT) mt's low part: mt + mtlo is the reference pair (online_softmax)
  T* acct;                   // (QT, Dp)
  std::vector<double> wide;  // qt in double, for the scores of float rows (widen_operand)
  FwdScratch(int64_t QB, int64_t D, int64_t Dp)
      : arena(Arena<T>::need({(size_t)QB, (size_t)QB, (size_t)(D * QT), (size_t)(KF * QT), (size_t)(KF * QT),
                              QT, QT, QT, QT, QT, (size_t)(QT * Dp)})),
        dbl((size_t)(QB * (Dp + 2) + QT * (Dp + 1) + KF * Dp)) {
    m = arena.take(QB);
    mlo = arena.take(QB);
    l = dbl.data();
    acc = l + QB;
    lw = acc + QB * Dp;
    acctw = lw + QB;
    ltw = acctw + QT * Dp;
    vw = ltw + QT;
    qt = arena.take(D * QT);
    st = arena.take(KF * QT);
    stlo = arena.take(KF * QT);
    mt = arena.take(QT);
    mtlo = arena.take(QT);
    lt = arena.take(QT);
    corr = arena.take(QT);
    tmax = arena.take(QT);
    acct = arena.take(QT * Dp);
  }
};

/*
 * The forward of every sequence of a call, into out (B, N, Hq, D) and lse (B, Hq, N) (a packed call
 * passes its (1, T, ...) views): tasks (sequence, head, block of QB positions), each run by
 * fwd_block on the sequence's rows as a sequence of its own (positions, segments, phases and causal
 * masking start at its first row).
 */
void fwd_sequences(const Problem& P, const std::vector<Sequence>& seqs, const at::Tensor& q_in,
                   const at::Tensor& k_in, const at::Tensor& v_in, at::Tensor& out, at::Tensor& lse,
                   const da_dropout& drop);

}  // namespace cpu
}  // namespace dilated_attention

/*
 * Attention dropout's keep mask, one function for the CPU kernels, the CUDA kernels and their CPU
 * emulation (plain C, DA_HD as in dilated_attention.h), so that a backward regenerates the mask
 * of its forward without storing it, and tests can read the same mask (dilated_attention::
 * dropout_mask).
 *
 * The weight of query row q and key row x of head h of batch entry b (rows of the (B, N, ...)
 * tensors; a packed call's rows are those of its (1, T, ...) view, b = 0) is kept with
 * probability 1 - p and then scaled by 1 / (1 - p) (SPEC section 3, as FlashAttention does). The
 * draw is Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011),
 * counter-based: the key is the 64-bit seed, the counter (x / 4, q, b * H + h, offset), and word
 * x % 4 of the result decides key x: kept when it is >= threshold = round(p * 2^32). A weight
 * counts once whatever the number of branches that find its key (the merged weight of SPEC
 * section 3 is dropped or kept as a whole).
 */
#ifndef DILATED_ATTENTION_DROPOUT_H_
#define DILATED_ATTENTION_DROPOUT_H_

#include <stdint.h>

#include "dilated_attention.h"

typedef struct {
  uint32_t threshold;  /* round(p * 2^32): a draw below it drops the weight; 0: no dropout */
  float scale;         /* 1 / (1 - p), for float computations */
  double scale64;      /* 1 / (1 - p), for double ones */
  uint32_t key0, key1; /* the seed */
  uint32_t offset;     /* the counter's last word */
} da_dropout;

/* The parameters of dropout with probability p (0 <= p < 1), seed and offset; p = 0: none. */
DA_HD da_dropout da_dropout_make(double p, uint64_t seed, uint64_t offset) {
  da_dropout d;
  const double t = p * 4294967296.0;
  d.threshold = p <= 0 ? 0u : t >= 4294967295.0 ? 4294967295u : (uint32_t)(t + 0.5);
  d.scale64 = p <= 0 ? 1.0 : 1.0 / (1.0 - p);
  d.scale = (float)d.scale64;
  d.key0 = (uint32_t)seed;
  d.key1 = (uint32_t)(seed >> 32);
  d.offset = (uint32_t)offset ^ (uint32_t)(offset >> 32);
  return d;
}

DA_HD uint32_t da_mulhilo32(uint32_t a, uint32_t b, uint32_t* hi) {
  const uint64_t prod = (uint64_t)a * (uint64_t)b;
  *hi = (uint32_t)(prod >> 32);
  return (uint32_t)prod;
}

/* Philox4x32-10 of counter c under key (k0, k1), in place. */
DA_HD void da_philox4x32_10(uint32_t c[4], uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, hi1;
    const uint32_t lo0 = da_mulhilo32(0xD2511F53u, c[0], &hi0);
    const uint32_t lo1 = da_mulhilo32(0xCD9E8D57u, c[2], &hi1);
    const uint32_t n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
    c[0] = n0;
    c[1] = lo1;
    c[2] = n2;
    c[3] = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
}

/* The four draws of keys 4 * x4 .. 4 * x4 + 3 for query row q of head bh = b * H + h. */
DA_HD void da_dropout_draws(const da_dropout* d, int64_t bh, int64_t q, int64_t x4, uint32_t out[4]) {
  out[0] = (uint32_t)x4;
  out[1] = (uint32_t)q;
  out[2] = (uint32_t)bh;
  out[3] = d->offset;
  da_philox4x32_10(out, d->key0, d->key1);
}

/* Whether the weight of (query row q, key row x) of head bh is kept. */
DA_HD int da_dropout_keep(const da_dropout* d, int64_t bh, int64_t q, int64_t x) {
  uint32_t r[4];
  da_dropout_draws(d, bh, q, x >> 2, r);
  return r[x & 3] >= d->threshold;
}

#endif /* DILATED_ATTENTION_DROPOUT_H_ */

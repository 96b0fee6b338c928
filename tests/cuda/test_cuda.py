"""The native op on CUDA (csrc/cuda) against the float64 dense reference (SPEC sections 1-4).

Three parts:

* Without a GPU, the walk: the index arithmetic that the CUDA kernels run (csrc/cuda/tiling.h: how
  rows are cut into thread blocks, the walk over heads, branches, segments and chunks of the
  other side, and the per-warp skip/mask decisions) is compiled with the host C++ compiler and
  replayed for every thread block; the (query, key) pairs it visits must be exactly the
  reference's multiplicity mask. Needs a C++ compiler.
* Without a GPU, the kernels: the unchanged kernel sources run on the CPU through
  tests/cuda_emulation (threads as fibers; barriers, shuffles, ldmatrix, mma.sync and cp.async
  emulated) and are compared with the float64 reference. Needs a C++ compiler and the CUDA
  headers (no driver, no GPU).
* With a GPU (skipped otherwise): the CUDA op against the float64 reference in every dtype under
  the tolerance rule, CPU and CUDA agreeing, opcheck, torch.compile, a bitwise reproducible
  backward, grouped-query attention, causal masking, ragged segments, head dims 32-256, both
  kernel families (tensor-core and SIMT) and several forced tilings.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from common import build_emulation, grads, load_script, needs_cuda_kernels
from common import make_inputs as _make_inputs
from reference import multiplicity, reference_attention, reference_piece, reference_varlen
from tolerance import assert_causal_segment_within_rule, assert_within_rule

import dilated_attention
from dilated_attention import dilated_attention as dattn
from dilated_attention import op as _ops
from dilated_attention.backends import select_backend
from dilated_attention.flops import attention_pairs
from dilated_attention.merge import merge
from dilated_attention.op import has_kernel

ROOT = Path(__file__).resolve().parents[2]
SLOW = os.environ.get("DILATED_ATTENTION_SLOW", "0") == "1"

# ----------------------------------------------------------------------------------------------
# The kernels' walk, replayed on the CPU
# ----------------------------------------------------------------------------------------------

_WALK_SOURCE = r"""
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <vector>
#include "cuda/tiling.h"

/* The tiling of a longer sequence (packed sequences: every sequence runs with the tiling of the
 * longest), or 0 for the tiling of N itself. */
static int64_t g_tile_rows = 0;
extern "C" void da_replay_tile_rows(int64_t n) { g_tile_rows = n; }

/* A piece of nq queries over nk keys with a causal offset for the next calls (nk = 0: the op).
 * The rows are the N = nq queries or N = nk keys; mult is then (Hq, nq, nk). */
static da_piece g_piece = {0, 0, 0};
extern "C" void da_replay_piece(int64_t nq, int64_t nk, int64_t offset) {
  g_piece.nq = nq;
  g_piece.nk = nk;
  g_piece.offset = offset;
}

/* Replays, for every thread block, what the CUDA kernels do with their rows: the walk over
 * (head, branch, segment, chunk), the block-wide "any row active" test, and each warp's skip and
 * mask decisions. work[1] counts the pairs that warps compute (rows_per_warp x other_tile per
 * chunk they do not skip) and work[0] the useful ones among them. With mult, every pair that a
 * warp computes unmasked or that passes the mask is added to mult[h][query][key] (and counted);
 * without it (mult == NULL, for lengths where an (N, N) mask does not fit) the useful pairs of each
 * active row are counted in closed form and only every tile_step-th thread block is walked.
 * Returns 0, or 1 with a message in err. */
extern "C" int da_replay(int64_t N, int64_t Hq, int64_t Hkv, int64_t nb, const int64_t* w,
                         const int64_t* r, int causal, int rows_are, int64_t R, int64_t interleaved,
                         int64_t rows_per_warp, int64_t other_tile, int64_t tile_step, int64_t* mult,
                         int64_t* chosen, double* work, char* err, int errlen) {
  da_branches br;
  br.n = nb;
  for (int64_t i = 0; i < nb; ++i) { br.w[i] = w[i]; br.r[i] = r[i]; }
  const int64_t warps = 4, G = Hq / Hkv;
  const int64_t tn = g_tile_rows > 0 ? g_tile_rows : N;
  const da_tiling t = R > 0 ? da_make_tiling(tn, R, interleaved, warps, rows_per_warp)
                            : da_choose_tiling(tn, &br, causal, warps, rows_per_warp);
  chosen[0] = t.R;
  chosen[1] = t.interleaved;
  work[0] = work[1] = 0.0;
  if (mult == NULL && tile_step < 1) { snprintf(err, errlen, "tile_step must be >= 1"); return 1; }
  if (mult != NULL) tile_step = 1;
  const int64_t M = da_tile_rows(&t);
  const da_piece* pc = &g_piece;
  const int64_t off = da_causal_offset(pc);
  const int64_t nq = pc->nk > 0 ? pc->nq : N, nk = pc->nk > 0 ? pc->nk : N; /* mult is (Hq, nq, nk) */
  std::vector<int64_t> seen(N, 0);
  std::vector<int64_t> pos(M), jrow(M);
  const int64_t groups = rows_are == DA_ROWS_ARE_QUERIES ? Hq : Hkv;
  for (int64_t grp = 0; grp < groups; ++grp) {
    const int64_t h0 = rows_are == DA_ROWS_ARE_QUERIES ? grp : grp * G;
    const int64_t nh = rows_are == DA_ROWS_ARE_QUERIES ? 1 : G;
    for (int64_t tile = 0; tile < da_num_tiles(&t); tile += tile_step) {
      const int64_t base = da_tile_base(&t, tile);
      if (base >= N) continue;
      const int64_t last = da_tile_last(&t, base, N);
      for (int64_t wp = 0; wp < warps; ++wp)
        for (int64_t i = 0; i < rows_per_warp; ++i) {
          const int64_t p = da_row_position(&t, base, wp, i);
          pos[wp * rows_per_warp + i] = p;
          if (grp == 0 && p < N) seen[p] += 1;
          if (p < N && (p < base || p > last)) {
            snprintf(err, errlen, "row %lld outside [base %lld, last %lld]", (long long)p, (long long)base, (long long)last);
            return 1;
          }
        }
      da_walk st;
      da_walk_begin(&st);
      while (da_walk_candidate(&st, &br, nh, h0, base, last, N, causal, rows_are, pc)) {
        bool any = false;
        for (int64_t m = 0; m < M; ++m) {
          jrow[m] = da_row_index(pos[m], N, st.s, st.w, st.r, st.o);
          any = any || jrow[m] >= 0;
        }
        if (!any) { ++st.s; continue; }
        const int64_t h = h0 + st.gi;
        for (int64_t wp = 0; wp < warps; ++wp) {
          int wany = 0, wall = 1;
          int64_t jmin = INT64_MAX, jmax = -1;
          for (int64_t i = 0; i < rows_per_warp; ++i) {
            const int64_t j = jrow[wp * rows_per_warp + i];
            if (j < 0) { wall = 0; continue; }
            wany = 1;
            jmin = j < jmin ? j : jmin;
            jmax = j > jmax ? j : jmax;
            if (mult != NULL) continue;
            int64_t lo = st.o_begin, hi = st.o_end; /* the row's useful pairs, in closed form */
            if (causal && rows_are == DA_ROWS_ARE_QUERIES && j + off + 1 < hi) hi = j + off + 1;
            if (causal && rows_are == DA_ROWS_ARE_KEYS && j - off > lo) lo = j - off;
            if (hi > lo) work[0] += (double)(hi - lo);
          }
          for (int64_t o0 = st.o_begin; o0 < st.o_end; o0 += other_tile) {
            const int skip = da_chunk_skip(rows_are, causal, o0, other_tile, wany, jmin, jmax, off);
            const int mask = da_chunk_needs_mask(rows_are, causal, o0, other_tile, st.o_end, wall, jmin, jmax, off);
            if (!skip) work[1] += (double)(rows_per_warp * other_tile);
            if (mult == NULL) continue;
            for (int64_t i = 0; i < rows_per_warp; ++i) {
              const int64_t m = wp * rows_per_warp + i;
              for (int64_t jj = 0; jj < other_tile; ++jj) {
                const int64_t j = o0 + jj;
                const int act = da_pair_active(jrow[m], j, st.o_end, causal, rows_are, off);
                if (skip) {
                  if (act) { snprintf(err, errlen, "warp skipped an active pair"); return 1; }
                  continue;
                }
                if (!mask && !act) { snprintf(err, errlen, "an inactive pair was left unmasked"); return 1; }
                if (!act) continue;
                const int64_t x = st.seg_first + j * st.r;
                const int64_t other_n = rows_are == DA_ROWS_ARE_QUERIES ? nk : nq;
                if (x < 0 || x >= other_n) { snprintf(err, errlen, "other position %lld out of range", (long long)x); return 1; }
                const int64_t qp = rows_are == DA_ROWS_ARE_QUERIES ? pos[m] : x;
                const int64_t kp = rows_are == DA_ROWS_ARE_QUERIES ? x : pos[m];
                mult[(h * nq + qp) * nk + kp] += 1;
                work[0] += 1.0;
              }
            }
          }
        }
        ++st.s;
      }
    }
  }
  for (int64_t p = 0; p < N && tile_step == 1; ++p)
    if (seen[p] != 1) {
      snprintf(err, errlen, "position %lld belongs to %lld rows", (long long)p, (long long)seen[p]);
      return 1;
    }
  return 0;
}

extern "C" double da_cost(int64_t N, int64_t nb, const int64_t* w, const int64_t* r, int64_t R,
                          int64_t interleaved, int64_t rows_per_warp, int causal) {
  da_branches br;
  br.n = nb;
  for (int64_t i = 0; i < nb; ++i) { br.w[i] = w[i]; br.r[i] = r[i]; }
  const da_tiling t = R > 0 ? da_make_tiling(N, R, interleaved, 4, rows_per_warp)
                            : da_choose_tiling(N, &br, causal, 4, rows_per_warp);
  return da_tiling_cost(&t, N, &br, causal);
}
"""


@pytest.fixture(scope="module")
def walk_lib(tmp_path_factory):
    """The replay of the kernels' walk, compiled with the host C++ compiler."""
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the replay of the CUDA kernels' walk")
    d = tmp_path_factory.mktemp("walk")
    src, lib = d / "walk.cpp", d / "walk.so"
    src.write_text(_WALK_SOURCE)
    cmd = [
        cxx,
        "-O1",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-Wall",
        "-Werror",
        f"-I{ROOT / 'csrc'}",
        str(src),
        "-o",
        str(lib),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert res.returncode == 0, f"compiling csrc/cuda/tiling.h failed:\n{res.stderr}"
    so = ctypes.CDLL(str(lib))
    i64p = ctypes.POINTER(ctypes.c_int64)
    so.da_replay.restype = ctypes.c_int
    so.da_replay.argtypes = (
        [ctypes.c_int64] * 4
        + [i64p, i64p, ctypes.c_int, ctypes.c_int]
        + [ctypes.c_int64] * 5
        + [i64p, i64p, ctypes.POINTER(ctypes.c_double), ctypes.c_char_p, ctypes.c_int]
    )
    so.da_replay_tile_rows.argtypes = [ctypes.c_int64]
    so.da_replay_piece.argtypes = [ctypes.c_int64] * 3
    so.da_cost.restype = ctypes.c_double
    so.da_cost.argtypes = [ctypes.c_int64, ctypes.c_int64, i64p, i64p] + [ctypes.c_int64] * 3 + [ctypes.c_int]
    return so


def _i64(values):
    arr = (ctypes.c_int64 * max(1, len(values)))(*values)
    return ctypes.cast(arr, ctypes.POINTER(ctypes.c_int64)), arr


def _replay(
    lib, N, Hq, Hkv, segs, rates, causal, rows_are, R, interleaved, rows_per_warp, other_tile, step, mult
):
    w, _w = _i64(segs)
    r, _r = _i64(rates)
    chosen = (ctypes.c_int64 * 2)()
    work = (ctypes.c_double * 2)()
    err = ctypes.create_string_buffer(256)
    i64p = ctypes.POINTER(ctypes.c_int64)
    rc = lib.da_replay(
        N,
        Hq,
        Hkv,
        len(segs),
        w,
        r,
        int(causal),
        rows_are,
        R,
        interleaved,
        rows_per_warp,
        other_tile,
        step,
        None if mult is None else ctypes.cast(mult.data_ptr(), i64p),
        chosen,
        work,
        err,
        256,
    )
    assert rc == 0, err.value.decode()
    return (chosen[0], chosen[1]), (work[0], work[1])


def replay(
    lib, N, Hq, Hkv, segs, rates, causal, rows_are, R=0, interleaved=0, rows_per_warp=16, other_tile=64
):
    """(Hq, N, N) multiplicities visited by the kernels' walk, and (R, interleaved, useful pairs,
    pairs computed)."""
    mult = torch.zeros(Hq * N * N, dtype=torch.int64)
    tiling, work = _replay(
        lib, N, Hq, Hkv, segs, rates, causal, rows_are, R, interleaved, rows_per_warp, other_tile, 1, mult
    )
    return mult.view(Hq, N, N), (*tiling, *work)


def walk_work(lib, N, H, segs, rates, causal, rows_are, R=0, il=0, rpw=16, other_tile=64, tile_step=1):
    """(useful pairs, pairs computed, (R, interleaved)) of the kernels' walk, counted without the
    (N, N) mask, over every tile_step-th thread block."""
    tiling, work = _replay(
        lib, N, H, H, segs, rates, causal, rows_are, R, il, rpw, other_tile, tile_step, None
    )
    return work[0], work[1], tiling


# (N, Hq, Hkv, segment_lengths, dilation_rates)
WALK_CONFIGS = [
    pytest.param(37, 4, 2, [8, 16], [1, 2], id="odd-N-gqa-ragged"),
    pytest.param(50, 6, 3, [5, 10, 20, 40], [1, 2, 3, 4], id="four-branches-ragged"),
    pytest.param(20, 2, 1, [32], [2], id="w-greater-than-N"),
    pytest.param(30, 4, 2, [6, 12], [6, 3], id="r-equals-w"),
    pytest.param(16, 2, 2, [8], [4], id="uncovered-rows"),
    pytest.param(1, 2, 1, [1, 4], [1, 2], id="N-1"),
    pytest.param(96, 4, 1, [8, 8], [1, 1], id="repeated-branch"),
    pytest.param(300, 8, 2, [32, 64, 128, 256], [1, 2, 4, 8], id="longnet-shape"),
    pytest.param(133, 3, 1, [7, 1000], [7, 9], id="huge-w-big-r"),
    pytest.param(70, 1, 1, [1], [1], id="w-1"),
]

# Tilings: automatic choice, and forced (R, interleaved) that cut segments across blocks and warps.
TILINGS = [(0, 0), (1, 1), (3, 0), (4, 1), (64, 0)]


@pytest.mark.parametrize("rows_are", [0, 1], ids=["query-rows", "key-rows"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("N,Hq,Hkv,segs,rates", WALK_CONFIGS)
def test_kernel_walk_visits_every_pair_once(walk_lib, N, Hq, Hkv, segs, rates, is_causal, rows_are):
    """Tensor-core geometry (4 warps x 16 rows, 64 or 16 per chunk) and SIMT geometry (4 x 1..4
    rows, 8..32 per chunk), for several tilings: the pairs visited are the reference's."""
    expected = multiplicity(N, Hq, segs, rates, is_causal)
    geometries = [(16, 64), (16, 16), (4, 32), (1, 8)]
    for R, il in TILINGS:
        for rpw, ot in geometries:
            got, _ = replay(walk_lib, N, Hq, Hkv, segs, rates, is_causal, rows_are, R, il, rpw, ot)
            assert torch.equal(got, expected), (R, il, rpw, ot, (got != expected).nonzero()[:5].tolist())


def test_kernel_walk_random_configs(walk_lib):
    """Random lengths, branches, heads and tilings."""
    g = torch.Generator().manual_seed(7)

    def ri(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    for _ in range(60 if SLOW else 25):
        N = ri(1, 90)
        Hkv = ri(1, 3)
        Hq = Hkv * ri(1, 3)
        nb = ri(1, 4)
        segs = [ri(1, 120) for _ in range(nb)]
        rates = [ri(1, s) for s in segs]
        causal = bool(ri(0, 1))
        rows_are = ri(0, 1)
        R, il = ri(0, 9), ri(0, 1)
        rpw, ot = [(16, 64), (16, 32), (4, 32), (1, 8), (3, 5)][ri(0, 4)]
        got, _ = replay(walk_lib, N, Hq, Hkv, segs, rates, causal, rows_are, R, il, rpw, ot)
        expected = multiplicity(N, Hq, segs, rates, causal)
        assert torch.equal(got, expected), (N, Hq, Hkv, segs, rates, causal, rows_are, R, il, rpw, ot)


def test_kernel_walk_of_packed_sequences(walk_lib):
    """Packed sequences: each sequence's thread blocks run with the tiling of the longest and walk
    their own sequence only; the pairs visited are still the reference's, sequence by sequence."""
    g = torch.Generator().manual_seed(11)

    def ri(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    try:
        for _ in range(30 if SLOW else 12):
            N = ri(1, 80)
            n_max = N + ri(0, 200)
            Hkv = ri(1, 2)
            Hq = Hkv * ri(1, 3)
            nb = ri(1, 3)
            segs = [ri(1, 100) for _ in range(nb)]
            rates = [ri(1, s) for s in segs]
            causal, rows_are = bool(ri(0, 1)), ri(0, 1)
            R, il = ri(0, 9), ri(0, 1)
            rpw, ot = [(16, 64), (4, 32), (1, 8)][ri(0, 2)]
            walk_lib.da_replay_tile_rows(n_max)
            got, _ = replay(walk_lib, N, Hq, Hkv, segs, rates, causal, rows_are, R, il, rpw, ot)
            expected = multiplicity(N, Hq, segs, rates, causal)
            assert torch.equal(got, expected), (N, n_max, Hq, Hkv, segs, rates, causal, rows_are, R, il)
    finally:
        walk_lib.da_replay_tile_rows(0)


def piece_visible(nq, nk, offset):
    """(nq, nk): whether query i sees key j in a piece (offset None: unmasked)."""
    if offset is None:
        return torch.ones(nq, nk, dtype=torch.bool)
    return torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + offset


def test_kernel_walk_of_pieces(walk_lib):
    """A piece (tiling.h da_piece: nq queries over nk keys, key j visible to query i when
    j <= i + offset): the walk visits each visible pair once, with query rows and with key rows,
    including offsets that leave rows without a key (negative) or every key visible (large)."""
    g = torch.Generator().manual_seed(13)

    def ri(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    try:
        for trial in range(60 if SLOW else 24):
            nq, nk = ri(1, 150), ri(1, 150)
            Hkv = ri(1, 2)
            Hq = Hkv * ri(1, 2)
            offset = [None, nk - nq, 0, ri(-nq - 5, nk + 5)][trial % 4]
            rows_are = ri(0, 1)
            R, il = [(0, 0), (1, 0), (1, 1), (ri(2, 5), ri(0, 1))][ri(0, 3)]
            rpw, ot = [(16, 64), (4, 32), (1, 8)][ri(0, 2)]
            walk_lib.da_replay_piece(nq, nk, 0 if offset is None else offset)
            N = nq if rows_are == 0 else nk
            mult = torch.zeros(Hq * nq * nk, dtype=torch.int64)
            _replay(
                walk_lib,
                N,
                Hq,
                Hkv,
                [max(nq, nk)],
                [1],
                offset is not None,
                rows_are,
                R,
                il,
                rpw,
                ot,
                1,
                mult,
            )
            expected = piece_visible(nq, nk, offset).long().expand(Hq, nq, nk)
            assert torch.equal(mult.view(Hq, nq, nk), expected), (nq, nk, Hq, Hkv, offset, rows_are, R, il)
    finally:
        walk_lib.da_replay_piece(0, 0, 0)


def _cost(lib, N, segs, rates, R, il, rpw=16, causal=False):
    w, _w = _i64(segs)
    r, _r = _i64(rates)
    return lib.da_cost(N, len(segs), w, r, R, il, rpw, int(causal))


def test_tiling_choice_for_longnet_branches(walk_lib):
    """LongNet's geometric branches: the chosen tiling is never worse than any candidate tried here,
    and it avoids most of the masked work of consecutive-position blocks (R = 1)."""
    N = 1 << 16
    segs = [2048 << i for i in range(6)]
    rates = [1 << i for i in range(6)]
    for causal in (False, True):
        chosen = _cost(walk_lib, N, segs, rates, 0, 0, causal=causal)
        naive = _cost(walk_lib, N, segs, rates, 1, 0, causal=causal)
        for R in (1, 2, 4, 8, 16, 32, 64, 128):
            for il in (0, 1):
                assert chosen <= _cost(walk_lib, N, segs, rates, R, il, causal=causal) * (1 + 1e-9)
        assert chosen < 0.5 * naive
    # The replay on a shorter sequence with the same shape of branches stays exact.
    n_small = 4096
    segs_s = [64 << i for i in range(5)]
    rates_s = [1 << i for i in range(5)]
    _, tiling = replay(walk_lib, n_small, 1, 1, segs_s, rates_s, True, 0)
    assert tiling[0] >= 1


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_walk_counts_match_the_replay(walk_lib, is_causal):
    """The counting walk (used where the (N, N) mask does not fit) agrees with the full replay."""
    for N, Hq, _, segs, rates in (p.values for p in WALK_CONFIGS[:8]):
        expected = int(multiplicity(N, Hq, segs, rates, is_causal).sum())
        for R, il in TILINGS:
            for rows_are in (0, 1):
                for rpw, ot in [(16, 64), (4, 32)]:
                    _, (_, _, useful_x, computed) = replay(
                        walk_lib, N, Hq, Hq, segs, rates, is_causal, rows_are, R, il, rpw, ot
                    )
                    useful, comp, _ = walk_work(
                        walk_lib, N, Hq, segs, rates, is_causal, rows_are, R, il, rpw, ot
                    )
                    assert (useful, comp) == (expected, computed) and useful_x == expected, (
                        N,
                        segs,
                        rates,
                        R,
                        il,
                        rows_are,
                        rpw,
                        ot,
                    )


# The tensor-core kernels at head dim 64: (name, rows are, keys or queries per chunk).
TC_PASSES = [("forward", 0, 64), ("dq", 0, 64), ("dk/dv", 1, 64)]


@pytest.mark.parametrize("N", [1 << 18, 1 << 20], ids=["256K", "1M"])
def test_chosen_tiling_computes_few_masked_pairs_on_longnet_branches(walk_lib, N):
    """LongNet's branches (w = 2048 * 2^i, r = 2^i), H = 16, the tensor-core geometry: the share of
    the pairs computed on the tensor cores that the branches contain, for the forward and both
    backward passes. Non-causal the chosen tiling wastes nothing; causal, the tiling must keep each
    warp's rows close together so that the per-warp causal skip fires (an interleaved layout gives
    about 0.60 here). At 1M no tiling of these kernels reaches 0.85 (the best, R = 16, gives 0.834:
    the branches with r > 16 leave most rows of an active warp idle), so there the chosen one must
    be within 1 % of the best of every candidate."""
    H = 16
    segs, rates = _load_bench().longnet_branches(N)
    step = 1 if N <= 1 << 18 else 7  # every 7th thread block at 1M (all residues, all offsets)
    causal = {}
    for name, rows_are, ot in TC_PASSES:
        useful, computed, tiling = walk_work(
            walk_lib, N, H, segs, rates, False, rows_are, other_tile=ot, tile_step=step
        )
        assert useful / computed >= 0.99, (name, "full", tiling, useful / computed)
        useful, computed, tiling = walk_work(
            walk_lib, N, H, segs, rates, True, rows_are, other_tile=ot, tile_step=step
        )
        causal[name] = useful / computed
        assert causal[name] >= (0.85 if N <= 1 << 18 else 0.83), (name, "causal", tiling, causal[name])
    if N > 1 << 18:
        best = max(
            u / c
            for R in (1, 2, 4, 8, 16, 32, 64, 128)
            for il in (0, 1)
            for u, c, _ in [walk_work(walk_lib, N, H, segs, rates, True, 0, R, il, tile_step=step)]
        )
        assert causal["forward"] >= 0.99 * best, (causal, best)


# ----------------------------------------------------------------------------------------------
# The kernels themselves, run on the CPU (tests/cuda_emulation)
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    """csrc/cuda's kernels compiled for the CPU emulation (tests/cuda_emulation/run_kernels.cpp)."""
    so = build_emulation("run_kernels", tmp_path_factory.mktemp("emu"), "-O2")
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    head = [ctypes.c_int, ctypes.c_int] + [i64] * 6 + [vp, vp, ctypes.c_int, ctypes.c_double] + [i64] * 4
    so.da_emu_forward.argtypes = head + [vp] * 5 + [ctypes.c_char_p, ctypes.c_int]
    so.da_emu_backward.argtypes = head + [vp] * 10 + [ctypes.c_char_p, ctypes.c_int]
    so.da_emu_options.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_int]
    so.da_emu_varlen.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    so.da_emu_piece.argtypes = [ctypes.c_int64, ctypes.c_int64]
    so.da_emu_lse64.argtypes = [ctypes.c_int]
    so.da_emu_dropout.argtypes = [ctypes.c_double, ctypes.c_int64, ctypes.c_int64]
    so.da_emu_scores.argtypes = [ctypes.c_int]
    so.da_emu_tma.argtypes = [ctypes.c_int]
    yield so
    so.da_emu_options(0, 1, 0)
    so.da_emu_scores(0)


_EMU_DTYPES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}


def _emu_call(fn, dtype, family, q, k, segs, rates, causal, scale, tiling, tensors):
    B, N, Hq, D = q.shape
    w, _w = _i64(segs)
    r, _r = _i64(rates)
    err = ctypes.create_string_buffer(256)
    R, il, rpw, ot = tiling
    ptrs = [0 if t is None else t.data_ptr() for t in tensors]
    rc = fn(
        _EMU_DTYPES[dtype],
        family,
        B,
        N,
        Hq,
        k.shape[2],
        D,
        len(segs),
        ctypes.cast(w, ctypes.c_void_p),
        ctypes.cast(r, ctypes.c_void_p),
        int(causal),
        scale,
        R,
        il,
        rpw,
        ot,
        *ptrs,
        err,
        256,
    )
    assert rc == 0, err.value.decode()


def emulated(
    emu, q, k, v, segs, rates, causal, family, tiling=(0, 0, 4, 32), dout=None, dlse=None, float64_lse=False
):
    """Forward (out, lse) and, given dout, backward (dq, dk, dv) of the CUDA kernels, emulated;
    ``float64_lse``: lse in float64 whatever the dtype, as the op's ``float64_lse=True``."""
    dtype, scale = q.dtype, q.shape[-1] ** -0.5
    B, N, Hq, _ = q.shape
    out = torch.empty_like(q)
    wide = float64_lse or dtype == torch.float64
    lse = torch.empty(B, Hq, N, dtype=torch.float64 if wide else torch.float32)
    emu.da_emu_lse64(int(float64_lse))
    try:
        _emu_call(
            emu.da_emu_forward, dtype, family, q, k, segs, rates, causal, scale, tiling, (q, k, v, out, lse)
        )
        if dout is None:
            return out, lse
        grads = emulated_backward(emu, q, k, v, segs, rates, causal, family, tiling, dout, out, lse, dlse)
    finally:
        emu.da_emu_lse64(0)
    return out, lse, grads


def emulated_backward(emu, q, k, v, segs, rates, causal, family, tiling, dout, out, lse, dlse=None):
    """(dq, dk, dv) of the emulated CUDA kernels for the given out and lse."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _emu_call(
        emu.da_emu_backward,
        q.dtype,
        family,
        q,
        k,
        segs,
        rates,
        causal,
        q.shape[-1] ** -0.5,
        tiling,
        (dout, q, k, v, out, lse, dlse, dq, dk, dv),
    )
    return dq, dk, dv


# Attention dropout's probability (1 / (1 - p) = 1.25 exactly: the kernels' scale is a float, whose
# rounding float64 inputs would otherwise see), seed (both 32-bit halves of the generator's key in
# use) and offset.
DROPOUT_P, DROPOUT_SEED, DROPOUT_OFFSET = 0.2, 0x1234_5678_9ABC, 77


@contextlib.contextmanager
def emulating_dropout(emu, dropout_p):
    """The emulated kernels' calls drop attention weights with probability ``dropout_p`` (seed
    DROPOUT_SEED, offset DROPOUT_OFFSET), forward and backward."""
    emu.da_emu_dropout(dropout_p, DROPOUT_SEED, DROPOUT_OFFSET)
    try:
        yield
    finally:
        emu.da_emu_dropout(0.0, 0, 0)


def dropout_keep(B, H, N, dropout_p):
    """The keep mask (B, H, N, N) of the CPU kernels (the op's dropout_mask) for emulating_dropout,
    or None without dropout."""
    return _ops.dropout_mask(B, H, N, N, dropout_p, DROPOUT_SEED, DROPOUT_OFFSET) if dropout_p else None


def check_emulated(
    emu,
    B,
    N,
    Hq,
    Hkv,
    D,
    segs,
    rates,
    causal,
    dtype,
    family,
    tiling=(0, 0, 4, 32),
    with_dlse=True,
    gain=1.0,
    seed=0,
    float64_lse=False,
    dropout_p=0.0,
):
    """The emulated kernels against the float64 reference under the SPEC section 4 rule; q and k
    are multiplied by ``gain`` (logits of standard deviation about gain**2); ``float64_lse``: the
    forward saves lse in float64 (as the Python layer asks the op to); ``dropout_p``: attention
    dropout, the references applying the CPU kernels' keep mask (dropout_keep)."""
    q, k, v = (t.detach() for t in make_inputs(B, N, Hq, Hkv, D, dtype, seed=seed, device="cpu"))
    q, k, v = (q * gain).contiguous(), (k * gain).contiguous(), v.contiguous()
    g = torch.Generator().manual_seed(11)
    dout = torch.randn(B, N, Hq, D, generator=g, dtype=torch.float64)
    drop = {"keep": dropout_keep(B, Hq, N, dropout_p), "dropout_p": dropout_p}
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    out64, lse64 = reference_attention(q64, k64, v64, segs, rates, causal, **drop)
    ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
    outl, lsel = reference_attention(ql, kl, vl, segs, rates, causal, dtype=dtype, **drop)
    finite = torch.isfinite(lse64)
    dlse = torch.randn(B, Hq, N, generator=g, dtype=torch.float64) * finite if with_dlse else None
    lse_t = torch.float64 if dtype == torch.float64 else torch.float32
    with emulating_dropout(emu, dropout_p):
        out, lse, got = emulated(
            emu,
            q,
            k,
            v,
            segs,
            rates,
            causal,
            family,
            tiling,
            dout.to(dtype).contiguous(),
            None if dlse is None else dlse.to(lse_t).contiguous(),
            float64_lse,
        )
    assert_within_rule("out", out, out64, outl, dtype)
    assert_within_rule("lse", lse, lse64, lsel, dtype)

    def loss(o, chunk):
        total = (o.double() * dout).sum()
        if dlse is not None:
            total = (
                total + (torch.where(finite, chunk.double(), torch.zeros_like(chunk.double())) * dlse).sum()
            )
        return total

    ref = torch.autograd.grad(loss(out64, lse64), (q64, k64, v64))
    plain = torch.autograd.grad(loss(outl, lsel), (ql, kl, vl))
    for name, a, e, p in zip(("dq", "dk", "dv"), got, ref, plain, strict=True):
        assert_within_rule(name, a, e, p, dtype)


# (B, N, Hq, Hkv, D, segment_lengths, dilation_rates, (R, interleaved) or None for the automatic tiling)
EMU_CONFIGS = [
    pytest.param(2, 37, 4, 2, 40, [8, 16], [1, 2], None, id="odd-N-gqa-ragged-D40"),
    pytest.param(1, 300, 4, 1, 64, [64, 256], [1, 2], None, id="long-segments-many-chunks"),
    pytest.param(1, 300, 4, 1, 64, [64, 256], [1, 2], (4, 1), id="interleaved-R4"),
    pytest.param(1, 157, 4, 2, 64, [12, 48, 96], [1, 3, 4], (3, 0), id="R3-segments-cut"),
    pytest.param(1, 157, 4, 2, 32, [12, 48, 96], [1, 3, 4], (1, 1), id="R1-interleaved"),
    pytest.param(1, 90, 2, 1, 96, [7, 200], [1, 5], None, id="w-greater-than-N-D96"),
    pytest.param(1, 80, 2, 2, 128, [32, 64], [1, 2], (16, 1), id="D128-R16"),
    pytest.param(1, 50, 6, 3, 192, [5, 10, 20, 40], [1, 2, 3, 4], None, id="four-branches-D192"),
    pytest.param(1, 70, 1, 1, 256, [64], [1], None, id="D256"),
    pytest.param(1, 16, 2, 2, 32, [8], [4], None, id="uncovered-rows"),
    pytest.param(1, 1, 2, 1, 32, [1, 4], [1, 2], None, id="N-1"),
    pytest.param(1, 96, 4, 1, 32, [8, 8], [1, 1], None, id="repeated-branch"),
    pytest.param(1, 30, 4, 2, 48, [6, 12], [6, 3], None, id="r-equals-w"),
]


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("B,N,Hq,Hkv,D,segs,rates,tiling", EMU_CONFIGS)
def test_emulated_tensor_core_kernels(emu, B, N, Hq, Hkv, D, segs, rates, tiling, is_causal):
    """The sm80 tensor-core kernels (bf16), run on the CPU, against the float64 reference."""
    R, il = tiling or (0, 0)
    check_emulated(emu, B, N, Hq, Hkv, D, segs, rates, is_causal, torch.bfloat16, 0, (R, il, 16, 64))


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("B,N,Hq,Hkv,D,segs,rates,tiling", EMU_CONFIGS)
def test_emulated_sm90_kernels(emu, B, N, Hq, Hkv, D, segs, rates, tiling, is_causal):
    """The sm90 kernels (tensor copies into swizzled shared-memory tiles, wgmma; tc90_kernels.cuh;
    bf16), forward and backward, run on the CPU against the float64 reference: every head dim (the
    128- and 64-byte swizzles), GQA, ragged segments, uncovered rows, N = 1."""
    R, il = tiling or (0, 0)
    check_emulated(emu, B, N, Hq, Hkv, D, segs, rates, is_causal, torch.bfloat16, 2, (R, il, 16, 64))


@pytest.mark.parametrize(
    "is_causal,order,eager,dropout_p",
    [(False, 0, 0, 0.0), (True, 0, 0, 0.0), (True, 2, 1, 0.0), (False, 0, 0, 0.25)],
    ids=["full", "causal", "causal-shuffled-eager", "full-dropout"],
)
def test_emulated_sm90_forward_d256_cycles_its_stages(emu, emu_pipeline, is_causal, order, eager, dropout_p):
    """The sm90 forward at head dim 256 (32 keys a chunk in four stages, tc90_pipe.cuh Tc90FwdCfg):
    segments of up to 256 keys, so that the producer refills every stage several times, with
    reordered threads and early copies, and with dropout, against the float64 reference."""
    assert tc90_tiles(emu_pipeline, 256)[0] == 32
    emu.da_emu_options(order, 778, eager)
    try:
        check_emulated(
            emu, 1, 300, 2, 1, 256, [64, 256], [1, 2], is_causal, torch.bfloat16, 2, (1, 0, 16, 64),
            dropout_p=dropout_p,
        )  # fmt: skip
    finally:
        emu.da_emu_options(0, 1, 0)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_emulated_sm90_kernels_without_tensor_maps(emu, is_causal):
    """The sm90 kernels where no tensor map serves a chunk (every chunk by cp.async, as for rates
    beyond the maps or a stride the copy engine cannot take): the same results. With maps (the
    other tests), chunks reaching past the last whole group of r rows still load by cp.async."""
    emu.da_emu_tma(0)
    try:
        check_emulated(
            emu, 1, 157, 4, 2, 96, [12, 48, 96], [1, 3, 4], is_causal, torch.bfloat16, 2, (3, 0, 16, 64)
        )
        check_emulated(
            emu, 2, 61, 4, 2, 128, [8, 32, 64], [1, 2, 4], is_causal, torch.float16, 2, (0, 0, 16, 64)
        )
    finally:
        emu.da_emu_tma(1)


def tc90_chunks(emu):
    """The chunks that the sm90 kernels' consumer warpgroups skipped and computed since the last
    call, once per warpgroup: ((skipped, computed) of the forward, dq, dk/dv)."""
    out = (ctypes.c_longlong * 6)()
    emu.da_emu_tc90_chunks(out)
    return tuple((out[2 * i], out[2 * i + 1]) for i in range(3))


# (B, N or packed lengths, Hq, Hkv, D, segment_lengths, dilation_rates, (R, interleaved)): causal,
# blocks of 128 consecutive rows (R = 1) whose two warpgroups of 64 lie on both sides of the
# frontier of many chunks, several segments, rates above 1, GQA (dk/dv over two query heads).
EMU_SM90_SKIP_CONFIGS = [
    pytest.param(2, 200, 4, 2, 64, [50, 100, 200], [1, 2, 4], (1, 0), id="three-branches-gqa"),
    pytest.param(1, 300, 2, 1, 32, [300], [3], (1, 0), id="one-segment-r3"),
    pytest.param(1, 260, 2, 2, 128, [128, 260], [1, 2], (2, 0), id="R2-D128"),
    pytest.param(1, [150, 3, 0, 97], 2, 1, 64, [32, 64, 128], [1, 2, 4], (1, 0), id="packed"),
]


@pytest.mark.parametrize("B,N,Hq,Hkv,D,segs,rates,tiling", EMU_SM90_SKIP_CONFIGS)
def test_emulated_sm90_warpgroups_skip_only_chunks_they_do_not_meet(
    emu, B, N, Hq, Hkv, D, segs, rates, tiling
):
    """A consumer warpgroup of the sm90 kernels skips a chunk that none of its 64 rows meets (the
    causal frontier, rows outside a segment) and computes every other: the results stay those of
    the float64 reference where the block's warpgroups work on different chunks, and each pass
    skips some."""
    tc90_chunks(emu)
    R, il = tiling
    if isinstance(N, list):
        check_emulated_varlen(emu, N, Hq, Hkv, D, segs, rates, True, torch.bfloat16, 2, (R, il, 16, 64))
    else:
        check_emulated(emu, B, N, Hq, Hkv, D, segs, rates, True, torch.bfloat16, 2, (R, il, 16, 64))
    for name, (skipped, computed) in zip(("forward", "dq", "dk/dv"), tc90_chunks(emu), strict=True):
        assert skipped > 0 and computed > 0, (name, skipped, computed)


@pytest.mark.parametrize(
    "order,eager", [(1, 0), (2, 0), (2, 1)], ids=["reversed", "shuffled", "shuffled-eager"]
)
def test_emulated_sm90_warpgroup_skips_under_other_schedules(emu, order, eager):
    """Skipped and computed chunks with reordered threads and early copies: a warpgroup releases a
    stage by one arrival (its thread 0), which must come after every warp of it is done with the
    stage, its slot read on skipped chunks too."""
    emu.da_emu_options(order, 777, eager)
    try:
        check_emulated(
            emu, 2, 200, 4, 2, 64, [50, 100, 200], [1, 2, 4], True, torch.bfloat16, 2, (1, 0, 16, 64)
        )
        check_emulated_varlen(
            emu, [150, 3, 0, 97], 2, 1, 64, [32, 64, 128], [1, 2, 4], True, torch.bfloat16, 2, (1, 0, 16, 64)
        )
    finally:
        emu.da_emu_options(0, 1, 0)


def tc90_tiles(emu_pipeline, dp):
    """The sm90 kernels' chunks at padded head dim dp (tc90_pipe.cuh): (forward keys, dq keys, dk/dv
    queries)."""
    out = (ctypes.c_int * 3)()
    assert emu_pipeline.da_emu_tc90_tiles(dp, out) == 0
    return tuple(out)


def expected_tc90_chunks(n, tile, rows_are_queries, is_causal):
    """(skipped, computed) chunks of one pass over one segment of n positions at rate 1 (n a
    multiple of 128), blocks of 128 consecutive rows whose warpgroup g of block t owns rows
    128 t + 64 g .. + 63, chunks of `tile` indices of the other side, counted once per warpgroup.
    The producer walks the chunks that some row of the block meets (causal: queries see the keys up
    to their own, so a block of queries ends at its last row's chunk and a block of keys starts at
    the chunk of its first row); a warpgroup skips those of them that none of its rows meets."""
    skipped = computed = 0
    for t in range(n // 128):
        first, last = 128 * t, 128 * t + 127
        if not is_causal:
            chunks = range(0, n, tile)
        elif rows_are_queries:
            chunks = range(0, last + 1, tile)
        else:
            chunks = range(first // tile * tile, n, tile)
        for g in range(2):
            lo, hi = first + 64 * g, first + 64 * g + 63  # the warpgroup's rows
            for o0 in chunks:
                if not is_causal:
                    meets = True
                elif rows_are_queries:
                    meets = o0 <= hi  # some key of the chunk is at or before a query
                else:
                    meets = o0 + tile - 1 >= lo  # some query of the chunk is at or after a key
                computed += meets
                skipped += not meets
    return skipped, computed


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_emulated_sm90_warpgroup_skip_counts(emu, emu_pipeline, is_causal):
    """The chunks each consumer warpgroup skips, counted: one segment of 256 positions at rate 1,
    head dim 32, blocks of 128 consecutive rows (R = 1), against the count derived from the
    kernels' tile sizes (expected_tc90_chunks). The forward runs twice (the backward's own, for
    delta). Causal, each pass skips some chunks (a block's second warpgroup of keys starts past a
    chunk of queries that its first one meets); without the causal mask every row meets every
    chunk."""
    kt_fwd, kt_dq, qt_dkv = tc90_tiles(emu_pipeline, 32)
    tc90_chunks(emu)
    check_emulated(emu, 1, 256, 1, 1, 32, [256], [1], is_causal, torch.bfloat16, 2, (1, 0, 16, 64))
    fwd, dq, dkv = tc90_chunks(emu)
    want_fwd = expected_tc90_chunks(256, kt_fwd, True, is_causal)
    assert fwd == (2 * want_fwd[0], 2 * want_fwd[1])
    assert dq == expected_tc90_chunks(256, kt_dq, True, is_causal)
    assert dkv == expected_tc90_chunks(256, qt_dkv, False, is_causal)
    if is_causal:
        assert min(fwd[0], dq[0], dkv[0]) > 0


def test_expected_tc90_chunks_counts_by_hand():
    """The derivation of the skip counts against counts made by hand for chunks of 64 and 32: forward
    and dq (rows are queries), block 0 has keys 0-127 (two chunks of 64), its first warpgroup needs
    one; block 1 has four, its first warpgroup needs three: two skips, ten computed. dk/dv with 32
    queries a chunk: block 0 has all eight, its second warpgroup (keys 64-127) skips the two before
    query 64; block 1 the four from query 128, its second warpgroup skips two: four skips, twenty
    computed."""
    assert expected_tc90_chunks(256, 64, True, True) == (2, 10)
    assert expected_tc90_chunks(256, 32, False, True) == (4, 20)
    assert expected_tc90_chunks(256, 64, False, True) == (2, 10)
    assert expected_tc90_chunks(256, 64, True, False) == (0, 16)
    assert expected_tc90_chunks(256, 32, False, False) == (0, 32)


@pytest.fixture(scope="module")
def emu_pipeline(tmp_path_factory):
    """The warp-specialised pattern of the sm90 kernels in small blocks
    (tests/cuda_emulation/run_pipeline.cpp)."""
    so = build_emulation("run_pipeline", tmp_path_factory.mktemp("emu_pipe"))
    so.da_emu_pipeline.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return so


def _pipeline_operands():
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(64, 16, generator=gen).to(torch.float16)
    b = torch.randn(16, 16, generator=gen).to(torch.float16)
    return a, b, a.double() @ b.double().T


def test_emulated_pipeline_producer_to_consumer(emu_pipeline):
    """A producer warp's cp.async copies completing on an mbarrier, a consumer warpgroup waiting,
    fencing and reading them with wgmma: the product against float64."""
    a, b, ref = _pipeline_operands()
    c = torch.full((64, 16), float("nan"), dtype=torch.float32)
    assert emu_pipeline.da_emu_pipeline(0, a.data_ptr(), b.data_ptr(), c.data_ptr()) == 0
    torch.testing.assert_close(c.double(), ref, rtol=1e-3, atol=1e-3)


def test_emulated_pipeline_read_before_the_wait_shows(emu_pipeline):
    """Reading the tile before waiting on its mbarrier reads what was there before the copies (the
    emulation lands them at the wait): the product is wrong, so a kernel that forgets the wait
    fails the tests."""
    a, b, ref = _pipeline_operands()
    c = torch.zeros((64, 16), dtype=torch.float32)
    emu_pipeline.da_emu_pipeline(2, a.data_ptr(), b.data_ptr(), c.data_ptr())
    assert not torch.allclose(c.double(), ref, rtol=1e-3, atol=1e-3, equal_nan=False)


@pytest.mark.parametrize(
    "case,message",
    [
        (1, "without a fence.proxy.async after the wait"),
        (3, "threads gave different thread counts"),
        (4, "setmaxnreg: a count outside"),
        (5, "deadlock"),
    ],
    ids=["no-fence-after-wait", "named-barrier-counts", "setmaxnreg-count", "missing-arrival"],
)
def test_emulated_pipeline_rules(emu_pipeline, case, message):
    """The emulation aborts, naming the rule, where the warp-specialised pattern breaks one: no
    fence.proxy.async between the wait for cp.async copies and the wgmma that reads them, a named
    barrier whose threads disagree on its count, setmaxnreg with a count that is not a multiple of
    8, a producer lane that never arrives (the consumers would hang on a GPU)."""
    code = (
        "import ctypes, sys\n"
        f"so = ctypes.CDLL({emu_pipeline._name!r})\n"
        "so.da_emu_pipeline.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 3\n"
        "a = (ctypes.c_uint16 * 1024)(); b = (ctypes.c_uint16 * 256)(); c = (ctypes.c_float * 1024)()\n"
        f"so.da_emu_pipeline({case}, a, b, c)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert res.returncode != 0, "the broken pattern ran to the end"
    assert message in res.stderr, res.stderr[-2000:]


_N_MAX = 2**30 - 1  # the longest sequence the CUDA entries take (N < 2^30)


def _sm90_tile_rows(n, r, interleaved, tile):
    """The base and the row positions [warp][row] of tile `tile` of n rows under the sm90 blocks'
    tiling (8 warps of 16 rows, stride r; tiling.h's layout), in Python integers."""
    warps, rpw = 8, 16
    per_residue = -(-n // (warps * rpw * r))
    base = (tile % per_residue) * warps * rpw * r + tile // per_residue
    rows = [
        [base + ((i * warps + w) if interleaved else (w * rpw + i)) * r for i in range(rpw)]
        for w in range(warps)
    ]
    return base, rows


@pytest.mark.parametrize(
    "r,interleaved,tile",
    [(1, 0, -1), (3, 1, -1), (2**24, 1, 5), (2**25, 0, 3), (2**29, 1, 1)],
    ids=["R1-last", "R3-interleaved-last", "R2^24", "R2^25", "R2^29"],
)
def test_emulated_sm90_consumer_walk_rows_in_32_bits(emu_pipeline, r, interleaved, tile):
    """The sm90 consumers' walk is 32-bit (tc90_consumer_walk): at N = 2^30 - 1 its rows'
    positions are exact, and a padding row's, which passes 2^31 under a large stride R (base +
    127 R), is held at N instead of wrapping (a wrapped one can be negative, or another row's, and
    would be stored)."""
    n = _N_MAX
    if tile < 0:
        tile = r * -(-n // (128 * r)) - 1
    pos = (ctypes.c_int32 * 512)()
    fields = (ctypes.c_int32 * 3)()
    emu_pipeline.da_emu_tc90_walk_rows.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 2
    assert emu_pipeline.da_emu_tc90_walk_rows(n, r, interleaved, tile, pos, fields) == 0
    base, rows = _sm90_tile_rows(n, r, interleaved, tile)
    assert max(max(w) for w in rows) >= 2**31 or r < 2**25  # the largest strides pass 2^31
    last = base + min(127, (n - 1 - base) // r) * r
    assert list(fields) == [n, base, last]
    want = [
        min(rows[cw][(lane >> 2) + 8 * ri], n) for cw in range(8) for lane in range(32) for ri in range(2)
    ]
    assert list(pos) == want


def test_emulated_sm90_row_offsets_in_64_bits(emu_pipeline):
    """The helpers that store and read the sm90 consumers' rows (tc_fwd_store, tc_dq_store,
    tc_dkv_store, tc_dq_row_stats) form element offsets and lse rows in 64 bits from the 32-bit
    walk: row N - 1 of head 15 of batch entry 1 at N = 2^30 - 1, H = 16, D = 128 (element offsets
    near 2^42, lse rows near 2^35) lands on its row. Nothing that size is allocated: each pointer
    is set back by its row's offset (tests/cuda_emulation/run_pipeline.cpp), so an offset formed in
    32 bits writes or reads elsewhere, or crashes the child process this runs in."""
    n, hq, b, h = _N_MAX, 16, 1, 15
    code = (
        "import ctypes, json, struct\n"
        f"so = ctypes.CDLL({emu_pipeline._name!r})\n"
        "so.da_emu_tc90_row_offsets.argtypes = [ctypes.c_int64] * 5 + [ctypes.c_void_p] * 7\n"
        "bufs = [(ctypes.c_uint16 * 128)() for _ in range(4)]\n"
        "lse = (ctypes.c_float * 1)(); delta = (ctypes.c_float * 1)(0.375); got = (ctypes.c_float * 2)()\n"
        f"rc = so.da_emu_tc90_row_offsets({n}, {hq}, {b}, {h}, {n - 1}, *bufs, lse, delta, got)\n"
        "print(json.dumps([rc] + [list(struct.unpack('128e', bytes(x))) for x in bufs]"
        " + [lse[0], got[0], got[1]]))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert res.returncode == 0, res.stderr[-2000:]
    rc, out, dq, dk, dv, lse, lse2, delta = json.loads(res.stdout)
    assert rc == 0
    cols = range(128)
    assert out == [(d + 1) / 2 for d in cols]  # O / l with l = 2
    assert dq == [(d + 1) * 0.5 for d in cols]  # dQ * scale
    assert dk == [(d + 1) * 0.5 for d in cols]
    assert dv == [float(d + 2) for d in cols]
    assert lse == pytest.approx(math.log(2), rel=1e-6)  # m = 0, l = 2
    assert lse2 == pytest.approx(1.0, rel=1e-6)  # read back in base 2
    assert delta == 0.375


@pytest.mark.parametrize("B,N,Hq,Hkv,D,segs,rates,tiling", EMU_CONFIGS)
def test_emulated_simt_kernels(emu, B, N, Hq, Hkv, D, segs, rates, tiling):
    """The SIMT kernels (float32), run on the CPU, with several rows per warp and chunk sizes."""
    R, il = tiling or (0, 0)
    causal = N % 2 == 1
    rpw, ot = (4, 32) if D <= 64 else (2, 16) if D <= 128 else (1, 8)
    check_emulated(emu, B, N, Hq, Hkv, D, segs, rates, causal, torch.float32, 1, (R, il, rpw, ot))


@pytest.mark.parametrize(
    "dtype,family",
    [(torch.float16, 0), (torch.float16, 2), (torch.bfloat16, 1), (torch.float16, 1), (torch.float64, 1)],
    ids=["tc-fp16", "sm90-fp16", "simt-bf16", "simt-fp16", "simt-fp64"],
)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_emulated_other_dtypes(emu, dtype, family, is_causal):
    check_emulated(
        emu,
        2,
        61,
        4,
        2,
        64,
        [8, 32, 64],
        [1, 2, 4],
        is_causal,
        dtype,
        family,
        (0, 0, 2, 16),
        with_dlse=dtype != torch.float16,
    )


@pytest.mark.parametrize(
    "order,eager",
    [(1, 0), (2, 0), (0, 1), (2, 1)],
    ids=["reversed", "shuffled", "eager-copies", "shuffled-eager"],
)
def test_emulated_kernels_under_other_schedules(emu, order, eager):
    """Reordered threads and cp.async copies landing early: a missing barrier or wait would show
    (the sm90 kernels' wgmma reads its tiles only when its wait retires it, every schedule)."""
    emu.da_emu_options(order, 12345, eager)
    try:
        check_emulated(
            emu, 1, 157, 4, 2, 64, [12, 48, 96], [1, 3, 4], True, torch.bfloat16, 0, (3, 0, 16, 64)
        )
        check_emulated(emu, 1, 95, 2, 1, 40, [12, 48, 96], [1, 3, 4], True, torch.float32, 1, (1, 1, 4, 32))
        check_emulated(
            emu, 1, 157, 4, 2, 96, [12, 48, 96], [1, 3, 4], True, torch.bfloat16, 2, (3, 0, 16, 64)
        )
        if order == 2 and eager:  # the single-buffered dq and dk/dv kernels of the largest head dim
            check_emulated(
                emu, 1, 100, 2, 1, 256, [64, 256], [1, 2], False, torch.bfloat16, 0, (0, 0, 16, 64)
            )
    finally:
        emu.da_emu_options(0, 1, 0)


def test_emulated_nan_stays_in_its_rows(emu):
    """A NaN query poisons only its own row; uncovered rows give out = 0 and lse = -inf."""
    q, k, v = (t.detach().contiguous() for t in make_inputs(1, 32, 2, 2, 32, torch.bfloat16, device="cpu"))
    q[0, 4, 0, 0] = float("nan")  # position 4 is at phase 0: head 0 reads it
    for family in (0, 1, 2):
        out, lse = emulated(emu, q, k, v, [16], [4], False, family, (0, 0, 4, 32))
        assert torch.isnan(out[0, 4, 0]).all() and torch.isnan(lse[0, 0, 4])
        others = torch.ones(32, dtype=torch.bool)
        others[4] = False
        phase = torch.arange(32) % 4
        for h in range(2):
            covered = (phase == h) & others
            assert torch.isfinite(out[0, covered, h]).all() and torch.isfinite(lse[0, h, covered]).all()
            assert (out[0, phase >= 2, h] == 0).all() and torch.isneginf(lse[0, h, phase >= 2]).all()


# float32 accuracy of the SIMT kernels (the CPU kernel's, docs/cpu-kernel.md): the backward
# recomputes the forward's scores bit for bit and turns lse into base 2 in double; long sums go
# in two levels.


@pytest.mark.parametrize(
    "logit_std,is_causal,seed", [(12.0, False, 0), (12.0, True, 0), (16.0, True, 1), (16.0, True, 2)]
)
def test_emulated_simt_float32_large_logits(emu, logit_std, is_causal, seed):
    """Logits of standard deviation 12-16: the probabilities the backward recomputes must be as
    accurate as the forward's, so dk and dv stay within the rule. (At 16 without the causal mask,
    dq of some inputs exceeds it by a few percent: the lse it reads back is rounded to float32,
    which the plain reference, differentiating its softmax, never does.)"""
    check_emulated(
        emu,
        1,
        160,
        2,
        2,
        64,
        [64, 160],
        [1, 2],
        is_causal,
        torch.float32,
        1,
        (0, 0, 4, 32),
        gain=logit_std**0.5,
        seed=seed,
    )


# (seed, N, Hq, Hkv, D, segment_lengths, dilation_rates, is_causal): logits of standard deviation
# about 10 (q times 10), for which the emulated float32 dk and dq exceeded the rule by 28-84% while
# the kernels saved lse in float32 (its rounding went into every probability of the backward).
LARGE_LOGITS = [
    pytest.param(12, 33, 4, 2, 8, [8, 16], [1, 2], True, id="two-branches-causal"),
    pytest.param(33, 64, 1, 1, 16, [8, 16], [1, 2], False, id="two-branches"),
    pytest.param(119, 33, 2, 1, 8, [8], [1], False, id="one-branch-gqa"),
]


def _check_simt_float32_float64_lse(emu, q, k, v, dout, dlse, segs, rates, is_causal):
    """The SIMT kernels in float32 with the float64 lse the op saves for its backward: out, lse and
    every gradient (lse term included, where lse is finite) within the rule."""
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    out64, lse64 = reference_attention(q64, k64, v64, segs, rates, is_causal)
    dlse = dlse * torch.isfinite(lse64)
    ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
    outl, lsel = reference_attention(ql, kl, vl, segs, rates, is_causal, dtype=torch.float32)
    out, lse, got = emulated(
        emu, q, k, v, segs, rates, is_causal, 1, (0, 0, 4, 32), dout.float(), dlse.float(), float64_lse=True
    )
    assert lse.dtype == torch.float64
    assert_within_rule("out", out, out64, outl, torch.float32)
    assert_within_rule("lse", lse, lse64, lsel, torch.float32)

    def loss(o, chunk):
        masked = torch.where(torch.isfinite(chunk), chunk.double(), torch.zeros_like(chunk.double()))
        return (o.double() * dout).sum() + (masked * dlse).sum()

    ref = torch.autograd.grad(loss(out64, lse64), (q64, k64, v64))
    plain = torch.autograd.grad(loss(outl, lsel), (ql, kl, vl))
    for name, a, e, p in zip(("dq", "dk", "dv"), got, ref, plain, strict=True):
        assert_within_rule(name, a, e, p, torch.float32)


@pytest.mark.parametrize("seed,N,Hq,Hkv,D,segs,rates,is_causal", LARGE_LOGITS)
def test_emulated_simt_float32_large_logits_float64_lse(emu, seed, N, Hq, Hkv, D, segs, rates, is_causal):
    """The SIMT kernels with the float64 lse the op saves for its backward (float64_lse=True): the
    backward reads it in base 2 as hi + lo (common.cuh da_lse_base2), and every gradient is within
    the rule."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, N, Hq, D, generator=g, dtype=torch.float64) * 10).float()
    k, v = (torch.randn(1, N, Hkv, D, generator=g, dtype=torch.float64).float() for _ in range(2))
    gd = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(1, N, Hq, D, generator=gd, dtype=torch.float64)
    dlse = torch.randn(1, Hq, N, generator=gd, dtype=torch.float64)
    _check_simt_float32_float64_lse(emu, q, k, v, dout, dlse, segs, rates, is_causal)


# (seed, N, Hq, Hkv, D, segment_lengths, dilation_rates, is_causal, logit std), inputs from one
# generator (q * std, k, v, dout, dlse; tests/op/test_op_large_logits.py SCALED_SCORES): the CPU
# kernel's dk exceeded the rule on them when it scaled the queries before the dot products.
SCALED_SCORES = [
    pytest.param(205, 63, 2, 2, 32, [8, 128], [4, 1], True, 12, id="two-branches-causal-d32"),
    pytest.param(206, 9, 2, 1, 8, [8], [1], True, 10, id="one-branch-gqa-causal"),
    pytest.param(210, 57, 2, 1, 8, [4, 8, 16], [1, 4, 1], True, 12, id="three-branches-causal"),
    # head dim 256: a score summed in float put 1.5-1.9x the rule's bound into dk on the CPU kernel;
    # both kernels now sum a score's products in double (tests/op/test_op_large_logits.py DOUBLE_SCORES)
    pytest.param(305, 53, 2, 2, 256, [53], [1], False, 24, id="one-segment-d256"),
    pytest.param(336, 32, 2, 1, 256, [16], [1], False, 24, id="gqa-d256"),
]


@pytest.mark.parametrize("scores", ["double", "compensated"])
@pytest.mark.parametrize("seed,N,Hq,Hkv,D,segs,rates,is_causal,std", SCALED_SCORES)
def test_emulated_simt_scores_scaled_after_the_dot_product(
    emu, seed, N, Hq, Hkv, D, segs, rates, is_causal, std, scores
):
    """The SIMT kernels' scores are the dot products times scale * log2(e), summed exactly enough
    to round once (in double, or in compensated float where doubles are slow), as the CPU kernel's:
    every gradient within the rule at logit standard deviations of 10-24, head dims up to 256."""
    emu.da_emu_scores(int(scores == "compensated"))
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, N, Hq, D, generator=g, dtype=torch.float64) * std).float()
    k, v = (torch.randn(1, N, Hkv, D, generator=g, dtype=torch.float64).float() for _ in range(2))
    dout = torch.randn(1, N, Hq, D, generator=g, dtype=torch.float64)
    dlse = torch.randn(1, Hq, N, generator=g, dtype=torch.float64)
    try:
        _check_simt_float32_float64_lse(emu, q, k, v, dout, dlse, segs, rates, is_causal)
    finally:
        emu.da_emu_scores(0)


def test_emulated_float64_lse_in_every_family(emu):
    """float64_lse in the tensor-core kernels (bf16) and the SIMT kernels (fp16, fp64) too: the same
    results as with the accumulation dtype's lse, up to that lse's rounding."""
    for dtype, family in ((torch.bfloat16, 0), (torch.float16, 1), (torch.float64, 1)):
        check_emulated(
            emu, 1, 61, 4, 2, 64, [8, 32, 64], [1, 2, 4], True, dtype, family, (0, 0, 2, 16), float64_lse=True
        )


@pytest.mark.parametrize("D", [64, 192])
def test_emulated_sm90_float64_lse(emu, D):
    """float64_lse in the sm90 kernels (bf16): the dk/dv producer copies lse as saved (8 bytes a
    query here, 4 otherwise) and its stats warp turns it into base 2; the same results against the
    float64 reference, with and without tensor maps."""
    for tma in (1, 0):
        emu.da_emu_tma(tma)
        try:
            check_emulated(
                emu,
                1,
                61,
                4,
                2,
                D,
                [8, 32, 64],
                [1, 2, 4],
                True,
                torch.bfloat16,
                2,
                (0, 0, 16, 64),
                float64_lse=True,
            )
        finally:
            emu.da_emu_tma(1)


def test_emulated_simt_float32_long_causal_segment(emu):
    """One causal segment of 2K keys, near-uniform probabilities (q / 20), positive v and dout: the
    sums over the segment (out and lse of the last rows, dk and dv of the first keys) have terms of
    one sign, whose rounding error adds up in a one-level float32 sum; within the rule against
    float64 and plain float32 computations of those rows and keys."""
    N, D = 2048, 16
    q, k, v = (t.detach() for t in make_inputs(1, N, 1, 1, D, torch.float32, seed=N, device="cpu"))
    q, k, v = (q * 0.05).contiguous(), k.contiguous(), v.abs().contiguous()
    dout = torch.full((1, N, 1, D), 64.0, dtype=torch.float64)  # gradients well above the floor
    out, lse, grads = emulated(emu, q, k, v, [N], [1], True, 1, (0, 0, 4, 32), dout.float().contiguous())
    assert_causal_segment_within_rule(q, k, v, dout, out, lse, grads)


def _subsequences_holding(N, Hkv, segs, rates, tainted):
    """inside (Hq, N): the positions of each query head that lie in a dilated sub-sequence (branch,
    segment, head phase) holding a tainted row (tainted (Hq, N)); inside_kv (Hkv, N): the same for
    the key/value rows (any query head of the group)."""
    Hq = tainted.shape[0]
    pos = torch.arange(N)
    inside = torch.zeros(Hq, N, dtype=torch.bool)
    for w, r in zip(segs, rates, strict=True):
        for h in range(Hq):
            covered = pos % w % r == h % r
            for seg in range(-(-N // w)):
                sub = covered & (pos // w == seg)
                if (tainted[h] & sub).any():
                    inside[h] |= sub
    return inside, inside.view(Hkv, Hq // Hkv, N).any(1)


@pytest.mark.parametrize("family", [0, 2], ids=["tensor-cores", "sm90"])
def test_emulated_nonfinite_value_where_warps_of_a_block_mask_differently(emu, family):
    """A segment boundary inside a thread block (non-causal, contiguous rows): in the chunk that
    holds an inf of v, some warps have every row active (no mask) and others none (all masked).
    The value reaches exactly the rows of its segment: a block or warpgroup that sums the chunk on
    CUDA cores must do so in all its warps together (the sm90 kernels' MMAs are collective)."""
    B, N, Hq, Hkv, D = 1, 192, 1, 1, 32
    segs, rates = [96], [1]
    q, k, v = (t.detach().contiguous() for t in make_inputs(B, N, Hq, Hkv, D, torch.bfloat16, device="cpu"))
    dout = torch.randn(B, N, Hq, D, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    bad = v.clone()
    bad[0, 10, 0, 3] = math.inf
    tiling = (1, 0, 16, 64)
    clean_out, _, clean_g = emulated(emu, q, k, v, segs, rates, False, family, tiling, dout)
    out, _, got = emulated(emu, q, k, bad, segs, rates, False, family, tiling, dout)
    assert not torch.isfinite(out[0, :96, 0, 3]).any()
    torch.testing.assert_close(out[0, :96, 0, :3].float(), clean_out[0, :96, 0, :3].float())
    torch.testing.assert_close(out[0, 96:].float(), clean_out[0, 96:].float())
    for name, a, c in zip(("dq", "dk", "dv"), got, clean_g, strict=True):
        assert torch.isfinite(a[0, 96:]).all(), f"{name}: the inf reached the other segment"
        torch.testing.assert_close(a[0, 96:].float(), c[0, 96:].float())


@pytest.mark.parametrize("family", [0, 1, 2], ids=["tensor-cores", "simt", "sm90"])
@pytest.mark.parametrize(
    "tensor,value", [("v", math.inf), ("v", math.nan), ("k", math.nan), ("q", -math.inf)]
)
def test_emulated_nonfinite_value_stays_with_its_readers_under_causal_mask(emu, family, tensor, value):
    """Causal masking, a non-finite value in a chunk whose other pairs are masked: forward, it
    reaches exactly the rows that read it (for v, in its channel); backward, the gradients outside
    the dilated sub-sequences that hold it stay finite and as without it (docs/backends.md). The
    masked pairs' probability is exactly 0 and must not meet the value through 0 * inf."""
    dtype = torch.float32 if family == 1 else torch.bfloat16
    tiling = (0, 0, 4, 32) if family == 1 else (0, 0, 16, 64)
    B, N, Hq, Hkv, D = 1, 96, 4, 2, 32
    segs, rates = [32, 96], [1, 2]
    q, k, v = (t.detach().contiguous() for t in make_inputs(B, N, Hq, Hkv, D, dtype, device="cpu"))
    g = torch.Generator().manual_seed(5)
    dout = torch.randn(B, N, Hq, D, generator=g).to(dtype)
    G = Hq // Hkv
    reads = multiplicity(N, Hq, segs, rates, True) > 0  # (Hq, N, N)
    for x, hk, ch in [(40, 1, 3), (70, 0, 0)]:
        bad = {"q": q, "k": k, "v": v}[tensor].clone()
        bad[0, x, hk if tensor != "q" else hk * G, ch] = value
        args = {"q": q, "k": k, "v": v, tensor: bad}
        clean_out, clean_lse, clean_g = emulated(emu, q, k, v, segs, rates, True, family, tiling, dout)
        out, lse, got = emulated(
            emu, args["q"], args["k"], args["v"], segs, rates, True, family, tiling, dout
        )
        hit = torch.zeros(Hq, N, dtype=torch.bool)
        if tensor == "q":
            hit[hk * G, x] = True
        else:
            for h in range(hk * G, (hk + 1) * G):
                hit[h] = reads[h, :, x]
        assert hit.any()
        rows = hit.T[None]  # (1, N, Hq)
        channels = slice(ch, ch + 1) if tensor == "v" else slice(None)
        assert not torch.isfinite(out[rows][:, channels]).any()
        assert torch.isfinite(out[~rows]).all(), f"{tensor}[{x}] = {value} reached rows that do not read it"
        torch.testing.assert_close(out[~rows].float(), clean_out[~rows].float())
        if tensor != "q":  # the row's other pairs: lse unchanged where it is not read
            torch.testing.assert_close(lse[~hit[None]], clean_lse[~hit[None]])
        tainted = hit.clone()  # the rows that read it, and the value's own row
        tainted[hk * G if tensor == "q" else slice(hk * G, (hk + 1) * G), x] = True
        inside_q, inside_kv = _subsequences_holding(N, Hkv, segs, rates, tainted)
        outside = [(~inside_q).T[None], (~inside_kv).T[None], (~inside_kv).T[None]]
        for name, a, c, o in zip(("dq", "dk", "dv"), got, clean_g, outside, strict=True):
            assert torch.isfinite(a[o]).all(), (
                f"{name}: {tensor}[{x}] = {value} spread outside its sub-sequences"
            )
            torch.testing.assert_close(a[o].float(), c[o].float())


@pytest.mark.parametrize("D", [96, 192, 256])
@pytest.mark.parametrize("tensor,value", [("v", math.inf), ("k", math.nan), ("q", -math.inf)])
def test_emulated_sm90_cuda_core_sums_at_wide_head_dims(emu, tensor, value, D):
    """The sm90 kernels' sums on CUDA cores (tc_gemm_pb_skip_zero, for a chunk whose masked pairs
    meet a non-finite value: the forward's P V for v, dq's dS K for k, dk/dv's dS^T Q for q) at
    head dims whose tiles have panels of 32 columns (96) and whose dk/dv accumulators are split by
    columns over two thread blocks (192, 256). One causal segment, the value at position x: the
    rows of its chunk that never meet it (queries before x for v and k, keys after x for q) are
    summed on CUDA cores with their other pairs, in every column, and must be as without it."""
    N, x, ch = 96, 40, 3
    q, k, v = (t.detach().contiguous() for t in make_inputs(1, N, 1, 1, D, torch.bfloat16, device="cpu"))
    dout = torch.randn(1, N, 1, D, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    args = {"q": q, "k": k, "v": v}
    args[tensor] = args[tensor].clone()
    args[tensor][0, x, 0, ch] = value
    tiling = (0, 0, 16, 64)
    clean_out, clean_lse, clean_g = emulated(emu, q, k, v, [N], [1], True, 2, tiling, dout)
    out, lse, got = emulated(emu, args["q"], args["k"], args["v"], [N], [1], True, 2, tiling, dout)
    if tensor == "q":  # keys after x: no pair with query x (dk, dv); the other queries' rows
        checks = [(got[1][0, x + 1 :], clean_g[1][0, x + 1 :]), (got[2][0, x + 1 :], clean_g[2][0, x + 1 :])]
        rows = torch.arange(N) != x
        checks += [(out[0, rows], clean_out[0, rows]), (got[0][0, rows], clean_g[0][0, rows])]
        assert not torch.isfinite(out[0, x]).all()
    else:  # queries before x: no pair with key x (out, lse, dq)
        checks = [(out[0, :x], clean_out[0, :x]), (lse[0, :, :x], clean_lse[0, :, :x])]
        checks += [(got[0][0, :x], clean_g[0][0, :x])]
        assert not torch.isfinite(out[0, x:, 0, ch] if tensor == "v" else out[0, x:]).any()
    for a, c in checks:
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.float(), c.float())


@pytest.mark.skipif(not SLOW, reason="long sweep: set DILATED_ATTENTION_SLOW=1")
def test_emulated_random_configs(emu):
    g = torch.Generator().manual_seed(3)

    def ri(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    for _ in range(40):
        N, Hkv = ri(1, 160), ri(1, 2)
        Hq = Hkv * ri(1, 3)
        nb = ri(1, 3)
        segs = [ri(1, 200) for _ in range(nb)]
        rates = [ri(1, min(s, 8)) for s in segs]
        family = ri(0, 2)
        D = ri(1, 160) if family == 1 else 8 * ri(4, 32)
        dtype = [torch.float32, torch.float64, torch.bfloat16][ri(0, 2)] if family == 1 else torch.bfloat16
        R, il = [(0, 0), (1, 0), (1, 1), (ri(2, 9), ri(0, 1))][ri(0, 3)]
        rpw, ot = (ri(1, 4), [8, 16, 32][ri(0, 2)]) if family == 1 else (16, 64)
        check_emulated(
            emu, ri(1, 2), N, Hq, Hkv, D, segs, rates, bool(ri(0, 1)), dtype, family, (R, il, rpw, ot)
        )


def check_emulated_varlen(
    emu, lengths, Hq, Hkv, D, segs, rates, causal, dtype, family, tiling, dropout_p=0.0
):
    """Packed sequences through the emulated kernels (one sequence per blockIdx.z) against the
    per-sequence float64 reference under the SPEC section 4 rule, forward and backward;
    ``dropout_p``: attention dropout, the mask read at the rows of the packed tensors."""
    cu_list = [0]
    for n in lengths:
        cu_list.append(cu_list[-1] + n)
    T = cu_list[-1]
    cu = torch.tensor(cu_list, dtype=torch.int32)
    q, k, v = (t.detach().contiguous() for t in make_inputs(1, T, Hq, Hkv, D, dtype, device="cpu"))
    g = torch.Generator().manual_seed(12)
    dout = torch.randn(1, T, Hq, D, generator=g, dtype=torch.float64)
    emu.da_emu_varlen(cu.data_ptr(), len(lengths))
    try:
        with emulating_dropout(emu, dropout_p):
            out, lse, got = emulated(
                emu, q, k, v, segs, rates, causal, family, tiling, dout.to(dtype).contiguous(), None
            )
    finally:
        emu.da_emu_varlen(None, -1)
    drop = {"keep": dropout_keep(1, Hq, T, dropout_p), "dropout_p": dropout_p}
    q64, k64, v64 = (t[0].double().requires_grad_() for t in (q, k, v))
    out64, lse64 = reference_varlen(q64, k64, v64, cu_list, segs, rates, causal, **drop)
    ql, kl, vl = (t[0].clone().requires_grad_() for t in (q, k, v))
    outl, lsel = reference_varlen(ql, kl, vl, cu_list, segs, rates, causal, dtype=dtype, **drop)
    assert_within_rule("out", out[0], out64, outl, dtype)
    assert_within_rule("lse", lse[0], lse64, lsel, dtype)
    ref = torch.autograd.grad((out64 * dout[0]).sum(), (q64, k64, v64))
    plain = torch.autograd.grad((outl.double() * dout[0]).sum(), (ql, kl, vl))
    for name, a, e, p in zip(("dq", "dk", "dv"), got, ref, plain, strict=True):
        assert_within_rule(name, a[0], e, p, dtype)


# (lengths, Hq, Hkv, D, segment_lengths, dilation_rates): empty sequences, length 1, lengths that
# are no multiple of any w, one sequence longer than every w.
EMU_VARLEN_CONFIGS = [
    pytest.param([5, 0, 1, 37, 20], 4, 2, 32, [8, 16], [1, 2], id="empty-and-one-gqa"),
    pytest.param([150, 3, 0, 41], 2, 1, 64, [16, 32, 64], [1, 2, 4], id="longer-than-every-w"),
]


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lengths,Hq,Hkv,D,segs,rates", EMU_VARLEN_CONFIGS)
def test_emulated_kernels_on_packed_sequences(emu, lengths, Hq, Hkv, D, segs, rates, is_causal):
    check_emulated_varlen(emu, lengths, Hq, Hkv, D, segs, rates, is_causal, torch.bfloat16, 0, (0, 0, 16, 64))
    check_emulated_varlen(emu, lengths, Hq, Hkv, D, segs, rates, is_causal, torch.float32, 1, (3, 1, 2, 16))
    check_emulated_varlen(emu, lengths, Hq, Hkv, D, segs, rates, is_causal, torch.bfloat16, 2, (0, 0, 16, 64))


# Attention dropout in the emulated kernels, against references that apply the CPU kernels' keep
# mask (tests/op/test_op_dropout.py checks the CPU kernels the same way): the CUDA kernels must draw
# the identical mask, keyed by the rows of the (B, N, ...) tensors and the head b * Hq + h.

# (B, N, Hq, Hkv, D, segment_lengths, dilation_rates): a batch of two, grouped-query attention, N
# no multiple of any w, three branches; a branch repeated (a key that two branches find is dropped
# or kept as a whole) and w > N.
EMU_DROPOUT_CONFIGS = [
    pytest.param(2, 61, 4, 2, 64, [8, 32, 64], [1, 2, 4], id="three-branches-gqa-B2"),
    pytest.param(1, 45, 2, 1, 32, [16, 16, 90], [1, 1, 3], id="repeated-branch-w-above-N"),
]

# (dtype, kernel family, tiling (R, interleaved, rows per warp, keys or queries per step)).
EMU_DROPOUT_KERNELS = [
    pytest.param(torch.float16, 0, (0, 0, 16, 64), id="tc-fp16"),
    pytest.param(torch.bfloat16, 0, (3, 1, 16, 64), id="tc-bf16-R3-interleaved"),
    pytest.param(torch.bfloat16, 2, (0, 0, 16, 64), id="sm90-bf16"),
    pytest.param(torch.float32, 1, (0, 0, 4, 32), id="simt-fp32"),
    pytest.param(torch.bfloat16, 1, (2, 0, 2, 16), id="simt-bf16-R2"),
    pytest.param(torch.float16, 1, (0, 0, 1, 8), id="simt-fp16"),
    pytest.param(torch.float64, 1, (0, 0, 2, 16), id="simt-fp64"),
]


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype,family,tiling", EMU_DROPOUT_KERNELS)
@pytest.mark.parametrize("B,N,Hq,Hkv,D,segs,rates", EMU_DROPOUT_CONFIGS)
def test_emulated_kernels_with_dropout(emu, B, N, Hq, Hkv, D, segs, rates, dtype, family, tiling, is_causal):
    """out, lse (that of the weights before dropout) and dq, dk, dv with a gradient on lse."""
    check_emulated(
        emu,
        B,
        N,
        Hq,
        Hkv,
        D,
        segs,
        rates,
        is_causal,
        dtype,
        family,
        tiling,
        with_dlse=dtype != torch.float16,
        dropout_p=DROPOUT_P,
    )


@pytest.mark.parametrize("family", [0, 2], ids=["tc", "sm90"])
def test_emulated_dropout_rows_of_one_key(emu, family):
    """Attention dropout where every row has one key (segments of two, rate two) and no gradient
    on lse: P is 1, dq is exactly 0. The forward must not round P / (1 - p) to 16 bits for its product with V while the
    backward uses the exact factor (dq was up to 3.3e-3, above the rule's floor, at head dim 240)."""
    for B in (1, 2):
        check_emulated(
            emu,
            B,
            82,
            6,
            2,
            240,
            [2],
            [2],
            False,
            torch.float16,
            family,
            (1, 0, 16, 64),
            with_dlse=False,
            dropout_p=0.15,
        )


@pytest.mark.parametrize("family", [0, 2], ids=["tc", "sm90"])
def test_emulated_backward_takes_delta_from_the_float32_out(emu, family):
    """Segments of one position: each row attends to itself alone, so dq is exactly 0 and dS is
    f (dout . v) - dout . out, which cancels only with the float32 out (as the host recomputes it
    for float16/bfloat16); delta from the float16 out left 2.2-3.5e-3 in dq, above the rule's
    floor (found by a random sweep of the emulated kernels, float16, dropout 0.2, D = 168)."""
    check_emulated(
        emu,
        1,
        120,
        3,
        1,
        168,
        [1],
        [1],
        True,
        torch.float16,
        family,
        (8, 0, 16, 64),
        with_dlse=False,
        dropout_p=DROPOUT_P,
    )


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_emulated_kernels_with_dropout_on_packed_sequences(emu, is_causal):
    """Packed sequences read the mask at their rows of the (1, T, ...) tensors."""
    lengths, segs, rates = [5, 0, 1, 37, 20], [8, 16], [1, 2]
    check_emulated_varlen(
        emu, lengths, 4, 2, 32, segs, rates, is_causal, torch.bfloat16, 0, (0, 0, 16, 64), dropout_p=DROPOUT_P
    )
    check_emulated_varlen(
        emu, lengths, 4, 2, 32, segs, rates, is_causal, torch.float32, 1, (3, 1, 2, 16), dropout_p=DROPOUT_P
    )


@contextlib.contextmanager
def emulating_piece(emu, nk, offset):
    """The emulated kernels run a piece of the calls' N queries over nk keys (tiling.h da_piece)."""
    emu.da_emu_piece(nk, 0 if offset is None else offset)
    try:
        yield
    finally:
        emu.da_emu_piece(0, 0)


def check_emulated_piece(emu, B, nq, nk, Hq, Hkv, D, offset, dtype, family, tiling, cut=None):
    """A piece through the emulated kernels against the float64 reference (tests/reference.py
    reference_piece) under the SPEC section 4 rule, forward and backward with a gradient on lse.
    With ``cut``, as the ring runs it: the keys in two pieces, their results merged, and each
    piece's backward fed the *merged* out and lse; the shares must sum to the whole's gradients."""
    g = torch.Generator().manual_seed(nq * 1000 + nk)
    q64, k64, v64 = (
        torch.randn(B, n, h, D, generator=g, dtype=torch.float64) for n, h in ((nq, Hq), (nk, Hkv), (nk, Hkv))
    )
    q, k, v = (t.to(dtype).contiguous() for t in (q64, k64, v64))
    dout = torch.randn(B, nq, Hq, D, generator=g, dtype=torch.float64)
    dlse = torch.randn(B, Hq, nq, generator=g, dtype=torch.float64)
    lse_t = torch.float64 if dtype == torch.float64 else torch.float32

    def loss(out, lse):
        finite = torch.isfinite(lse)
        return (out.double() * dout).sum() + (torch.where(finite, lse.double(), 0) * dlse).sum()

    def reference(in_dtype):
        leaves = [t.to(in_dtype).requires_grad_() for t in (q, k, v)]
        out, lse = reference_piece(*leaves, offset, dtype=in_dtype)
        return (out.detach(), lse.detach(), *torch.autograd.grad(loss(out, lse), leaves))

    do, dl = dout.to(dtype).contiguous(), dlse.to(lse_t).contiguous()
    if cut is None:
        with emulating_piece(emu, nk, offset):
            out, lse, grads = emulated(emu, q, k, v, [1], [1], offset is not None, family, tiling, do, dl)
    else:

        def run(lo, hi, off, *backward_args):
            kk, vv = k[:, lo:hi].contiguous(), v[:, lo:hi].contiguous()
            fn = emulated_backward if backward_args else emulated
            with emulating_piece(emu, hi - lo, off):
                return fn(emu, q, kk, vv, [1], [1], off is not None, family, tiling, *backward_args)

        pieces = [(lo, hi, None if offset is None else offset - lo) for lo, hi in ((0, cut), (cut, nk))]
        results = [run(*pc) for pc in pieces]
        out, lse = merge([r[0].to(lse_t) for r in results], [r[1] for r in results])
        out = out.to(dtype).contiguous()
        shares = [run(*pc, do, out, lse, dl) for pc in pieces]
        grads = (
            sum(s[0].double() for s in shares),
            torch.cat([s[1] for s in shares], 1),
            torch.cat([s[2] for s in shares], 1),
        )
    expected, plain = reference(torch.float64), reference(dtype)
    got = (out, lse, *grads)
    for name, a, e, p in zip(("out", "lse", "dq", "dk", "dv"), got, expected, plain, strict=True):
        assert_within_rule(name, a, e, p, dtype)


# (B, nq, nk, Hq, Hkv, D, causal offset): unmasked; the ring's shape (own keys last: offset =
# nk - nq); a square diagonal block (0); rows that see no key (negative offset); an offset past
# nk - nq; few queries over many keys; more queries than keys; offsets far out of range (clamped
# to [-nq, nk] as the host does).
EMU_PIECES = [
    pytest.param(1, 5, 7, 2, 2, 32, None, id="small-unmasked"),
    pytest.param(2, 70, 130, 4, 2, 64, 60, id="own-keys-last-gqa"),
    pytest.param(1, 67, 67, 2, 1, 40, 0, id="diagonal-D40"),
    pytest.param(1, 90, 40, 2, 2, 32, -25, id="rows-without-keys"),
    pytest.param(1, 129, 200, 3, 3, 96, 150, id="offset-past-diagonal-D96"),
    pytest.param(1, 9, 100, 4, 4, 128, None, id="few-queries-D128"),
    pytest.param(1, 150, 20, 2, 1, 32, 5, id="more-queries-than-keys"),
    pytest.param(1, 30, 20, 2, 1, 32, 2**40, id="offset-far-above"),
    pytest.param(1, 30, 20, 2, 1, 32, -(2**40), id="offset-far-below"),
]


@pytest.mark.parametrize("family", [0, 1, 2], ids=["tensor-cores-bf16", "simt-fp32", "sm90-bf16"])
@pytest.mark.parametrize("B,nq,nk,Hq,Hkv,D,offset", EMU_PIECES)
def test_emulated_piece_kernels(emu, B, nq, nk, Hq, Hkv, D, offset, family):
    """The op's CUDA kernels running a piece (dilated_attention::piece_fwd/piece_bwd on CUDA), on
    the CPU, against the float64 reference."""
    dtype, tiling = (torch.float32, (0, 0, 4, 32)) if family == 1 else (torch.bfloat16, (0, 0, 16, 64))
    check_emulated_piece(emu, B, nq, nk, Hq, Hkv, D, offset, dtype, family, tiling)


@pytest.mark.parametrize(
    "dtype,family,tiling",
    [
        (torch.float16, 0, (0, 0, 16, 64)),
        (torch.bfloat16, 0, (3, 1, 16, 64)),
        (torch.float64, 1, (0, 0, 2, 16)),
        (torch.bfloat16, 1, (2, 0, 1, 8)),
        (torch.float16, 2, (0, 0, 16, 64)),
        (torch.bfloat16, 2, (3, 1, 16, 64)),
    ],
    ids=[
        "f16-tc",
        "bf16-tc-R3-interleaved",
        "f64-simt",
        "bf16-simt-R2",
        "f16-sm90",
        "bf16-sm90-R3-interleaved",
    ],
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_emulated_piece_kernels_merged_backward(emu, dtype, family, tiling, causal):
    """The ring's use of the pieces: keys in two pieces, merged, each backward fed the merged
    out and lse; other dtypes and forced tilings."""
    nq, nk = 45, 110
    check_emulated_piece(emu, 1, nq, nk, 4, 2, 32, nk - nq if causal else None, dtype, family, tiling, cut=52)


def _load_bench():
    return load_script(ROOT / "benchmarks" / "bench_cuda.py")


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_benchmark_counts_useful_pairs_like_the_reference(is_causal):
    """The GPU benchmark's FLOP count (SPEC section 3) uses the reference's pair multiplicities."""
    bench = _load_bench()
    for N, Hq, segs, rates in [
        (37, 4, [8, 16], [1, 2]),
        (100, 3, [7, 30, 64], [1, 3, 4]),
        (50, 6, [5, 10, 20, 40], [1, 2, 3, 4]),
        (300, 16, *bench.longnet_branches(300, 32)),
    ]:
        assert attention_pairs(N, Hq, segs, rates, is_causal) == int(
            multiplicity(N, Hq, segs, rates, is_causal).sum()
        )
    segs, rates = bench.longnet_branches(262144)
    assert segs[0] == 2048 and segs[-1] == 262144 and rates == [2**i for i in range(len(segs))]


def test_benchmark_without_gpu_says_so():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_cuda.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert res.returncode != 0 and "no CUDA GPU" in res.stderr


# ----------------------------------------------------------------------------------------------
# The op on a GPU
# ----------------------------------------------------------------------------------------------

# The shared inputs, on the GPU unless a call says device="cpu".
make_inputs = functools.partial(_make_inputs, device="cuda")


def native(q, k, v, segs, rates, *, is_causal=False, softmax_scale=None, return_lse=False):
    """The native op and nothing else: dilated_attention(..., backend="native"), asserting that
    native is what ran (a fallback to another backend would otherwise pass these tests unseen),
    or, for float64, which native declines on CUDA, torch.ops.dilated_attention.fwd itself (its
    autograd formula calls torch.ops.dilated_attention.bwd)."""
    if q.dtype == torch.float64:
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        out, lse = torch.ops.dilated_attention.fwd(q, k, v, list(segs), list(rates), is_causal, scale)
    else:
        out, lse = dattn(
            q,
            k,
            v,
            segs,
            rates,
            is_causal=is_causal,
            softmax_scale=softmax_scale,
            return_lse=True,
            backend="native",
        )
        ran = select_backend("native", q, k).name
        assert ran == "native", f"backend='native' fell back to {ran!r} for {q.device} {q.dtype}"
    return (out, lse) if return_lse else out


HAS_CUDA_KERNEL = has_kernel("cuda")
needs_gpu = needs_cuda_kernels(HAS_CUDA_KERNEL)

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]

# (B, N, Hq, Hkv, D, segment_lengths, dilation_rates)
CONFIGS = [
    pytest.param(1, 16, 1, 1, 32, [4], [1], id="one-branch"),
    pytest.param(2, 37, 4, 2, 40, [8, 16], [1, 2], id="odd-N-gqa-ragged-D40"),
    pytest.param(1, 64, 4, 4, 32, [16, 32, 64], [1, 2, 4], id="three-branches"),
    pytest.param(2, 50, 6, 3, 24, [5, 10, 20, 40], [1, 2, 3, 4], id="four-branches-ragged-D24"),
    pytest.param(1, 20, 2, 1, 64, [32], [2], id="w-greater-than-N"),
    pytest.param(1, 30, 4, 2, 16, [6, 12], [6, 3], id="r-equals-w"),
    pytest.param(1, 129, 8, 2, 64, [32, 64, 128], [1, 2, 4], id="blocks-span-segments"),
    pytest.param(1, 16, 2, 2, 32, [8], [4], id="uncovered-rows"),
    pytest.param(1, 9, 2, 1, 1, [4], [2], id="head-dim-1"),
    pytest.param(1, 70, 1, 1, 256, [64], [1], id="head-dim-256"),
    pytest.param(3, 200, 2, 1, 128, [64, 256], [2, 8], id="batch-3-long"),
    pytest.param(1, 1, 2, 1, 32, [1, 4], [1, 2], id="N-1"),
    pytest.param(2, 96, 4, 1, 96, [8, 8], [1, 1], id="repeated-branch-D96"),
    pytest.param(1, 300, 8, 2, 64, [32, 64, 128, 256], [1, 2, 4, 8], id="longnet-shape"),
]


def check_against_reference(B, N, Hq, Hkv, D, segs, rates, is_causal, dtype, seed=0):
    q, k, v = make_inputs(B, N, Hq, Hkv, D, dtype, seed=seed)
    out, lse = native(q, k, v, segs, rates, is_causal=is_causal, return_lse=True)
    assert out.is_cuda and out.dtype == dtype and out.shape == q.shape and out.is_contiguous()
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert lse.shape == (B, Hq, N)

    q64, k64, v64 = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    out64, lse64 = reference_attention(q64, k64, v64, segs, rates, is_causal)
    ql, kl, vl = (t.detach().cpu().clone().requires_grad_() for t in (q, k, v))
    outl, lsel = reference_attention(ql, kl, vl, segs, rates, is_causal, dtype=dtype)
    assert_within_rule("out", out.cpu(), out64, outl, dtype)
    assert_within_rule("lse", lse.cpu(), lse64, lsel, dtype)

    g = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    dlse = torch.randn(lse.shape, generator=g, dtype=torch.float64) if dtype != torch.float16 else None
    got = grads(out, lse, (q, k, v), dout.cuda(), None if dlse is None else dlse.cuda())
    ref = grads(out64, lse64, (q64, k64, v64), dout, dlse)
    plain = grads(outl, lsel, (ql, kl, vl), dout, dlse)
    for name, a, e, p in zip(("dq", "dk", "dv"), got, ref, plain, strict=True):
        assert a.is_cuda and a.dtype == dtype
        assert_within_rule(name, a.cpu(), e, p, dtype)


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("B,N,Hq,Hkv,D,segs,rates", CONFIGS)
def test_matches_reference(B, N, Hq, Hkv, D, segs, rates, is_causal, dtype):
    check_against_reference(B, N, Hq, Hkv, D, segs, rates, is_causal, dtype)


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("D", [32, 48, 64, 80, 96, 128, 136, 160, 192, 200, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_head_dims(D, dtype):
    check_against_reference(1, 75, 4, 2, D, [16, 32], [1, 2], True, dtype)


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("kernels", ["auto", "simt"])
@pytest.mark.parametrize("tiling", [None, "1,0", "1,1", "3,0", "4,1", "16,1", "64,0"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_forced_tilings_and_kernels(monkeypatch, kernels, tiling, dtype):
    """Tilings that cut segments across thread blocks and warps, on both kernel families."""
    if tiling is not None:
        monkeypatch.setenv("DILATED_ATTENTION_CUDA_TILING", tiling)
    monkeypatch.setenv("DILATED_ATTENTION_CUDA_SIMT", "1" if kernels == "simt" else "0")
    check_against_reference(2, 157, 4, 2, 64, [12, 48, 96], [1, 3, 4], True, dtype)
    check_against_reference(1, 90, 2, 1, 32, [7, 200], [1, 5], False, dtype)


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_and_cuda_agree(dtype):
    B, N, Hq, Hkv, D, segs, rates = 2, 133, 8, 2, 64, [16, 32, 64], [1, 2, 4]
    q, k, v = make_inputs(B, N, Hq, Hkv, D, dtype, device="cpu")
    qc, kc, vc = (t.detach().cuda().requires_grad_() for t in (q, k, v))
    for causal in (False, True):
        out, lse = native(q, k, v, segs, rates, is_causal=causal, return_lse=True)
        outc, lsec = native(qc, kc, vc, segs, rates, is_causal=causal, return_lse=True)
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        out64, lse64 = reference_attention(q64, k64, v64, segs, rates, causal)
        ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
        outl, lsel = reference_attention(ql, kl, vl, segs, rates, causal, dtype=dtype)
        # Both within the rule, so they agree to within twice the rule of each other.
        assert_within_rule("cpu out", out, out64, outl, dtype)
        assert_within_rule("cuda out", outc.cpu(), out64, outl, dtype)
        assert_within_rule("cpu lse", lse, lse64, lsel, dtype)
        assert_within_rule("cuda lse", lsec.cpu(), lse64, lsel, dtype)
        dout = torch.randn_like(out)
        g_cpu = torch.autograd.grad(out, (q, k, v), dout)
        g_gpu = torch.autograd.grad(outc, (qc, kc, vc), dout.cuda())
        g_ref = torch.autograd.grad(out64, (q64, k64, v64), dout.double())
        g_pl = torch.autograd.grad(outl, (ql, kl, vl), dout)
        for name, a, b, e, p in zip(("dq", "dk", "dv"), g_cpu, g_gpu, g_ref, g_pl, strict=True):
            assert_within_rule(f"cpu {name}", a, e, p, dtype)
            assert_within_rule(f"cuda {name}", b.cpu(), e, p, dtype)


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_opcheck(dtype):
    q, k, v = make_inputs(2, 19, 4, 2, 32, dtype)
    args = (q, k, v, [4, 8], [1, 2], True, 0.35)
    torch.library.opcheck(torch.ops.dilated_attention.fwd.default, args)
    out, lse = torch.ops.dilated_attention.fwd(*args)
    dout = torch.randn_like(out)
    bargs = (
        dout,
        q.detach(),
        k.detach(),
        v.detach(),
        out.detach(),
        lse.detach(),
        None,
        [4, 8],
        [1, 2],
        True,
        0.35,
    )
    torch.library.opcheck(torch.ops.dilated_attention.bwd.default, bargs)


@needs_gpu
@pytest.mark.cuda
def test_gradcheck_float64():
    q, k, v = make_inputs(1, 11, 4, 2, 3, torch.float64, seed=5)

    def f(q, k, v):
        return native(q, k, v, [4, 8], [1, 2], is_causal=True, return_lse=True)

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-6)


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_torch_compile_fullgraph(dtype):
    q, k, v = make_inputs(1, 65, 4, 2, 64, dtype)

    def f(q, k, v):
        return dattn(q, k, v, [16, 32], [1, 2], is_causal=True, backend="native").float().square().sum()

    compiled = torch.compile(f, fullgraph=True)
    loss = compiled(q, k, v)
    got = torch.autograd.grad(loss, (q, k, v))
    loss_e = f(q, k, v)
    expected = torch.autograd.grad(loss_e, (q, k, v))
    torch.testing.assert_close(loss, loss_e)
    assert select_backend("native", q, k).name == "native"
    for a, e in zip(got, expected, strict=True):
        torch.testing.assert_close(a, e)


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_backward_is_bitwise_reproducible(dtype):
    """The backward owns every output row in one thread block: no atomics, same bits every run."""
    q, k, v = make_inputs(2, 300, 8, 2, 64, dtype)
    dout = torch.randn(q.shape, device="cuda", dtype=dtype)
    runs = []
    for _ in range(3):
        out = native(q, k, v, [32, 64, 128], [1, 2, 4], is_causal=True)
        runs.append(torch.autograd.grad(out, (q, k, v), dout))
    for later in runs[1:]:
        for a, b in zip(runs[0], later, strict=True):
            assert torch.equal(a, b)


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize(
    "dtype,scale", [(torch.float32, 1e39), (torch.bfloat16, -1e39), (torch.float16, 3e38)]
)
def test_raw_ops_refuse_a_scale_the_scores_cannot_hold(dtype, scale):
    """As on the CPU (tests/op/test_op.py): the CUDA entries share checks.h's scale rule."""
    q = torch.randn(1, 8, 2, 32, device="cuda", dtype=dtype)
    cu = torch.tensor([0, 8], dtype=torch.int32, device="cuda")
    want = r"softmax_scale must be finite in the compute dtype float32 .*got " + re.escape(repr(scale))
    for call in (
        lambda: torch.ops.dilated_attention.fwd(q, q, q, [4], [1], False, scale),
        lambda: torch.ops.dilated_attention.varlen_fwd(q[0], q[0], q[0], cu, 8, [4], [1], False, scale),
        lambda: torch.ops.dilated_attention.piece_fwd(q, q, q, True, 0, scale),
    ):
        with pytest.raises(ValueError, match=want):
            call()


def assert_dropout_within_rule(out, lse, inputs, reference, dtype, dlse=True):
    """out, lse and the gradients (autograd through the op's backward, with a gradient on lse
    unless ``dlse`` is False) of a CUDA call with dropout against ``reference(q, k, v, dtype)``, the
    reference applying the same keep mask, run in float64 and in ``dtype``, under the rule."""
    leaves64 = tuple(t.detach().cpu().double().requires_grad_() for t in inputs)
    plain = tuple(t.detach().cpu().clone().requires_grad_() for t in inputs)
    out64, lse64 = reference(*leaves64, torch.float64)
    outl, lsel = reference(*plain, dtype)
    assert_within_rule("out", out.cpu(), out64, outl, dtype)
    assert_within_rule("lse", lse.cpu(), lse64, lsel, dtype)  # that of the weights before dropout
    g = torch.Generator().manual_seed(1)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    dl = torch.randn(lse.shape, generator=g, dtype=torch.float64) if dlse else None
    got = grads(out, lse, inputs, dout.cuda(), None if dl is None else dl.cuda())
    ref = grads(out64, lse64, leaves64, dout, dl)
    pl = grads(outl, lsel, plain, dout, dl)
    for name, a, e, p in zip(("dq", "dk", "dv"), got, ref, pl, strict=True):
        assert_within_rule(name, a.cpu(), e, p, dtype)


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("kernels", ["auto", "simt"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_dropout_matches_the_masked_reference(monkeypatch, kernels, dtype, is_causal):
    """The CUDA kernels drop the weights that the CPU kernels' mask drops (_ops.dropout_mask), in
    both kernel families: a batch of two, grouped-query attention, N no multiple of any w."""
    monkeypatch.setenv("DILATED_ATTENTION_CUDA_SIMT", "1" if kernels == "simt" else "0")
    B, N, Hq, Hkv, D, segs, rates = 2, 133, 8, 2, 64, [16, 32, 64], [1, 2, 4]
    q, k, v = make_inputs(B, N, Hq, Hkv, D, dtype)
    drop = (DROPOUT_P, DROPOUT_SEED, DROPOUT_OFFSET)
    out, lse = torch.ops.dilated_attention.fwd(q, k, v, segs, rates, is_causal, D**-0.5, False, *drop)
    keep = dropout_keep(B, Hq, N, DROPOUT_P)

    def reference(q, k, v, dt):
        return reference_attention(q, k, v, segs, rates, is_causal, dtype=dt, keep=keep, dropout_p=DROPOUT_P)

    assert_dropout_within_rule(out, lse, (q, k, v), reference, dtype, dlse=dtype != torch.float16)


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("kernels", ["auto", "simt"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_dropout_on_packed_sequences_reads_the_packed_rows(monkeypatch, kernels, is_causal):
    """varlen_fwd/varlen_bwd with dropout: sequence i reads the mask at its rows of the (1, T, ...)
    tensors, as on the CPU."""
    monkeypatch.setenv("DILATED_ATTENTION_CUDA_SIMT", "1" if kernels == "simt" else "0")
    lengths, Hq, Hkv, D, segs, rates = [5, 0, 1, 137, 20, 64], 4, 2, 64, [8, 32, 128], [1, 2, 4]
    cu_list = [0, *itertools.accumulate(lengths)]
    T, dtype = cu_list[-1], torch.bfloat16
    cu = torch.tensor(cu_list, dtype=torch.int32, device="cuda")
    q, k, v = (t[0].detach().requires_grad_() for t in make_inputs(1, T, Hq, Hkv, D, dtype))
    drop = (DROPOUT_P, DROPOUT_SEED, DROPOUT_OFFSET)
    out, lse = torch.ops.dilated_attention.varlen_fwd(
        q, k, v, cu, max(lengths), segs, rates, is_causal, D**-0.5, False, *drop
    )
    keep = dropout_keep(1, Hq, T, DROPOUT_P)

    def reference(q, k, v, dt):
        return reference_varlen(
            q, k, v, cu_list, segs, rates, is_causal, dtype=dt, keep=keep, dropout_p=DROPOUT_P
        )

    assert_dropout_within_rule(out, lse, (q, k, v), reference, dtype)


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_cpu_and_cuda_drop_the_same_weights(is_causal):
    """float64 on both devices (CUDA: the SIMT kernels) with the same seed and offset: the same
    output and gradients to float64 rounding, which a single weight dropped on one device only
    would exceed by far."""
    B, N, Hq, Hkv, D, segs, rates = 2, 90, 4, 2, 32, [16, 48], [1, 3]
    q, k, v = make_inputs(B, N, Hq, Hkv, D, torch.float64, device="cpu")
    qc, kc, vc = (t.detach().cuda().requires_grad_() for t in (q, k, v))
    args = (segs, rates, is_causal, 0.3, False, DROPOUT_P, DROPOUT_SEED, DROPOUT_OFFSET)
    out, lse = torch.ops.dilated_attention.fwd(q, k, v, *args)
    outc, lsec = torch.ops.dilated_attention.fwd(qc, kc, vc, *args)
    torch.testing.assert_close(outc.cpu(), out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lsec.cpu(), lse, rtol=1e-10, atol=1e-10)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    for a, b in zip(
        torch.autograd.grad(out, (q, k, v), dout),
        torch.autograd.grad(outc, (qc, kc, vc), dout.cuda()),
        strict=True,
    ):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-9, atol=1e-9)


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_native_runs_dropout_on_cuda(dtype):
    """backend="native" with dropout_p > 0 runs the CUDA kernels (no fallback, no warning); seed and
    offset come from torch's generator, so torch.manual_seed reproduces a run, forward and backward."""
    q, k, v = make_inputs(1, 64, 4, 2, 32, dtype)

    def run(seed):
        torch.manual_seed(seed)
        out = dattn(q, k, v, [16, 32], [1, 2], is_causal=True, dropout_p=DROPOUT_P, backend="native")
        return out, torch.autograd.grad(out.float().square().sum(), (q, k, v))

    with warnings.catch_warnings():
        warnings.simplefilter("error", dilated_attention.DilatedAttentionWarning)
        (a, ga), (b, gb), (c, _) = run(0), run(0), run(1)
    assert select_backend("native", q, k, dropout_p=DROPOUT_P).name == "native"
    assert torch.equal(a, b) and not torch.equal(a, c)
    for x, y in zip(ga, gb, strict=True):
        assert torch.equal(x, y) and torch.isfinite(x).all()


@needs_gpu
@pytest.mark.cuda
def test_uncovered_rows_are_zero_with_neg_inf_lse():
    q, k, v = make_inputs(1, 16, 2, 2, 32, torch.bfloat16)
    out, lse = native(q, k, v, [8], [4], return_lse=True)
    phase = (torch.arange(16, device="cuda") % 8) % 4
    for h in range(2):
        covered = phase == h
        assert torch.isfinite(lse[0, h, covered]).all()
        assert torch.isneginf(lse[0, h, ~covered]).all()
        assert (out[0, ~covered, h] == 0).all()
    out.float().sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_non_contiguous_and_misaligned_inputs(dtype):
    B, N, H, D = 2, 45, 4, 64
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, N, D, generator=g).to("cuda", dtype).transpose(1, 2)  # (B, N, H, D) view
    k = torch.randn(B, N, H, D + 1, generator=g).to("cuda", dtype)[..., 1:]  # misaligned rows
    v = torch.randn(B, N, H, 2 * D, generator=g).to("cuda", dtype)[..., ::2]  # strided last dim
    q.requires_grad_()
    out, lse = native(q, k, v, [8, 32], [1, 4], softmax_scale=0.3, return_lse=True, is_causal=True)
    q64, k64, v64 = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    out64, lse64 = reference_attention(q64, k64, v64, [8, 32], [1, 4], True, softmax_scale=0.3)
    outl, lsel = reference_attention(
        *(t.detach().cpu() for t in (q, k, v)), [8, 32], [1, 4], True, softmax_scale=0.3, dtype=dtype
    )
    assert_within_rule("out", out.cpu(), out64, outl, dtype)
    assert_within_rule("lse", lse.cpu(), lse64, lsel, dtype)


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("kernels", ["auto", "simt"])
def test_nan_propagates_to_its_own_rows(monkeypatch, kernels):
    monkeypatch.setenv("DILATED_ATTENTION_CUDA_SIMT", "1" if kernels == "simt" else "0")
    q, k, v = make_inputs(1, 16, 2, 2, 32, torch.bfloat16, requires_grad=False)
    q[0, 3, 0, 0] = float("nan")
    k[0, 5, 1, 1] = float("inf")
    out, lse = native(q, k, v, [8], [1], return_lse=True)
    assert torch.isnan(out[0, 3, 0]).all() and torch.isnan(lse[0, 0, 3])
    assert torch.isfinite(out[0, 8:, 0]).all()  # another segment is untouched
    assert not torch.isfinite(out[0, :8, 1]).all()


@needs_gpu
@pytest.mark.cuda
def test_empty_inputs_and_errors():
    q = torch.randn(0, 8, 2, 32, device="cuda")
    out, lse = torch.ops.dilated_attention.fwd(q, q, q, [4], [1], False, 1.0)
    assert out.shape == q.shape and lse.shape == (0, 2, 8)
    q = torch.randn(1, 8, 2, 32, device="cuda")
    with pytest.raises(RuntimeError, match="same device"):
        torch.ops.dilated_attention.fwd(q, q.cpu(), q, [4], [1], False, 1.0)
    with pytest.raises(RuntimeError, match="head dim"):
        x = torch.randn(1, 8, 2, 257, device="cuda")
        torch.ops.dilated_attention.fwd(x, x, x, [4], [1], False, 1.0)
    with pytest.raises(RuntimeError, match="DILATED_ATTENTION_CUDA_TILING"):
        os.environ["DILATED_ATTENTION_CUDA_TILING"] = "zero"
        try:
            torch.ops.dilated_attention.fwd(q, q, q, [4], [1], False, 1.0)
        finally:
            del os.environ["DILATED_ATTENTION_CUDA_TILING"]


@needs_gpu
@pytest.mark.cuda
def test_current_stream_and_other_device_index():
    """Runs on the current stream of the tensors' device."""
    q, k, v = make_inputs(1, 64, 2, 2, 64, torch.bfloat16, requires_grad=False)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        out = native(q, k, v, [16], [1])
    s.synchronize()
    ref = native(q, k, v, [16], [1])
    assert torch.equal(out, ref)


@needs_gpu
@pytest.mark.cuda
@pytest.mark.skipif(not SLOW, reason="long sweep: set DILATED_ATTENTION_SLOW=1")
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_longnet_branches_against_cpu_kernel(is_causal):
    """A LongNet-shaped problem too long for the dense reference: CUDA (bf16) against the CPU
    kernel in float64 (itself tested against the reference), with the bf16 tolerance."""
    B, N, Hq, Hkv, D = 1, 8192, 8, 8, 64
    segs, rates = [512, 1024, 2048, 4096, 8192], [1, 2, 4, 8, 16]
    q, k, v = make_inputs(B, N, Hq, Hkv, D, torch.bfloat16, requires_grad=True)
    out, lse = native(q, k, v, segs, rates, is_causal=is_causal, return_lse=True)
    q64, k64, v64 = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    out64, lse64 = native(q64, k64, v64, segs, rates, is_causal=is_causal, return_lse=True)
    torch.testing.assert_close(out.cpu().double(), out64, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.cpu().double(), lse64, atol=2e-2, rtol=1e-3)
    dout = torch.randn(q.shape, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), dout.cuda().bfloat16())
    ref = torch.autograd.grad(out64, (q64, k64, v64), dout)
    for a, e in zip(got, ref, strict=True):
        torch.testing.assert_close(a.cpu().double(), e, atol=5e-2, rtol=5e-2)


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_packed_sequences_match_reference(dtype, is_causal):
    """The varlen op on the GPU against the per-sequence float64 reference, and the CPU op."""
    from dilated_attention import dilated_attention_varlen

    lengths, Hq, Hkv, D, segs, rates = [5, 0, 1, 137, 20, 64], 4, 2, 64, [8, 32, 128], [1, 2, 4]
    cu_list = [0]
    for n in lengths:
        cu_list.append(cu_list[-1] + n)
    T = cu_list[-1]
    cu = torch.tensor(cu_list, dtype=torch.int32, device="cuda")
    q, k, v = (t[0].detach().requires_grad_() for t in make_inputs(1, T, Hq, Hkv, D, dtype))
    out, lse = dilated_attention_varlen(
        q, k, v, cu, max(lengths), segs, rates, is_causal=is_causal, return_lse=True, backend="native"
    )
    assert out.is_cuda and out.shape == (T, Hq, D) and lse.shape == (Hq, T)
    q64, k64, v64 = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    out64, lse64 = reference_varlen(q64, k64, v64, cu_list, segs, rates, is_causal)
    ql, kl, vl = (t.detach().cpu().clone().requires_grad_() for t in (q, k, v))
    outl, lsel = reference_varlen(ql, kl, vl, cu_list, segs, rates, is_causal, dtype=dtype)
    assert_within_rule("out", out.cpu(), out64, outl, dtype)
    assert_within_rule("lse", lse.cpu(), lse64, lsel, dtype)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = grads(out, lse, (q, k, v), dout.cuda(), None)
    ref = grads(out64, lse64, (q64, k64, v64), dout, None)
    plain = grads(outl, lsel, (ql, kl, vl), dout, None)
    for name, a, e, p in zip(("dq", "dk", "dv"), got, ref, plain, strict=True):
        assert_within_rule(name, a.cpu(), e, p, dtype)
    with pytest.raises(RuntimeError, match="cu_seqlens must be on q's device"):
        torch.ops.dilated_attention.varlen_fwd(q, k, v, cu.cpu(), 137, segs, rates, False, 0.1)
    with pytest.raises(RuntimeError, match="non-decreasing"):
        bad = cu.clone()
        bad[2] = 1000
        torch.ops.dilated_attention.varlen_fwd(q, k, v, bad, 137, segs, rates, False, 0.1)

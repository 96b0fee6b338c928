// A CPU emulation of the few CUDA features the kernels of csrc/cuda use, so that the kernels
// themselves (not a re-implementation) can be run and checked on a machine without a GPU. Test
// tooling only: tests/test_cuda.py compiles run_kernels.cpp with the host C++ compiler and
// -DDA_CUDA_EMULATION; nothing here is part of the extension.
//
// Every CUDA thread of a block is a fiber (ucontext) of one OS thread; the fibers of a block run
// round-robin and switch only at synchronisation points:
//   * __syncthreads / __syncthreads_or: a block barrier;
//   * warp collectives (__shfl*_sync, __any_sync, __all_sync, __syncwarp, ldmatrix, mma.sync): every lane posts
//     its operand and waits; the last lane to arrive computes every lane's result. All lanes must
//     issue the same collective (checked: a divergent warp aborts with a message).
// cp.async copies land only when a cp.async.wait_group lets them (or at once, on request), and
// the order in which threads run between synchronisation points can be reversed or shuffled, so
// that a missing wait or barrier changes the results. Shared memory is filled with NaN bytes
// before each block and global buffers are guarded by the caller, so reads of unwritten data and
// stray writes show up too.
//
// ldmatrix and mma.sync follow the fragment layouts of the PTX ISA ("Matrix Fragments for
// mma.m16n8k16 with floating point type", "Warp-level matrix load instruction: ldmatrix"); mma
// accumulates in float.
//
// sm90 (wgmma.h): the warpgroup MMA wgmma.mma_async m64nNk16 (f32 accumulators, f16/bf16 inputs,
// A from a shared-memory descriptor or from registers, B from a descriptor, K-major or, with
// imm-trans-b, MN-major) is a collective of the 128 threads of a warpgroup. It is asynchronous as
// on the GPU: an issued MMA reads shared memory, the accumulators' old values and writes the new
// ones only when a wgmma.wait_group retires its group, so that reading the accumulators or
// overwriting a tile too early changes the results; A registers changed before the retirement
// abort. Descriptors are decoded as the PTX ISA's
// "Matrix Descriptor Format" and canonical layouts describe them (start address, leading and
// stride byte offsets, no swizzle or a 32/64/128-byte swizzle, which XORs address bits [4, 4 + b)
// with bits [7, 7 + b) of the shared-memory address); a wgmma that reads shared memory after a
// thread's cp.async copies landed without a fence.proxy.async since aborts.
//
// mbarriers count arrivals and announced bytes per phase; a tensor copy (cp.async.bulk.tensor,
// TMA) of a box of up to five dimensions (zeros outside the tensor's dimensions, written
// swizzled as its map says) completes its bytes on an mbarrier when a thread waits on that
// barrier (or at once, with eager copies), so that reading a tile before the wait shows. A
// thread's cp.async copies can complete on an mbarrier instead (cp.async.mbarrier.arrive: they
// land when a thread waits there); a thread that passes the wait of such a phase must execute
// fence.proxy.async before its warpgroup's wgmma reads shared memory.
//
// Warp-specialised blocks: up to 384 threads (three warpgroups); named barriers (bar.sync /
// bar.red.or with an id and a thread count) synchronise a subset of the block; setmaxnreg is a
// warpgroup collective (its count checked, no effect here).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

#include <cmath>
#include <functional>
#include <vector>

#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif

static inline int min(int a, int b) {
  return a < b ? a : b;
}
static inline int max(int a, int b) {
  return a > b ? a : b;
}

namespace da_emu {

constexpr int kMaxThreads = 384;
constexpr size_t kSharedBytes = 232448;  // sm90's opt-in maximum
// The block's dynamic shared memory starts 16 bytes into its window, as the runtime guarantees
// no more alignment than that: a kernel that aligns further must budget for it in its size.
constexpr size_t kDynamicOffset = 16;
constexpr size_t kStackBytes = 256 * 1024;

enum Op { kShflXor = 1, kShfl, kAny, kAll, kLdsm, kLdsmT, kMmaF16, kMmaBF16 };

// Warpgroup collectives (sm90).
enum WgOp { kWgFence = 1, kWgMma, kWgCommit, kWgWait, kWgSetmaxnreg };

struct Slot {
  int op;
  uint64_t in[8];
  uint64_t out[4];
};

struct Warp {
  int arrived = 0;
  unsigned gen = 0;
  Slot slot[32];
};

struct Copy {
  void* dst;
  const void* src;  // nullptr: zero-fill
  int bytes = 16;   // 16 (cp.async.cg), or 4 and 8 (cp.async.ca)
};

// Switching between fibers. On x86-64 a few instructions that save the callee-saved registers
// and the stack pointer (ucontext's swapcontext makes a system call per switch, far slower);
// elsewhere ucontext.
#if defined(__x86_64__) && defined(__linux__)
#define DA_EMU_FAST_SWITCH 1
extern "C" void da_emu_switch(void** save_sp, void* load_sp);
asm(R"(
    .text
    .globl da_emu_switch
    .hidden da_emu_switch
    .type da_emu_switch, @function
da_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size da_emu_switch, .-da_emu_switch
)");
#else
#define DA_EMU_FAST_SWITCH 0
#endif

struct Fiber {
  ucontext_t ctx;
  void* sp = nullptr;  // saved stack pointer (fast switch)
  std::vector<char> stack;
  uint3 tid;
  bool done = false;
  std::vector<std::vector<Copy>> groups;  // committed cp.async groups, oldest first
  std::vector<Copy> open;                 // issued, not yet committed
  bool unfenced = false;                  // cp.async copies landed since the last fence.proxy.async
  bool observed = false;  // passed an mbarrier phase that cp.async copies completed, not fenced since
  // Where the thread waits, for the deadlock message (formatted only then): kind 0 nowhere yet, 1 a
  // barrier (a = id, b = threads), 2 a warp collective (a = op), 3 an mbarrier (a = address, b = parity).
  struct Wait {
    int kind = 0;
    uint32_t a = 0, b = 0;
    bool operator==(const Wait& o) const { return kind == o.kind && a == o.a && b == o.b; }
  } waits;
};

// One thread's part of a wgmma.mma_async: its accumulators (read and written when the MMA
// retires), its A fragment when A comes from registers (taken at issue), and the operands that
// must be the same in the whole warpgroup.
struct WgPost {
  int op;
  int arg;  // wait_group's N
  float* acc;
  uint32_t a[4];
  const uint32_t* a_regs_at;  // where the A fragment lives: it must not change until the wait
  bool a_regs, bf16, trans_b;
  int n, scale_d;
  uint64_t desc_a, desc_b;
};

struct WgMma {
  WgPost t[128];
};

struct Warpgroup {
  int arrived = 0;
  unsigned gen = 0;
  WgPost post[128];
  std::vector<WgMma> open;                 // issued, not yet committed
  std::vector<std::vector<WgMma>> groups;  // committed, oldest first
};

// How the emulation schedules: the order in which fibers run between synchronisation points
// (0: by thread index, 1: reversed, 2: a random permutation each round) and whether cp.async
// copies land when issued (eager) or only when a cp.async.wait_group lets them (lazy, default).
struct Options {
  int order = 0;
  unsigned seed = 1;
  bool eager_copies = false;
  bool compensated_scores = false;  // the SIMT kernels' float scores as on a GPU with slow doubles
};

inline Options& options() {
  static Options o;
  return o;
}

struct Block {
  int nthreads = 0;
  int current = 0;
  ucontext_t sched;
  std::vector<Fiber> fibers;
  Warp warps[kMaxThreads / 32];
  Warpgroup warpgroups[kMaxThreads / 128];
  struct Named {  // barrier 0 (__syncthreads) and the named barriers 1..15
    int arrived = 0, count = 0, por = 0, result = 0;
    unsigned gen = 0;
  } named[16];
  uint64_t progress = 0;
  void* sched_sp = nullptr;
  std::function<void()> body;
  alignas(1024) unsigned char shared[kSharedBytes];
  uint3 block_idx;
  dim3 grid_dim, block_dim;
  size_t smem_bytes =
      kSharedBytes - kDynamicOffset;  // the launch's dynamic shared memory: accesses past it abort
};

inline Block& block() {
  static Block* b = new Block();
  return *b;
}

inline void mbars_reset();   // (below) a new block's mbarriers
inline void mbars_report();  // (below) their state, for the deadlock message
inline bool mbars_idle();    // (below) no tensor copy left unwaited

[[noreturn]] inline void fail(const char* what) {
  fprintf(stderr, "cuda emulation: %s\n", what);
  fflush(stderr);
  abort();
}

inline Fiber& self() {
  return block().fibers[block().current];
}

inline void yield() {
#if DA_EMU_FAST_SWITCH
  da_emu_switch(&self().sp, block().sched_sp);
#else
  swapcontext(&self().ctx, &block().sched);
#endif
}

inline void entry() {
  Block& b = block();
  b.body();
  b.fibers[b.current].done = true;
  b.progress++;
}

#if DA_EMU_FAST_SWITCH
[[noreturn]] inline void trampoline() {
  entry();
  for (;;) yield();  // a finished fiber is never resumed
}

// A fresh fiber's stack: six zero registers, then trampoline's address for `ret`, placed so that
// trampoline starts with the stack alignment of a called function (rsp = 8 mod 16).
inline void* initial_sp(std::vector<char>& stack) {
  uintptr_t top = ((uintptr_t)stack.data() + stack.size()) & ~(uintptr_t)15;
  uintptr_t* a = (uintptr_t*)(top - 16);
  a[0] = (uintptr_t)&trampoline;
  for (int i = 1; i <= 6; ++i) a[-i] = 0;
  return (void*)(a - 6);
}
#endif

// Runs body() once per thread of one block (grid position block_idx).
inline void run_block(dim3 grid, dim3 block_idx, int nthreads, const std::function<void()>& body,
                      size_t smem_bytes = kSharedBytes - kDynamicOffset) {
  Block& b = block();
  b.smem_bytes = smem_bytes;
  if (nthreads > kMaxThreads || nthreads % 32) fail("unsupported block size");
  b.nthreads = nthreads;
  b.body = body;
  b.block_idx = make_uint3(block_idx.x, block_idx.y, block_idx.z);
  b.grid_dim = grid;
  b.block_dim = dim3(nthreads, 1, 1);
  for (auto& n : b.named) n = Block::Named();
  for (auto& w : b.warps) w.arrived = 0;
  for (auto& g : b.warpgroups) {
    g.arrived = 0;
    g.open.clear();
    g.groups.clear();
  }
  mbars_reset();
  memset(b.shared, 0xff, sizeof(b.shared));  // NaN in every float type: unwritten reads show
  b.fibers.resize(nthreads);
  for (int t = 0; t < nthreads; ++t) {
    Fiber& f = b.fibers[t];
    f.stack.resize(kStackBytes);
    f.tid = make_uint3(t, 0, 0);
    f.done = false;
    f.groups.clear();
    f.open.clear();
    f.unfenced = false;
    f.observed = false;
    f.waits = Fiber::Wait();
#if DA_EMU_FAST_SWITCH
    f.sp = initial_sp(f.stack);
#else
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = f.stack.size();
    f.ctx.uc_link = &b.sched;
    makecontext(&f.ctx, (void (*)())entry, 0);
#endif
  }
  std::vector<int> order(nthreads);
  for (int t = 0; t < nthreads; ++t) order[t] = options().order == 1 ? nthreads - 1 - t : t;
  for (;;) {
    bool live = false;
    const uint64_t before = b.progress;
    if (options().order == 2)
      for (int i = nthreads - 1; i > 0; --i) {  // Fisher-Yates with a small LCG
        options().seed = options().seed * 1103515245u + 12345u;
        const int j = (int)((options().seed >> 8) % (unsigned)(i + 1));
        const int tmp = order[i];
        order[i] = order[j];
        order[j] = tmp;
      }
    for (int t : order) {
      if (b.fibers[t].done) continue;
      live = true;
      b.current = t;
#if DA_EMU_FAST_SWITCH
      da_emu_switch(&b.sched_sp, b.fibers[t].sp);
#else
      swapcontext(&b.sched, &b.fibers[t].ctx);
#endif
    }
    if (!live) {
      for (const auto& g : b.warpgroups)
        if (!g.open.empty() || !g.groups.empty()) fail("a block ended with wgmma operations not waited for");
      if (!mbars_idle()) fail("a block ended with tensor copies that no thread waited for");
      for (const auto& n : b.named)
        if (n.arrived) fail("a block ended with threads waiting at a named barrier");
      break;
    }
    if (b.progress == before) {
      for (int t = 0; t < nthreads; ++t)  // each live thread whose wait differs from the previous one's
        if (!b.fibers[t].done && (t == 0 || !(b.fibers[t].waits == b.fibers[t - 1].waits))) {
          const Fiber::Wait& w = b.fibers[t].waits;
          fprintf(stderr, "cuda emulation: thread %d (warp %d) waits at ", t, t / 32);
          if (w.kind == 1) fprintf(stderr, "barrier %u of %u threads\n", w.a, w.b);
          if (w.kind == 2) fprintf(stderr, "a warp collective (op %u)\n", w.a);
          if (w.kind == 3) fprintf(stderr, "the mbarrier at %u, parity %u\n", w.a, w.b);
          if (w.kind == 0) fprintf(stderr, "no synchronisation yet\n");
        }
      mbars_report();
      fail("deadlock: every thread waits at a barrier that nobody completes");
    }
  }
}

// Barrier `id` of `count` threads (0: __syncthreads, the whole block; 1..15: named barriers, a
// multiple of 32 threads, the same in every arrival of a generation); returns the OR of pred over
// them.
inline int barrier_of(int id, int count, int pred) {
  Block& b = block();
  Block::Named& n = b.named[id];
  if (n.arrived == 0) n.count = count;
  if (n.count != count) fail("named barrier: threads gave different thread counts");
  const unsigned gen = n.gen;
  self().waits = Fiber::Wait{1, (uint32_t)id, (uint32_t)count};
  n.por |= pred ? 1 : 0;
  if (++n.arrived == n.count) {
    n.arrived = 0;
    n.result = n.por;
    n.por = 0;
    n.gen++;
    b.progress++;
  } else {
    while (n.gen == gen) yield();
  }
  return n.result;
}

// Block barrier; returns the OR of pred over the block.
inline int barrier(int pred) {
  return barrier_of(0, block().nthreads, pred);
}

inline int named_barrier(int id, int count, int pred) {
  if (id < 1 || id > 15) fail("named barrier: an id outside 1..15");
  if (count <= 0 || count % 32 || count > block().nthreads)
    fail("named barrier: a thread count that is not a multiple of 32");
  return barrier_of(id, count, pred);
}

inline float bits_to_float(uint16_t h, bool bf16) {
  if (bf16) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
  }
  __half x;
  memcpy(&x, &h, 2);
  return __half2float(x);
}

inline uint16_t half_at(uint64_t reg, int which) {
  return (uint16_t)((uint32_t)reg >> (16 * which));
}

// The results of one warp collective, for every lane, from the posted operands.
inline void compute(Slot* s) {
  const int op = s[0].op;
  for (int l = 0; l < 32; ++l)
    if (s[l].op != op) fail("divergent warp: lanes issued different collectives");
  for (int l = 0; l < 32; ++l) {
    Slot& o = s[l];
    switch (op) {
      case kShflXor: o.out[0] = s[l ^ (int)s[l].in[1]].in[0]; break;
      case kShfl: o.out[0] = s[(int)s[l].in[1] & 31].in[0]; break;
      case kAny: {
        int any = 0;
        for (int j = 0; j < 32; ++j) any |= s[j].in[0] != 0;
        o.out[0] = any;
        break;
      }
      case kAll: {
        int all = 1;
        for (int j = 0; j < 32; ++j) all &= s[j].in[0] != 0;
        o.out[0] = all;
        break;
      }
      case kLdsm:
        for (int i = 0; i < 4; ++i) {
          const unsigned char* row = (const unsigned char*)(uintptr_t)s[8 * i + l / 4].in[0];
          uint32_t v;
          memcpy(&v, row + (l % 4) * 4, 4);
          o.out[i] = v;
        }
        break;
      case kLdsmT:
        for (int i = 0; i < 4; ++i) {
          const unsigned char* r0 = (const unsigned char*)(uintptr_t)s[8 * i + 2 * (l % 4)].in[0];
          const unsigned char* r1 = (const unsigned char*)(uintptr_t)s[8 * i + 2 * (l % 4) + 1].in[0];
          uint16_t lo, hi;
          memcpy(&lo, r0 + (l / 4) * 2, 2);
          memcpy(&hi, r1 + (l / 4) * 2, 2);
          o.out[i] = (uint32_t)lo | ((uint32_t)hi << 16);
        }
        break;
      case kMmaF16:
      case kMmaBF16: {
        const bool bf = op == kMmaBF16;
        const int g = l / 4, t = l % 4;
        for (int e = 0; e < 4; ++e) {
          const int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
          float acc = 0.f;
          for (int k = 0; k < 16; ++k) {
            // A (16x16): lane (row % 8) * 4 + (k % 8) / 2, register (row >= 8) + 2 (k >= 8).
            const Slot& sa = s[(row % 8) * 4 + (k % 8) / 2];
            const float a = bits_to_float(half_at(sa.in[(row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)], k % 2), bf);
            // B (16x8): lane col * 4 + (k % 8) / 2, register b0 (k < 8) or b1.
            const Slot& sb = s[col * 4 + (k % 8) / 2];
            const float b = bits_to_float(half_at(sb.in[4 + (k >= 8 ? 1 : 0)], k % 2), bf);
            acc += a * b;
          }
          float c;  // the lane's accumulators, posted as 16 bytes from in[6]
          memcpy(&c, (const char*)&s[l].in[6] + 4 * e, 4);
          const float d = c + acc;
          uint32_t u;
          memcpy(&u, &d, 4);
          o.out[e] = u;
        }
        break;
      }
      default: fail("unknown collective");
    }
  }
}

// Posts this lane's operands; returns this lane's results (slot.out).
inline const Slot& collective(const Slot& mine) {
  Block& b = block();
  const int t = self().tid.x;
  Warp& w = b.warps[t / 32];
  w.slot[t % 32] = mine;
  const unsigned gen = w.gen;
  self().waits = Fiber::Wait{2, (uint32_t)mine.op, 0};
  if (++w.arrived == 32) {
    compute(w.slot);
    w.arrived = 0;
    w.gen++;
    b.progress++;
  } else {
    while (w.gen == gen) yield();
  }
  return w.slot[t % 32];
}

template <typename V>
inline uint64_t to_bits(V v) {
  uint64_t u = 0;
  memcpy(&u, &v, sizeof(V));
  return u;
}

template <typename V>
inline V from_bits(uint64_t u) {
  V v;
  memcpy(&v, &u, sizeof(V));
  return v;
}

inline unsigned char* shared_memory() {
  return block().shared + kDynamicOffset;
}

// The end of the launch's dynamic shared memory.
inline const unsigned char* shared_limit() {
  return block().shared + kDynamicOffset + block().smem_bytes;
}

// The bytes of a cp.async copy (zeros without a source).
inline void write_copy(const Copy& c) {
  if (c.src)
    memcpy(c.dst, c.src, c.bytes);
  else
    memset(c.dst, 0, c.bytes);
}

// A copy landing for the thread that waits for its own cp.async groups.
inline void land(const Copy& c) {
  self().unfenced = true;
  write_copy(c);
}

// cp.async of 16 bytes, or 4 or 8 (zero-fill when src is null), commit_group and wait_group(n).
inline void cp_async(void* dst, const void* src, int bytes = 16) {
  const unsigned char* d = (const unsigned char*)dst;
  if (d >= block().shared && d + bytes > shared_limit())
    fail("cp.async past the launch's dynamic shared memory");
  if (options().eager_copies)
    land(Copy{dst, src, bytes});
  else
    self().open.push_back(Copy{dst, src, bytes});
}

inline void cp_commit() {
  Fiber& f = self();
  f.groups.push_back(f.open);
  f.open.clear();
}

inline void cp_wait(int n) {
  Fiber& f = self();
  while ((int)f.groups.size() > n) {
    for (const Copy& c : f.groups.front()) land(c);
    f.groups.erase(f.groups.begin());
  }
}

template <typename V>
inline V shfl(int op, V v, int arg) {
  Slot s{};
  s.op = op;
  s.in[0] = to_bits(v);
  s.in[1] = (uint64_t)arg;
  return from_bits<V>(collective(s).out[0]);
}

inline bool vote(int op, bool pred) {
  Slot s{};
  s.op = op;
  s.in[0] = pred ? 1 : 0;
  return collective(s).out[0] != 0;
}

inline void ldsm(uint32_t (&r)[4], const void* p, bool trans) {
  Slot s{};
  s.op = trans ? kLdsmT : kLdsm;
  s.in[0] = (uint64_t)(uintptr_t)p;
  const Slot& o = collective(s);
  for (int i = 0; i < 4; ++i) r[i] = (uint32_t)o.out[i];
}

inline void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, bool bf16) {
  Slot s{};
  s.op = bf16 ? kMmaBF16 : kMmaF16;
  for (int i = 0; i < 4; ++i) s.in[i] = a[i];
  s.in[4] = b0;
  s.in[5] = b1;
  memcpy(&s.in[6], c, 16);
  const Slot& o = collective(s);
  for (int i = 0; i < 4; ++i) c[i] = from_bits<float>(o.out[i]);
}

/* sm90: warpgroup MMA ---------------------------------------------------------------------- */

// The shared-memory address (offset in the block's shared memory) of a pointer into it.
inline uint32_t shared_address(const void* p) {
  const unsigned char* c = (const unsigned char*)p;
  if (c < block().shared || c >= block().shared + kSharedBytes) fail("not a shared-memory address");
  if (c >= block().shared + block().smem_bytes)
    fail("a shared-memory address past the launch's dynamic size");
  return (uint32_t)(c - block().shared);
}

inline void fence_proxy_async() {
  self().unfenced = false;
  self().observed = false;
}

// The byte address of element (mn, k) of a wgmma operand (mn: the row of A or the column of B;
// k: the reduction index, 0..15) from its matrix descriptor, in the canonical layouts of the PTX
// ISA (as CUTLASS writes them, in units of 16 bytes, T = 8 elements of 16 bits):
//   K-major,  no swizzle:    ((8, m), (T, 2)) : ((1T, SBO), (1, LBO))
//   K-major,  W-byte swizzle: ((8, m), (T, 2)) : ((W/16 T, SBO), (1, T))
//   MN-major, no swizzle:    ((T, 1, m), (8, k)) : ((1, T, SBO), (1T, LBO))
//   MN-major, W-byte swizzle: ((T, W/16, m), (8, k)) : ((1, T, LBO), (W/16 T, SBO))
// then the swizzle: address bits [4, 4 + b) XOR bits [7, 7 + b), b = log2(W / 16).
inline uint32_t operand_address(uint64_t desc, int mn, int k, bool mn_major) {
  const uint32_t start = (uint32_t)(desc & 0x3fff) << 4;
  const uint32_t lbo = (uint32_t)((desc >> 16) & 0x3fff) << 4;
  const uint32_t sbo = (uint32_t)((desc >> 32) & 0x3fff) << 4;
  if ((desc >> 49) & 7) fail("wgmma descriptor: a matrix base offset other than 0 is not emulated");
  const int mode = (int)(desc >> 62);  // 0 none, 1 128-byte, 2 64-byte, 3 32-byte swizzle
  const uint32_t W = mode == 1 ? 128 : mode == 2 ? 64 : mode == 3 ? 32 : 16;
  const uint32_t bits = mode == 1 ? 3 : mode == 2 ? 2 : mode == 3 ? 1 : 0;
  uint32_t a;
  if (!mn_major) {
    if (mode == 0)
      a = start + (mn / 8) * sbo + (mn % 8) * 16 + (k / 8) * lbo + (k % 8) * 2;
    else
      a = start + (mn / 8) * sbo + (mn % 8) * W + k * 2;
  } else {
    if (mode == 0)
      a = start + (mn / 8) * sbo + (mn % 8) * 2 + (k % 8) * 16 + (k / 8) * lbo;
    else
      a = start + (mn / (W / 2)) * lbo + (mn % (W / 2)) * 2 + (k % 8) * W + (k / 8) * sbo;
  }
  if (bits) a ^= ((a >> 7) & ((1u << bits) - 1)) << 4;
  if (block().shared + a + 2 > shared_limit())
    fail("wgmma descriptor: an operand outside the launch's shared memory");
  return a;
}

inline float operand(uint64_t desc, int mn, int k, bool mn_major, bool bf16) {
  uint16_t h;
  memcpy(&h, block().shared + operand_address(desc, mn, k, mn_major), 2);
  return bits_to_float(h, bf16);
}

// Retires one MMA: D (64 x n) = A (64 x 16) B (16 x n) (+ D when scale_d), every thread's
// accumulator fragment: element 4 i + e is row 16 warp + lane / 4 + 8 (e / 2), column
// 8 i + 2 (lane % 4) + e % 2 (the mma.m16n8 C layout per warp and 8 columns).
inline void retire(const WgMma& op) {
  const WgPost& z = op.t[0];
  if (z.a_regs)
    for (int t = 0; t < 128; ++t)
      if (memcmp(op.t[t].a_regs_at, op.t[t].a, sizeof(op.t[t].a)) != 0)
        fail("wgmma: its A registers changed before wgmma.wait_group retired it");
  std::vector<float> A(64 * 16), Bm(16 * z.n);
  for (int row = 0; row < 64; ++row)
    for (int k = 0; k < 16; ++k) {
      if (z.a_regs) {  // the mma.m16n8k16 A fragment of warp row / 16
        const int w = row / 16, r = row % 16;
        const WgPost& t = op.t[32 * w + (r % 8) * 4 + (k % 8) / 2];
        A[row * 16 + k] = bits_to_float(half_at(t.a[(r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)], k % 2), z.bf16);
      } else {
        A[row * 16 + k] = operand(z.desc_a, row, k, false, z.bf16);
      }
    }
  for (int k = 0; k < 16; ++k)
    for (int c = 0; c < z.n; ++c) Bm[k * z.n + c] = operand(z.desc_b, c, k, z.trans_b, z.bf16);
  for (int t = 0; t < 128; ++t) {
    const int w = t / 32, l = t % 32;
    for (int i = 0; i < z.n / 8; ++i)
      for (int e = 0; e < 4; ++e) {
        const int row = 16 * w + l / 4 + 8 * (e >> 1), col = 8 * i + 2 * (l % 4) + (e & 1);
        float acc = 0.f;
        for (int k = 0; k < 16; ++k) acc += A[row * 16 + k] * Bm[k * z.n + col];
        float& d = op.t[t].acc[4 * i + e];
        d = z.scale_d ? d + acc : acc;
      }
  }
}

// A warpgroup collective: every thread of the warpgroup posts; the last one to arrive acts.
inline void warpgroup_collective(const WgPost& mine) {
  Block& b = block();
  const int t = self().tid.x;
  Warpgroup& g = b.warpgroups[t / 128];
  g.post[t % 128] = mine;
  const unsigned gen = g.gen;
  if (++g.arrived < 128) {
    while (g.gen == gen) yield();
    return;
  }
  const WgPost& z = g.post[0];
  for (int i = 0; i < 128; ++i)
    if (g.post[i].op != z.op) fail("divergent warpgroup: threads issued different wgmma instructions");
  switch (z.op) {
    case kWgFence: break;
    case kWgSetmaxnreg:
      for (int i = 0; i < 128; ++i)
        if (g.post[i].arg != z.arg) fail("setmaxnreg: threads of the warpgroup gave different counts");
      if (z.arg < 24 || z.arg > 256 || z.arg % 8)
        fail("setmaxnreg: a count outside 24..256 or not a multiple of 8");
      break;
    case kWgMma: {
      for (int i = 0; i < 128; ++i) {
        const WgPost& o = g.post[i];
        if (o.n != z.n || o.a_regs != z.a_regs || o.bf16 != z.bf16 || o.trans_b != z.trans_b ||
            o.scale_d != z.scale_d || o.desc_b != z.desc_b || (!z.a_regs && o.desc_a != z.desc_a))
          fail("wgmma: threads of the warpgroup gave different operands");
      }
      for (int i = 0; i < 128; ++i) {  // the warpgroup's threads
        const Fiber& f = b.fibers[128 * (t / 128) + i];
        if (f.unfenced) fail("wgmma reads shared memory that cp.async wrote without a fence.proxy.async");
        if (f.observed)
          fail(
              "wgmma reads shared memory that cp.async wrote (completing on an mbarrier) without a "
              "fence.proxy.async after the wait");
      }
      WgMma op;
      memcpy(op.t, g.post, sizeof(op.t));
      g.open.push_back(op);
      break;
    }
    case kWgCommit:
      g.groups.push_back(g.open);
      g.open.clear();
      break;
    case kWgWait:
      if (!g.open.empty()) fail("wgmma.wait_group with uncommitted wgmma operations");
      while ((int)g.groups.size() > z.arg) {
        for (const WgMma& op : g.groups.front()) retire(op);
        g.groups.erase(g.groups.begin());
      }
      break;
    default: fail("unknown warpgroup collective");
  }
  g.arrived = 0;
  g.gen++;
  b.progress++;
}

inline void wgmma_simple(int op, int arg) {
  WgPost p{};
  p.op = op;
  p.arg = arg;
  warpgroup_collective(p);
}

inline void setmaxnreg(int count) {
  wgmma_simple(kWgSetmaxnreg, count);
}

// wgmma.mma_async m64n{n}k16, f32 += f16/bf16: acc has n / 2 floats; A from registers (a, when
// a_regs) or desc_a (K-major); B from desc_b, MN-major when trans_b.
inline void wgmma(float* acc, int n, const uint32_t* a, uint64_t desc_a, uint64_t desc_b, int scale_d,
                  bool bf16, bool trans_b) {
  WgPost p{};
  p.op = kWgMma;
  p.acc = acc;
  p.a_regs = a != nullptr;
  p.a_regs_at = a;
  if (a) memcpy(p.a, a, sizeof(p.a));
  p.desc_a = desc_a;
  p.desc_b = desc_b;
  p.n = n;
  p.scale_d = scale_d;
  p.bf16 = bf16;
  p.trans_b = trans_b;
  warpgroup_collective(p);
}

/* sm90: mbarriers and tensor copies -------------------------------------------------------- */

// What a tensor map holds here (the host code's TmaBox, tma.h): the emulation's own encoding.
struct TmaDesc {
  const void* base;
  uint64_t dims[5];
  uint64_t strides[4];  // bytes, dims 1..4
  uint32_t box[5];
  int swizzle_bytes;  // 128, 64, 32 or 0
};

struct TmaCopy {
  unsigned char* dst;
  TmaDesc d;
  int32_t c[5];
};

struct Mbar {
  int expected = 0, pending = 0;
  int64_t tx = 0;
  int phase = 0;
  std::vector<TmaCopy> copies;             // issued, not landed
  std::vector<std::vector<Copy>> generic;  // cp.async copies of a thread each, arriving when landed
  bool cur_generic = false;                // cp.async copies complete in the current phase
  bool last_generic = false;               // ... in the last completed phase
};

inline std::vector<std::pair<uint32_t, Mbar>>& mbars() {  // by shared-memory address, this block's
  static std::vector<std::pair<uint32_t, Mbar>> m;
  return m;
}

inline void mbars_reset() {
  mbars().clear();
}

inline void mbars_report() {
  for (const auto& e : mbars())
    fprintf(stderr, "cuda emulation: mbarrier at %u: phase %d, %d arrivals and %lld bytes to come\n", e.first,
            e.second.phase, e.second.pending, (long long)e.second.tx);
}

inline bool mbars_idle() {
  for (const auto& e : mbars())
    if (!e.second.copies.empty() || !e.second.generic.empty()) return false;
  return true;
}

inline Mbar& mbar(const void* bar) {
  const uint32_t a = shared_address(bar);
  if (a % 8) fail("an mbarrier must be 8-byte aligned");
  for (auto& e : mbars())
    if (e.first == a) return e.second;
  fail("mbarrier used before mbarrier.init");
}

inline void mbar_init(void* bar, int count) {
  const uint32_t a = shared_address(bar);
  for (auto& e : mbars())
    if (e.first == a) {
      e.second = Mbar();
      e.second.expected = e.second.pending = count;
      return;
    }
  Mbar m;
  m.expected = m.pending = count;
  mbars().push_back({a, m});
}

// After an arrival or bytes landing on m (progress for the deadlock check: a thread waiting there
// may now land copies or pass); completes the phase when nothing more is due.
inline void mbar_complete_if_done(Mbar& m) {
  block().progress++;
  if (m.pending < 0 || m.tx < 0) fail("mbarrier: more arrivals or bytes than its phase expects");
  if (m.pending == 0 && m.tx == 0) {
    m.last_generic = m.cur_generic;
    m.cur_generic = false;
    m.phase ^= 1;
    m.pending = m.expected;
  }
}

inline void tma_land(Mbar& m, const TmaCopy& cp) {
  const TmaDesc& d = cp.d;
  const uint32_t dst0 = shared_address(cp.dst);
  const int bits = d.swizzle_bytes == 128 ? 3 : d.swizzle_bytes == 64 ? 2 : d.swizzle_bytes == 32 ? 1 : 0;
  if (bits && dst0 % (8 * (uint32_t)d.swizzle_bytes))
    fail("TMA: a swizzled box must start on its pattern's boundary");
  uint64_t n = 0;
  for (uint32_t i4 = 0; i4 < d.box[4]; ++i4)
    for (uint32_t i3 = 0; i3 < d.box[3]; ++i3)
      for (uint32_t i2 = 0; i2 < d.box[2]; ++i2)
        for (uint32_t i1 = 0; i1 < d.box[1]; ++i1)
          for (uint32_t i0 = 0; i0 < d.box[0]; ++i0, ++n) {
            const int64_t x[5] = {(int64_t)cp.c[0] + i0, (int64_t)cp.c[1] + i1, (int64_t)cp.c[2] + i2,
                                  (int64_t)cp.c[3] + i3, (int64_t)cp.c[4] + i4};
            bool in = true;
            for (int k = 0; k < 5; ++k) in = in && x[k] >= 0 && x[k] < (int64_t)d.dims[k];
            uint16_t v = 0;
            if (in) {
              uint64_t off = 2 * (uint64_t)x[0];
              for (int k = 1; k < 5; ++k) off += (uint64_t)x[k] * d.strides[k - 1];
              memcpy(&v, (const unsigned char*)d.base + off, 2);
            }
            uint32_t a = dst0 + (uint32_t)(2 * n);
            if (bits) a ^= ((a >> 7) & ((1u << bits) - 1)) << 4;
            if (block().shared + a + 2 > shared_limit())
              fail("TMA: a box outside the launch's shared memory");
            memcpy(block().shared + a, &v, 2);
          }
  m.tx -= (int64_t)(2 * n);
  mbar_complete_if_done(m);
}

inline void mbar_arrive_expect_tx(void* bar, uint32_t bytes) {
  Mbar& m = mbar(bar);
  m.tx += bytes;
  m.pending -= 1;
  mbar_complete_if_done(m);
}

// A plain arrival.
inline void mbar_arrive(void* bar) {
  Mbar& m = mbar(bar);
  m.pending -= 1;
  mbar_complete_if_done(m);
}

// The arrival of one thread's cp.async copies (each 16 bytes or zero-filled).
inline void land_generic(Mbar& m, const std::vector<Copy>& batch) {
  for (const Copy& c : batch) write_copy(c);
  m.pending -= 1;
  mbar_complete_if_done(m);
}

// cp.async.mbarrier.arrive (without .noinc): this thread's cp.async copies so far, committed or
// not, arrive on bar once they have landed (the phase expects one more arrival until then). With
// eager copies they landed at issue.
inline void cp_async_mbar_arrive(void* bar) {
  Fiber& f = self();
  Mbar& m = mbar(bar);
  std::vector<Copy> batch;
  for (const auto& g : f.groups) batch.insert(batch.end(), g.begin(), g.end());
  batch.insert(batch.end(), f.open.begin(), f.open.end());
  f.groups.clear();
  f.open.clear();
  f.unfenced = false;  // (eager copies) the threads that wait on bar fence them
  m.cur_generic = true;
  m.pending += 1;
  if (batch.empty() || options().eager_copies) {
    m.pending -= 1;
    mbar_complete_if_done(m);
  } else {
    m.generic.push_back(batch);
    block().progress++;  // copies that a waiter lands
  }
}

inline void tma_load(void* dst, const void* map, const int32_t (&c)[5], void* bar) {
  TmaCopy cp;
  cp.dst = (unsigned char*)dst;
  memcpy(&cp.d, map, sizeof(TmaDesc));
  for (int k = 0; k < 5; ++k) cp.c[k] = c[k];
  Mbar& m = mbar(bar);
  if (options().eager_copies) {
    tma_land(m, cp);
  } else {
    m.copies.push_back(cp);
    block().progress++;  // copies that a waiter lands
  }
}

// Waits for the completion of the phase of parity `parity`: lands the barrier's copies, then
// yields until the phase has completed.
inline void mbar_wait(void* bar, uint32_t parity) {
  for (;;) {
    Mbar& m = mbar(bar);
    std::vector<TmaCopy> copies;
    copies.swap(m.copies);
    for (const TmaCopy& cp : copies) tma_land(mbar(bar), cp);
    std::vector<std::vector<Copy>> generic;
    generic.swap(mbar(bar).generic);
    for (const auto& batch : generic) land_generic(mbar(bar), batch);
    Mbar& n = mbar(bar);
    self().waits = Fiber::Wait{3, shared_address(bar), parity & 1};
    if ((uint32_t)n.phase != (parity & 1)) {
      if (n.last_generic) self().observed = true;
      return;
    }
    yield();
  }
}

}  // namespace da_emu

// The CUDA names the kernels use.
#define threadIdx (da_emu::self().tid)
#define blockIdx (da_emu::block().block_idx)
#define gridDim (da_emu::block().grid_dim)
#define blockDim (da_emu::block().block_dim)

inline void __syncthreads() {
  da_emu::barrier(0);
}
inline int __syncthreads_or(int pred) {
  return da_emu::barrier(pred);
}
inline bool __any_sync(unsigned, bool pred) {
  return da_emu::vote(da_emu::kAny, pred);
}
// A warp collective like the votes: no lane goes on before every lane of the warp has come.
inline void __syncwarp(unsigned = 0xffffffffu) {
  da_emu::vote(da_emu::kAll, true);
}
inline bool __all_sync(unsigned, bool pred) {
  return da_emu::vote(da_emu::kAll, pred);
}
template <typename V>
inline V __shfl_xor_sync(unsigned, V v, int lane_mask) {
  return da_emu::shfl(da_emu::kShflXor, v, lane_mask);
}
template <typename V>
inline V __shfl_sync(unsigned, V v, int src) {
  return da_emu::shfl(da_emu::kShfl, v, src);
}

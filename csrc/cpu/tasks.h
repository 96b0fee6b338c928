// The kernels' threads: each one's scratch memory (Arena), the tasks of a call spread over them
// (parallel_tasks), and the tasks of a call sequence by sequence (TaskSplit).
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <stdint.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <initializer_list>
#include <vector>

#include "../checks.h"

namespace dilated_attention {
namespace cpu {

/* Scratch memory of one thread: slices of one 64-byte aligned buffer. */
template <typename T>
struct Arena {
  std::vector<T> mem;
  size_t used;
  explicit Arena(size_t n) : mem(n + 64), used(0) {
    const uintptr_t p = (uintptr_t)mem.data();
    used = (size_t)(((p + 63) & ~(uintptr_t)63) - p) / sizeof(T);
  }
  T* take(size_t n) {
    T* p = mem.data() + used;
    used += (n + 15) & ~(size_t)15;
    TORCH_INTERNAL_ASSERT(used <= mem.size());
    return p;
  }
  static size_t need(std::initializer_list<size_t> sizes) {
    size_t total = 0;
    for (size_t s : sizes) total += (s + 15) & ~(size_t)15;
    return total;
  }
};

/*
 * Run fn(task, scratch) for task in [0, n) on all threads. Thread i owns the i-th contiguous
 * share of the tasks (neighbouring tasks read the same keys and values, so threads that work on
 * different shares touch different memory) and, when done, takes the remaining tasks of the
 * other shares one at a time.
 */
template <typename MakeScratch, typename Fn>
static void parallel_tasks(int64_t n, const MakeScratch& make, const Fn& fn) {
  if (n <= 0) return;
  struct alignas(64) Share {
    std::atomic<int64_t> next;
    int64_t end;
  };
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  std::vector<Share> shares(workers);
  for (int64_t i = 0; i < workers; ++i) {
    shares[i].next.store(n * i / workers);
    shares[i].end = n * (i + 1) / workers;
  }
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    auto scratch = make();
    for (int64_t me = begin; me < end; ++me)
      for (int64_t j = 0; j < workers; ++j) {
        Share& sh = shares[(me + j) % workers];
        for (int64_t t = sh.next.fetch_add(1); t < sh.end; t = sh.next.fetch_add(1)) fn(t, scratch);
      }
  });
}

/*
 * The tasks of a call, sequence by sequence: sequence i owns the task ids [first[i], first[i + 1]).
 * locate(task) gives the sequence and the task's index inside it (a binary search).
 */
struct TaskSplit {
  std::vector<int64_t> first;
  TaskSplit(const std::vector<Sequence>& seqs, const std::function<int64_t(const Sequence&)>& count) {
    first.push_back(0);
    for (const Sequence& sq : seqs) first.push_back(first.back() + count(sq));
  }
  int64_t total() const { return first.back(); }
  void locate(int64_t task, int64_t* seq, int64_t* local) const {
    *seq = (int64_t)(std::upper_bound(first.begin(), first.end(), task) - first.begin()) - 1;
    *local = task - first[*seq];
  }
};

}  // namespace cpu
}  // namespace dilated_attention

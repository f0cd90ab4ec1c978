// How the kernels share work among threads. In the torch extension (MOEPAGER_WITH_TORCH) that is ATen's own pool, so
// torch.set_num_threads governs it; in the torch-free harness (harness.cpp) an OpenMP split of the same shape. A
// task's arithmetic never depends on the thread that runs it, so every split gives the same bits.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>

#if defined(MOEPAGER_WITH_TORCH)
#include <ATen/Parallel.h>
#endif

namespace {

// A call of fewer multiply-adds than this runs on the calling thread alone: waking the pool costs more than a second
// core saves on weights that sit in the caches (one token's bf16 GEMV: two threads first win at about this size).
constexpr int64_t SERIAL_MACS = 1 << 19;

// The grain for `tasks` tasks of `macs` multiply-adds in all: every task inline below SERIAL_MACS.
inline int64_t grain_for(int64_t tasks, int64_t macs) { return macs < SERIAL_MACS ? tasks + 1 : 1; }

#if defined(MOEPAGER_WITH_TORCH)
inline int kernel_threads() { return at::get_num_threads(); }
inline bool in_parallel() { return at::in_parallel_region(); }
template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  at::parallel_for(begin, end, grain, f);
}
#else
int harness_threads = 1;  // harness.cpp sets it
inline int kernel_threads() { return harness_threads; }
inline bool in_parallel() { return omp_in_parallel() != 0; }
template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t chunks = std::min<int64_t>(harness_threads, (n + grain - 1) / std::max<int64_t>(grain, 1));
  if (chunks <= 1 || in_parallel()) return f(begin, end);
#pragma omp parallel for num_threads(static_cast<int>(chunks)) schedule(static, 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t a = begin + n * c / chunks, b = begin + n * (c + 1) / chunks;
    if (a < b) f(a, b);
  }
}
#endif

}  // namespace

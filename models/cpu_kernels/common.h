// What the CPU kernels share: the machine's own float vector type with float32/bfloat16 loads
// (GNU vector extensions, so -march=native gives AVX-512, AVX2, SSE or NEON code), and
// ParallelFor, which runs tasks 0..n-1 over XLA's intra-op thread pool.
//
// ParallelFor: workers claim tasks from an atomic counter; the calling thread claims too and then
// waits only for tasks already being computed, so it never waits on a helper that has
// not started (the pool may be busy or have one thread). Late helpers find nothing to
// claim and never touch the caller's buffers.

#ifndef SPECJAX_CPU_KERNELS_COMMON_H_
#define SPECJAX_CPU_KERNELS_COMMON_H_

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

// Always inlined: the kernels' inner loops call these per vector.
#define SPECJAX_INLINE inline __attribute__((always_inline))

namespace specjax {

// The machine's own float vector (what -march=native gives). Wider generic vectors are legal but
// GCC splits them through the stack: a 16-lane type on AVX2 made the panel kernel 3x slower.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;  // SSE, NEON
#endif
typedef float fvec __attribute__((vector_size(4 * kLanes)));

SPECJAX_INLINE fvec LoadVec(const float* p) {
  fvec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

SPECJAX_INLINE fvec LoadVec(const uint16_t* p) {  // bfloat16 -> float32
  typedef uint16_t hvec __attribute__((vector_size(2 * kLanes)));
  typedef uint32_t uvec __attribute__((vector_size(4 * kLanes)));
  hvec h;
  std::memcpy(&h, p, sizeof h);
  uvec u = __builtin_convertvector(h, uvec) << 16;
  fvec v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

SPECJAX_INLINE void StoreVec(float* p, fvec v) { std::memcpy(p, &v, sizeof v); }

SPECJAX_INLINE float ToFloat(float x) { return x; }

SPECJAX_INLINE float ToFloat(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <typename F>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, F task) {
  if (n <= 0) return;
  if (n == 1 || pool.num_threads() <= 1) {
    for (int64_t i = 0; i < n; ++i) task(i);
    return;
  }
  struct State {
    F task;
    int64_t n;
    std::atomic<int64_t> next{0}, done{0};
    State(F f, int64_t count) : task(std::move(f)), n(count) {}
    void Work() {
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
        task(i);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto state = std::make_shared<State>(std::move(task), n);
  int64_t helpers = pool.num_threads() - 1;
  if (helpers > n - 1) helpers = n - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([state] { state->Work(); });
  state->Work();
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

}  // namespace specjax

#endif  // SPECJAX_CPU_KERNELS_COMMON_H_

// y[M, N] = x[M, K] . W[N, K]^T on the CPU, W stored as 32-column panels (issue 14).
//
// Kernel body (Tile/Panels) / XLA FFI handler (SpecjaxPanelMatmul) / validated entry in
// models/cpu_kernels/panel_matmul.py, with a numpy reference there.
//
// Why: XLA:CPU takes a GEMV path for one row and a GEMM path that packs the weights on
// every call for a few rows, so a (K+1)-token verify step cost 1.5-2x a one-token step
// although both read the same weights once. Here the weights are packed once, at load:
// panel p holds output columns [32p, 32p + 32) as a contiguous [K, 32] block. A tile of
// up to kRowGroup rows streams its panel once, loading 32 weights per k and using them
// for every row (2 * rows FMAs per 128 bytes), so a few rows cost about what one does
// while the weights come from memory.
//
// Portable GNU C++ (vector extensions, no intrinsics); built on the machine that runs it
// with -march=native by models/cpu_kernels/build.py, so the same source gives AVX-512, AVX2 or
// NEON code.

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

constexpr int64_t kPanel = 32;  // output columns per panel: two 16-lane vectors
#ifdef __AVX512F__
constexpr int kRowGroup = 8;  // 16 accumulators + 2 weight vectors + 1 broadcast of 32 zmm registers
#else
constexpr int kRowGroup = 4;  // narrower registers: keep the accumulators out of memory
#endif
// Software prefetch distance in k steps (16 * 128 bytes = 2 KiB ahead): the hardware
// prefetcher stops at 4 KiB pages; measured 16 as good as 32 or 64 and better than 8.
constexpr int64_t kPrefetch = 16;
// Panels claimed per task: small enough that two threads finish together.
constexpr int64_t kChunk = 2;

inline f32x16 Load(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline f32x16 Load(const uint16_t* p) {  // bfloat16 -> float32 is a 16-bit shift
  u16x16 h;
  std::memcpy(&h, p, sizeof h);
  u32x16 u = __builtin_convertvector(h, u32x16) << 16;
  f32x16 v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

// y[m0 + m, n0 : n0 + 32] = sum_k x[m0 + m, k] * panel[k, :] for m < MR.
template <int MR, typename W>
inline void Tile(const float* x, const W* panel, float* y, int64_t K, int64_t N, int64_t m0, int64_t n0) {
  f32x16 lo[MR], hi[MR];
  for (int m = 0; m < MR; ++m) lo[m] = hi[m] = f32x16{};
  for (int64_t k = 0; k < K; ++k) {
    const W* row = panel + k * kPanel;
    __builtin_prefetch(row + kPrefetch * kPanel);
    __builtin_prefetch(row + kPrefetch * kPanel + 16);
    f32x16 w0 = Load(row), w1 = Load(row + 16);
    for (int m = 0; m < MR; ++m) {
      float xs = x[(m0 + m) * K + k];
      lo[m] += w0 * xs;
      hi[m] += w1 * xs;
    }
  }
  for (int m = 0; m < MR; ++m) {
    std::memcpy(y + (m0 + m) * N + n0, &lo[m], sizeof lo[m]);
    std::memcpy(y + (m0 + m) * N + n0 + 16, &hi[m], sizeof hi[m]);
  }
}

template <int MR, typename W>
inline void TileIf(int64_t rows, const float* x, const W* panel, float* y, int64_t K, int64_t N, int64_t m0,
                   int64_t n0) {
  if constexpr (MR > 0) {
    if (rows == MR) return Tile<MR>(x, panel, y, K, N, m0, n0);
    TileIf<MR - 1>(rows, x, panel, y, K, N, m0, n0);
  }
}

// Panels [p0, p1) for all M rows; a panel is re-read (from cache) once per row group.
template <typename W>
void Panels(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const W* panel = w + p * K * kPanel;
    int64_t m0 = 0;
    for (; m0 + kRowGroup <= M; m0 += kRowGroup) Tile<kRowGroup>(x, panel, y, K, N, m0, p * kPanel);
    TileIf<kRowGroup - 1>(M - m0, x, panel, y, K, N, m0, p * kPanel);
  }
}

// Shared by the calling thread and the helpers it schedules. Workers claim chunks; the
// caller claims whatever is left and then waits only for chunks already being computed,
// so it never waits on a helper that has not started (the pool may be busy or have one
// thread). Late helpers find nothing to claim and never touch the buffers.
template <typename W>
struct Job {
  const float* x;
  const W* w;
  float* y;
  int64_t M, K, N, panels, chunks;
  std::atomic<int64_t> next{0}, done{0};

  void Work() {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      int64_t p0 = c * kChunk, p1 = p0 + kChunk < panels ? p0 + kChunk : panels;
      Panels(x, w, y, M, K, N, p0, p1);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

template <typename W>
void Run(ffi::ThreadPool& pool, const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t panels) {
  auto job = std::make_shared<Job<W>>();
  job->x = x;
  job->w = w;
  job->y = y;
  job->M = M;
  job->K = K;
  job->N = panels * kPanel;
  job->panels = panels;
  job->chunks = (panels + kChunk - 1) / kChunk;
  int64_t helpers = pool.num_threads() - 1;
  if (helpers > job->chunks - 1) helpers = job->chunks - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([job] { job->Work(); });
  job->Work();
  while (job->done.load(std::memory_order_acquire) < job->chunks) std::this_thread::yield();
}

ffi::Error PanelMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (x.element_type() != ffi::F32 || xd.size() != 2)
    return ffi::Error::InvalidArgument("specjax_panel_matmul: x must be float32 [M, K]");
  if (wd.size() != 3 || wd[1] != xd[1] || wd[2] != kPanel)
    return ffi::Error::InvalidArgument("specjax_panel_matmul: w must be [P, K, 32] with x's K");
  if (y->element_type() != ffi::F32 || yd.size() != 2 || yd[0] != xd[0] || yd[1] != wd[0] * kPanel)
    return ffi::Error::InvalidArgument("specjax_panel_matmul: y must be float32 [M, 32 * P]");
  const float* xp = static_cast<const float*>(x.untyped_data());
  float* yp = static_cast<float*>(y->untyped_data());
  if (w.element_type() == ffi::F32) {
    Run(pool, xp, static_cast<const float*>(w.untyped_data()), yp, xd[0], xd[1], wd[0]);
  } else if (w.element_type() == ffi::BF16) {
    Run(pool, xp, static_cast<const uint16_t*>(w.untyped_data()), yp, xd[0], xd[1], wd[0]);
  } else {
    return ffi::Error::InvalidArgument("specjax_panel_matmul: w must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxPanelMatmul, PanelMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [M, K] float32
                                  .Arg<ffi::AnyBuffer>()  // w [P, K, 32] float32 or bfloat16
                                  .Ret<ffi::AnyBuffer>()  // y [M, 32 * P] float32
);

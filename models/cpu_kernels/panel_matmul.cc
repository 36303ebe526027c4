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
// for every row (32 * rows multiply-adds per 128 bytes), so a few rows cost about what one
// does while the weights come from memory.
//
// Portable GNU C++ (vector extensions of the machine's own width, common.h; no intrinsics);
// built on the machine that runs it with -march=native by models/cpu_kernels/build.py, so the
// same source gives AVX-512, AVX2, SSE or NEON code.

#include <cstdint>
#include <cstring>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using specjax::fvec;
using specjax::kLanes;
using specjax::LoadVec;
using specjax::StoreVec;

constexpr int64_t kPanel = 32;  // output columns per panel
constexpr int kVecs = kPanel / kLanes;  // vectors per panel row: 2 (AVX-512), 4 (AVX2), 8 (SSE, NEON)
// Rows per tile: MR * kVecs accumulators stay in registers with the panel row's kVecs weight vectors
// and the row broadcasts (more spills them to the stack, which costs more than re-reading the panel from
// cache for the next row group). AVX2: 3 (12 of 16 ymm), measured against 2 and 4; AVX-512: 8 (16 of 32
// zmm), measured with this kernel's earlier 16-lane code; aarch64: 3 by register count, not measured.
#if defined(__AVX512F__)
constexpr int kRowGroup = 8;
#elif defined(__AVX__) || defined(__aarch64__)
constexpr int kRowGroup = 3;
#else
constexpr int kRowGroup = 1;
#endif
// Software prefetch distance in k steps (16 * 128 bytes = 2 KiB ahead): the hardware
// prefetcher stops at 4 KiB pages; measured 16 as good as 32 or 64 and better than 8.
constexpr int64_t kPrefetch = 16;
// Panels claimed per task: small enough that two threads finish together.
constexpr int64_t kChunk = 2;

// y[m0 + m, n0 : n0 + 32] = sum_k x[m0 + m, k] * panel[k, :] for m < MR.
template <int MR, typename W>
inline void Tile(const float* x, const W* panel, float* y, int64_t K, int64_t N, int64_t m0, int64_t n0) {
  fvec acc[MR][kVecs] = {};
  for (int64_t k = 0; k < K; ++k) {
    const W* row = panel + k * kPanel;
    __builtin_prefetch(row + kPrefetch * kPanel);
    __builtin_prefetch(row + kPrefetch * kPanel + 16);
    fvec w[kVecs];
    for (int v = 0; v < kVecs; ++v) w[v] = LoadVec(row + v * kLanes);
    for (int m = 0; m < MR; ++m) {
      const float xs = x[(m0 + m) * K + k];
      for (int v = 0; v < kVecs; ++v) acc[m][v] += w[v] * xs;
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kVecs; ++v) StoreVec(y + (m0 + m) * N + n0 + v * kLanes, acc[m][v]);
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

template <typename W>
void Run(ffi::ThreadPool& pool, const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t panels) {
  int64_t chunks = (panels + kChunk - 1) / kChunk;
  specjax::ParallelFor(pool, chunks, [=](int64_t c) {
    int64_t p0 = c * kChunk, p1 = p0 + kChunk < panels ? p0 + kChunk : panels;
    Panels(x, w, y, M, K, panels * kPanel, p0, p1);
  });
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

// y[M, N] = x[M, K] . W[N, K]^T on the CPU, W stored as panels two vectors wide (issue 14).
//
// Kernel body (Tile/Panels) / XLA FFI handler (SpecjaxPanelMatmul) / validated entry in
// models/cpu_kernels/panel_matmul.py, with a numpy reference there.
//
// Why: XLA:CPU takes a GEMV path for one row and a GEMM path that packs the weights on
// every call for a few rows, so a (K+1)-token verify step cost 1.5-2x a one-token step
// although both read the same weights once. Here the weights are packed once, at load:
// panel p holds output columns [kPanel p, kPanel (p + 1)) as a contiguous [K, kPanel] block,
// kPanel = two of the machine's vectors (32 columns with AVX-512, 16 with AVX2, 8 with SSE or
// NEON; SpecjaxPanelWidth tells the packing). A tile of up to kRowGroup rows streams its panel
// once, loading kPanel weights per k and using them for every row, so a few rows cost about
// what one does while the weights come from memory.
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

constexpr int kVecs = 2;  // vectors per panel row
constexpr int64_t kPanel = kVecs * kLanes;  // output columns per panel
// Rows per tile: MR * kVecs accumulators stay in registers with the panel row's kVecs weight vectors
// and the row broadcast (more spills them to the stack). A verify of K + 1 <= kRowGroup rows is then
// one pass over each panel, streaming it from memory while the multiply-adds run; a second row group
// re-reads the panel from cache after the stream, its multiply-adds no longer hidden behind it (what
// made 5 rows cost 1.4x one with the earlier 32-column panels and 3-row tiles on AVX2). AVX2 (16 ymm):
// 6 -> 12 accumulators; measured with a one-thread driver of SmolLM2's 30 gate/up products
// (212 MB), 16-column panels of 6 rows vs 32-column panels of 3 rows: 1 row 18.9 / 18.3 ms,
// 5 rows 21.6 / 25.2 ms, 40 rows 65 / 86 ms. AVX-512 (32 zmm): 8 -> 16 accumulators, as tuned for
// its 32-column panels. SSE (16 xmm) and NEON: 6 by register count, not measured.
#if defined(__AVX512F__)
constexpr int kRowGroup = 8;
#else
constexpr int kRowGroup = 6;
#endif
// Software prefetch 4 KiB ahead of the stream (the hardware prefetcher stops at 4 KiB pages). On AMD Zen as
// non-temporal: each weight is used once per call, and a plain prefetch let the stream evict what the step
// reuses (activations, the KV cache, the next ops' inputs) from the caches. In one process, each variant its
// own XLA target, SmolLM2 batch 1, 2-core AVX2 EPYC (2026-12-05): 1-token step -3-4%, 5-token verify -4-10%;
// the 7.5M shipped target -19% / -20%; SmolLM2 batch 8 -2% / -3%. Elsewhere a plain prefetch: on a 2-vCPU
// Intel Xeon with AVX-512 (GCC's -march=native: rocketlake) the non-temporal one made SmolLM2's steps ~2x
// slower (1-token 64.5 -> 30.6 ms with the plain one; benchmarks/README.md, "Verify cost on CPU"). (A plain
// prefetch 1 KiB ahead was slower than 2 KiB, and 2, 4 and 8 KiB alike, in earlier one-thread drivers.)
#if defined(__znver1__) || defined(__znver2__) || defined(__znver3__) || defined(__znver4__) || defined(__znver5__)
constexpr int kPrefetchLocality = 0;  // non-temporal
#else
constexpr int kPrefetchLocality = 3;  // into every cache level
#endif
constexpr int64_t kPrefetchBytes = 4096;
// Panels claimed per task (64 columns): small enough that two threads finish together.
constexpr int64_t kChunk = 64 / kPanel > 0 ? 64 / kPanel : 1;

// y[m0 + m, n0 : n0 + kPanel] = sum_k x[m0 + m, k] * panel[k, :] for m < MR.
template <int MR, typename W>
inline void Tile(const float* x, const W* panel, float* y, int64_t K, int64_t N, int64_t m0, int64_t n0) {
  fvec acc[MR][kVecs] = {};
  for (int64_t k = 0; k < K; ++k) {
    const W* row = panel + k * kPanel;
    const char* ahead = reinterpret_cast<const char*>(row) + kPrefetchBytes;
    for (int64_t b = 0; b < kPanel * int64_t(sizeof(W)); b += 64) __builtin_prefetch(ahead + b, 0, kPrefetchLocality);
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
    return ffi::Error::InvalidArgument("specjax_panel_matmul: w must be [P, K, SpecjaxPanelWidth()] with x's K");
  if (y->element_type() != ffi::F32 || yd.size() != 2 || yd[0] != xd[0] || yd[1] != wd[0] * kPanel)
    return ffi::Error::InvalidArgument("specjax_panel_matmul: y must be float32 [M, P * SpecjaxPanelWidth()]");
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

// out[i, :] = W[id_i, :] in float32, read from the panels (an embedding lookup on a packed tied table); ids
// are clipped into [0, P * kPanel). Why a kernel: XLA:CPU gathers a bfloat16 table by widening all of it to
// float32 first, and in a head's drafting loop it hoists that widening out of the loop as a copy of the whole
// table (1.1 ms per step for the shipped 4096-row target); this reads only the rows asked for.
template <typename W>
void Rows(const int32_t* ids, const W* w, float* out, int64_t n, int64_t K, int64_t panels) {
  const int64_t last = panels * kPanel - 1;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = ids[i] < 0 ? 0 : (ids[i] > last ? last : ids[i]);
    const W* col = w + (id / kPanel) * K * kPanel + id % kPanel;
    for (int64_t k = 0; k < K; ++k) out[i * K + k] = specjax::ToFloat(col[k * kPanel]);
  }
}

ffi::Error PanelRows(ffi::Buffer<ffi::S32> ids, ffi::AnyBuffer w, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto wd = w.dimensions(), od = out->dimensions();
  const int64_t n = static_cast<int64_t>(ids.element_count());
  if (wd.size() != 3 || wd[2] != kPanel)
    return ffi::Error::InvalidArgument("specjax_panel_rows: w must be [P, K, SpecjaxPanelWidth()]");
  if (od.size() != 2 || od[0] != n || od[1] != wd[1])
    return ffi::Error::InvalidArgument("specjax_panel_rows: out must be float32 [number of ids, K]");
  float* op = out->typed_data();
  if (w.element_type() == ffi::F32) {
    Rows(ids.typed_data(), static_cast<const float*>(w.untyped_data()), op, n, wd[1], wd[0]);
  } else if (w.element_type() == ffi::BF16) {
    Rows(ids.typed_data(), static_cast<const uint16_t*>(w.untyped_data()), op, n, wd[1], wd[0]);
  } else {
    return ffi::Error::InvalidArgument("specjax_panel_rows: w must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

}  // namespace

// Output columns per panel in this build (what the packing in panel_matmul.py must use).
extern "C" int SpecjaxPanelWidth() { return static_cast<int>(kPanel); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxPanelMatmul, PanelMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [M, K] float32
                                  .Arg<ffi::AnyBuffer>()  // w [P, K, kPanel] float32 or bfloat16
                                  .Ret<ffi::AnyBuffer>()  // y [M, kPanel * P] float32
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxPanelRows, PanelRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ids [...] int32
                                  .Arg<ffi::AnyBuffer>()  // w [P, K, kPanel] float32 or bfloat16
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [number of ids, K] float32
);

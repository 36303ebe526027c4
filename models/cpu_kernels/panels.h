// y[M, N] = x[M, K] . W[N, K]^T on the CPU, W stored as panels two vectors wide (issue 14).
//
// Kernel body (Tile/Panels, here) / XLA FFI handler (SpecjaxPanelMatmul, panel_matmul.cc) / validated entry
// in models/cpu_kernels/panel_matmul.py, with a numpy reference there. The fused decoder layer
// (decoder_layer.cc) calls the same body.
//
// Why: XLA:CPU takes a GEMV path for one row and a GEMM path that packs the weights on
// every call for a few rows, so a (K+1)-token verify step cost 1.5-2x a one-token step
// although both read the same weights once. Here the weights are packed once, at load:
// panel p holds output columns [kPanel p, kPanel (p + 1)) as a contiguous [K, kPanel] block,
// kPanel = two of the machine's vectors (32 columns with AVX-512, 16 with AVX2, 8 with SSE or
// NEON; SpecjaxPanelWidth tells the packing). A tile of up to kRowGroup rows streams its panel
// once, loading kPanel weights per k and using them for every row, so a few rows cost about
// what one does while the weights come from memory. Weights may be float32, bfloat16 or a GGUF
// file's Q4_1 / Q8_0 blocks (the formats below), all dequantized to the same float32 values.
//
// Portable GNU C++ (vector extensions of the machine's own width, common.h; intrinsics only where
// GCC's generic code is poor: byte widening and float16 scales on x86); built on the machine that
// runs it with -march=native by models/cpu_kernels/build.py, so the same source gives AVX-512,
// AVX2, SSE or NEON code.

#ifndef SPECJAX_CPU_KERNELS_PANELS_H_
#define SPECJAX_CPU_KERNELS_PANELS_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace specjax::panel {

namespace ffi = xla::ffi;
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
//
// Where the caller says the model's weights exceed the last-level cache (`stream`, so every weight comes from
// memory) and a call has several rows, the prefetch goes into the L2 only, 8 KiB ahead. On the Intel Xeon
// (AVX-512, 2 cores, 300 MiB L3; 2026-12-07) a random Llama of 592 MiB of float32 panels (wide155m) took, per
// variant in one process: batch 1, 5 rows 0.92x the time (4 KiB ahead 0.94-0.97x), 1 row 1.01x (so one row keeps
// the plain prefetch); batch 8, 8 rows 0.92x, 40 rows 0.95x. Models whose weights the L3 holds were up to 9%
// slower with it, none faster (a random 30M Llama, the shipped 7.5M target, SmolLM2's GGUF blocks). Not measured
// on AMD Zen, which keeps its non-temporal prefetch.
#if defined(__znver1__) || defined(__znver2__) || defined(__znver3__) || defined(__znver4__) || defined(__znver5__)
constexpr int kPrefetchLocality = 0;  // non-temporal
constexpr int kStreamLocality = 0;
constexpr int64_t kStreamPrefetchBytes = 4096;
#else
constexpr int kPrefetchLocality = 3;  // into every cache level
constexpr int kStreamLocality = 2;  // into the L2 (prefetcht1)
constexpr int64_t kStreamPrefetchBytes = 8192;
#endif
constexpr int64_t kPrefetchBytes = 4096;

// Prefetches the record of `bytes` that lies this prefetch's distance past rec.
template <bool Stream>
SPECJAX_INLINE void PrefetchAhead(const uint8_t* rec, int64_t bytes) {
  constexpr int kLocality = Stream ? kStreamLocality : kPrefetchLocality;
  constexpr int64_t kAhead = Stream ? kStreamPrefetchBytes : kPrefetchBytes;
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(rec + kAhead + b, 0, kLocality);
}
// Panels claimed per task (64 columns): small enough that two threads finish together.
constexpr int64_t kChunk = 64 / kPanel > 0 ? 64 / kPanel : 1;

// Weight formats. A panel is a sequence of records, each covering kK consecutive k of its kPanel columns:
// Dense<T> one k per record (float32 or bfloat16, widened exactly); Q4_1 / Q8_0 32 k per record (one GGUF
// block of each column: float16 scales, 4- or 8-bit q). Load(j) gives the weights of the record's
// k = kSub j .. kSub j + kSub - 1 as float32 vectors; At(k, c) one weight.
//
// The quantized weights are the float32 values the gguf package dequantizes the file to (d * q + m, d * q,
// each operation rounded to float32), so the kernel's products are those of the float32 model: d has 11
// significant bits and q at most 8, so d * q is exact in float32, and a fused multiply-add rounds
// d * q + m once, as the separate sum does.
template <typename T>
struct Dense {
  static constexpr int64_t kK = 1, kBytes = kPanel * int64_t(sizeof(T));
  static constexpr int kSub = 1, kSteps = 1;
  const T* p;
  explicit Dense(const uint8_t* rec) : p(reinterpret_cast<const T*>(rec)) {}
  SPECJAX_INLINE void Load(int, fvec (&w)[kSub][kVecs]) const {
    for (int v = 0; v < kVecs; ++v) w[0][v] = LoadVec(p + v * kLanes);
  }
  SPECJAX_INLINE float At(int, int64_t c) const { return specjax::ToFloat(p[c]); }
};

// Record: d[kPanel] float16, m[kPanel] float16, then 16 rows of kPanel bytes, byte c of row j holding
// column c's q at k = 2j (low nibble) and 2j + 1 (high nibble); weight = d * q + m. 5 bits per weight.
// What both Q4_1 layouts (this one and Q4_1Dot) read first: the record's scales and where its q start.
struct Q4_1Scales {
  static constexpr int64_t kK = 32, kBytes = 20 * kPanel;
  fvec d[kVecs], m[kVecs];
  const uint8_t* q;
  const uint16_t* s;
  explicit Q4_1Scales(const uint8_t* rec) : q(rec + 4 * kPanel), s(reinterpret_cast<const uint16_t*>(rec)) {
    for (int v = 0; v < kVecs; ++v)
      d[v] = specjax::LoadHalfVec(s + v * kLanes), m[v] = specjax::LoadHalfVec(s + kPanel + v * kLanes);
  }
};

struct Q4_1 : Q4_1Scales {
  static constexpr int kSub = 2, kSteps = 16;
  using Q4_1Scales::Q4_1Scales;
  SPECJAX_INLINE void Load(int j, fvec (&w)[kSub][kVecs]) const {
    for (int v = 0; v < kVecs; ++v) {
      const specjax::ivec u = specjax::LoadBytes(q + j * kPanel + v * kLanes);
      w[0][v] = Nibble(u) * d[v] + m[v];
      w[1][v] = Nibble(u >> 4) * d[v] + m[v];
    }
  }
  // The low 4 bits of each lane as float32. AVX-512: a lookup in a 16-entry table (vpermps reads only those bits,
  // and runs on another port than the conversion, which competes with the multiply-adds): 0.94-1.00x the time
  // of masking and converting on a chain of SmolLM2's Q4_1 matrices at 1 / 5 / 8 rows (three paired runs, same
  // outputs); elsewhere masked and converted.
  static SPECJAX_INLINE fvec Nibble(specjax::ivec u) {
#if defined(__AVX512F__)
    const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return (fvec)_mm512_permutexvar_ps((__m512i)u, table);
#else
    return __builtin_convertvector(u & 15, fvec);
#endif
  }
  SPECJAX_INLINE float At(int k, int64_t c) const {
    const uint8_t b = q[(k / 2) * kPanel + c];
    return static_cast<float>(k % 2 ? b >> 4 : b & 15) * specjax::HalfToFloat(s[c]) +
           specjax::HalfToFloat(s[kPanel + c]);
  }
};

// Record: d[kPanel] float16, then 32 rows of kPanel int8 (column c's q at k = j); weight = d * q. 8.5 bits
// per weight.
struct Q8_0 {
  static constexpr int64_t kK = 32, kBytes = 34 * kPanel;
  static constexpr int kSub = 1, kSteps = 32;
  fvec d[kVecs];
  const int8_t* q;
  const uint16_t* s;
  explicit Q8_0(const uint8_t* rec) : q(reinterpret_cast<const int8_t*>(rec + 2 * kPanel)),
                                      s(reinterpret_cast<const uint16_t*>(rec)) {
    for (int v = 0; v < kVecs; ++v) d[v] = specjax::LoadHalfVec(s + v * kLanes);
  }
  SPECJAX_INLINE void Load(int j, fvec (&w)[kSub][kVecs]) const {
    for (int v = 0; v < kVecs; ++v)
      w[0][v] = __builtin_convertvector(specjax::LoadBytes(q + j * kPanel + v * kLanes), fvec) * d[v];
  }
  SPECJAX_INLINE float At(int k, int64_t c) const {
    return static_cast<float>(q[k * kPanel + c]) * specjax::HalfToFloat(s[c]);
  }
};

// Integer formats: the same GGUF blocks laid out for byte dot products (x86 VNNI's vpdpbusd: 4 unsigned weight
// bytes times 4 signed activation bytes summed into each int32 lane), multiplied by activations quantized as
// llama.cpp does for these blocks (QuantizedX): each row's 32 x of a block as int8 with one float scale. An
// approximation of the float32 product (the weights stay exact; x carries 8 bits per block), chosen by the
// caller (models/cpu_kernels/panel_matmul.py). vpdpbusd does 64 products where a float FMA does 16 and the
// weights need no dequantizing, so each row costs far fewer instructions (SmolLM2's layers at 1 / 5 rows, one
// process per variant: 0.65-0.70x the float Q4_1 kernel's time). On AVX2 without VNNI, vpmaddubsw and vpmaddwd
// (common.h; AMD Zen 3: SmolLM2's forward at 1 / 5 rows 0.72 / 0.69x the exact path's time; generic code took
// 1.51 / 2.44x this one's). Each row is quantized alone and its integer sums are exact, so a row's output does
// not depend on the other rows of the call (a verify row equals the plain step's row).
//
// Q4_1 for dot products: d[kPanel] float16, m[kPanel] float16, then 4 groups of kPanel words, word c of group g
// holding column c's q at k = 8g + b in the low nibble of byte b and k = 8g + 4 + b in its high nibble.
struct Q4_1Dot : Q4_1Scales {
  using Q4_1Scales::Q4_1Scales;
  // ia[i] += sum over the record's 32 k of q[k] * xq[i][k] for vector v's columns (xq: the rows' int8 x of
  // this block, as 8 words of 4 bytes each).
  template <int MR>
  SPECJAX_INLINE void Dot(int v, const int32_t* const (&xq)[MR], specjax::ivec (&ia)[MR]) const {
    for (int g = 0; g < 4; ++g) {
      const specjax::uvec w = specjax::LoadWords(q + (g * kPanel + v * kLanes) * 4);
      const specjax::uvec lo = w & 0x0F0F0F0Fu, hi = (w >> 4) & 0x0F0F0F0Fu;
      for (int i = 0; i < MR; ++i)
        ia[i] = specjax::DotSmallBytes(specjax::DotSmallBytes(ia[i], lo, xq[i][2 * g]), hi, xq[i][2 * g + 1]);
    }
  }
  // The block's float contribution: d dx sum(q xq) + m sum(x).
  SPECJAX_INLINE fvec Finish(int v, specjax::ivec ia, const float* xb) const {
    return __builtin_convertvector(ia, fvec) * (d[v] * xb[0]) + m[v] * xb[1];
  }
  SPECJAX_INLINE float At(int k, int64_t c) const {
    const uint8_t b = q[((k / 8) * kPanel + c) * 4 + k % 4];
    return static_cast<float>(k % 8 < 4 ? b & 15 : b >> 4) * specjax::HalfToFloat(s[c]) +
           specjax::HalfToFloat(s[kPanel + c]);
  }
};

// Q8_0 for dot products: d[kPanel] float16, then 8 groups of kPanel words, byte b of word c of group g holding
// column c's q + 128 (unsigned) at k = 4g + b; the 128 sum(xq) this adds is taken off exactly.
struct Q8_0Dot {
  static constexpr int64_t kK = 32, kBytes = 34 * kPanel;
  fvec d[kVecs];
  const uint8_t* q;
  const uint16_t* s;
  explicit Q8_0Dot(const uint8_t* rec) : q(rec + 2 * kPanel), s(reinterpret_cast<const uint16_t*>(rec)) {
    for (int v = 0; v < kVecs; ++v) d[v] = specjax::LoadHalfVec(s + v * kLanes);
  }
  template <int MR>
  SPECJAX_INLINE void Dot(int v, const int32_t* const (&xq)[MR], specjax::ivec (&ia)[MR]) const {
    for (int g = 0; g < 8; ++g) {
      const specjax::uvec w = specjax::LoadWords(q + (g * kPanel + v * kLanes) * 4);
      if constexpr (specjax::kSignedByteDots) {  // the bytes back to q (signed): no offset to take off
        const specjax::uvec s = w ^ 0x80808080u;
        for (int i = 0; i < MR; ++i) ia[i] = specjax::DotSignedBytes(ia[i], s, xq[i][g]);
      } else {
        for (int i = 0; i < MR; ++i) ia[i] = specjax::DotBytes(ia[i], w, xq[i][g]);
      }
    }
  }
  SPECJAX_INLINE fvec Finish(int v, specjax::ivec ia, const float* xb) const {  // xb[2]: 128 sum(xq)
    const int32_t offset = specjax::kSignedByteDots ? 0 : static_cast<int32_t>(xb[2]);
    return __builtin_convertvector(ia - offset, fvec) * (d[v] * xb[0]);
  }
  SPECJAX_INLINE float At(int k, int64_t c) const {
    return static_cast<float>(static_cast<int>(q[((k / 4) * kPanel + c) * 4 + k % 4]) - 128) *
           specjax::HalfToFloat(s[c]);
  }
};

// x [M, K] quantized per row and block of 32: q[m, k] int8 = x / dx rounded to nearest (ties to even), dx =
// max |x| / 127 over the block, and per block kStats floats: dx, the float sum of x (for Q4_1's m), 128 sum(q)
// (for Q8_0's offset). q is kept as words of 4 bytes, the form the dot products broadcast.
struct QuantizedX {
  static constexpr int kStats = 3;
  static constexpr int64_t kParallelQuantize = 1 << 16;  // x elements
  int64_t blocks;
  std::unique_ptr<int32_t[]> q;
  std::unique_ptr<float[]> stats;
  template <typename Pool>
  QuantizedX(Pool& pool, const float* x, int64_t M, int64_t K)
      : blocks(K / 32), q(new int32_t[M * K / 4]), stats(new float[M * (K / 32) * kStats]) {
    int32_t* qp = q.get();
    float* sp = stats.get();
    const int64_t nb = blocks;
    auto row = [=](int64_t m) { QuantizeRow(x + m * K, nb, qp + m * K / 4, sp + m * nb * kStats); };
    // On the pool only for prefill-sized inputs: scheduling costs more than quantizing a verify's few rows.
    if (M * K >= kParallelQuantize) {
      specjax::ParallelFor(pool, M, row);
    } else {
      for (int64_t m = 0; m < M; ++m) row(m);
    }
  }
  // One row: q [32 nb] and stats [nb, kStats] of x [32 nb]. Compiled without contraction (see the rounding).
  __attribute__((optimize("fp-contract=off"))) static void QuantizeRow(const float* x, int64_t nb, int32_t* q,
                                                                       float* stats) {
    typedef int8_t bvec __attribute__((vector_size(kLanes)));
    constexpr int kParts = 32 / kLanes;
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + b * 32;
      fvec vmax = {}, vsum = {};
      for (int j = 0; j < kParts; ++j) {
        const fvec a = LoadVec(xb + j * kLanes);
        const fvec mag = (fvec)((specjax::ivec)a & 0x7FFFFFFF);
        vmax = mag > vmax ? mag : vmax;
        vsum += a;
      }
      float amax = 0, sum = 0;
      for (int i = 0; i < kLanes; ++i) amax = vmax[i] > amax ? vmax[i] : amax, sum += vsum[i];
      const float dx = amax / 127, inv = amax > 0 ? 127 / amax : 0;
      specjax::ivec vq = {};
      for (int j = 0; j < kParts; ++j) {
        // To nearest, ties to even: |v| <= 127 < 2^22, so v + 1.5 2^23 has unit spacing and rounds v exactly. v
        // is rounded to float32 first: a fused multiply-add would round x inv + 1.5 2^23 from the exact product,
        // one off the reference's q where x inv is within float32 rounding of a half.
        fvec v = LoadVec(xb + j * kLanes) * inv;
        v = (v + 12582912.0f) - 12582912.0f;
        v = v < -127.0f ? -127.0f : v;
        v = v > 127.0f ? 127.0f : v;
        const specjax::ivec qi = __builtin_convertvector(v, specjax::ivec);
        const bvec qb = __builtin_convertvector(qi, bvec);
        std::memcpy(reinterpret_cast<uint8_t*>(q + b * 8) + j * kLanes, &qb, sizeof qb);
        vq += qi;
      }
      int32_t qsum = 0;
      for (int i = 0; i < kLanes; ++i) qsum += vq[i];
      float* st = stats + b * kStats;
      st[0] = dx, st[1] = sum, st[2] = static_cast<float>(128 * qsum);  // |128 qsum| < 2^24: exact
    }
  }
  const int32_t* Words(int64_t m, int64_t b) const { return q.get() + (m * blocks + b) * 8; }
  const float* Stats(int64_t m, int64_t b) const { return stats.get() + (m * blocks + b) * kStats; }
};

// As Tile, for the integer formats: per record, each vector's int32 sums, then their float contribution.
template <int MR, typename F, bool Stream>
inline void TileDot(const QuantizedX& x, const uint8_t* panel, float* y, int64_t K, int64_t N, int64_t m0,
                    int64_t n0) {
  fvec acc[MR][kVecs] = {};
  for (int64_t r = 0; r < K / 32; ++r) {
    const uint8_t* rec = panel + r * F::kBytes;
    PrefetchAhead<Stream>(rec, F::kBytes);
    const F f(rec);
    const int32_t* xq[MR];
    for (int i = 0; i < MR; ++i) xq[i] = x.Words(m0 + i, r);
    for (int v = 0; v < kVecs; ++v) {
      // Each vector broadcasts x's words again, from memory into the dot products: without this barrier GCC
      // keeps every broadcast of the first vector in a register for the second and spills them to the stack.
      asm volatile("" ::: "memory");
      specjax::ivec ia[MR] = {};
      f.template Dot<MR>(v, xq, ia);
      for (int i = 0; i < MR; ++i) acc[i][v] += f.Finish(v, ia[i], x.Stats(m0 + i, r));
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kVecs; ++v) StoreVec(y + (m0 + m) * N + n0 + v * kLanes, acc[m][v]);
}

template <int MR, typename F, bool Stream>
inline void TileDotIf(int64_t rows, const QuantizedX& x, const uint8_t* panel, float* y, int64_t K, int64_t N,
                      int64_t m0, int64_t n0) {
  if constexpr (MR > 0) {
    if (rows == MR) return TileDot<MR, F, Stream>(x, panel, y, K, N, m0, n0);
    TileDotIf<MR - 1, F, Stream>(rows, x, panel, y, K, N, m0, n0);
  }
}

template <typename F, bool Stream, typename Pool>
void RunDot(Pool& pool, const float* x, const void* w, float* y, int64_t M, int64_t K, int64_t panels) {
  const QuantizedX qx(pool, x, M, K);
  const QuantizedX* qp = &qx;
  const int64_t chunks = (panels + kChunk - 1) / kChunk, N = panels * kPanel;
  const uint8_t* wb = static_cast<const uint8_t*>(w);
  specjax::ParallelFor(pool, chunks, [=](int64_t c) {
    const int64_t p0 = c * kChunk, p1 = p0 + kChunk < panels ? p0 + kChunk : panels;
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* panel = wb + p * (K / 32) * F::kBytes;
      int64_t m0 = 0;
      for (; m0 + kRowGroup <= M; m0 += kRowGroup)
        TileDot<kRowGroup, F, Stream>(*qp, panel, y, K, N, m0, p * kPanel);
      TileDotIf<kRowGroup - 1, F, Stream>(M - m0, *qp, panel, y, K, N, m0, p * kPanel);
    }
  });
}

// y[m0 + m, n0 : n0 + kPanel] = sum_k x[m0 + m, k] * panel[k, :] for m < MR, k ascending in every format.
template <int MR, typename F, bool Stream>
inline void Tile(const float* x, const uint8_t* panel, float* y, int64_t K, int64_t N, int64_t m0, int64_t n0) {
  fvec acc[MR][kVecs] = {};
  for (int64_t r = 0; r < K / F::kK; ++r) {
    const uint8_t* rec = panel + r * F::kBytes;
    PrefetchAhead<Stream>(rec, F::kBytes);
    const F f(rec);
    for (int j = 0; j < F::kSteps; ++j) {
      fvec w[F::kSub][kVecs];
      f.Load(j, w);
      for (int s = 0; s < F::kSub; ++s) {
        const int64_t k = r * F::kK + j * F::kSub + s;
        for (int m = 0; m < MR; ++m) {
          const float xs = x[(m0 + m) * K + k];
          for (int v = 0; v < kVecs; ++v) acc[m][v] += w[s][v] * xs;
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kVecs; ++v) StoreVec(y + (m0 + m) * N + n0 + v * kLanes, acc[m][v]);
}

template <int MR, typename F, bool Stream>
inline void TileIf(int64_t rows, const float* x, const uint8_t* panel, float* y, int64_t K, int64_t N, int64_t m0,
                   int64_t n0) {
  if constexpr (MR > 0) {
    if (rows == MR) return Tile<MR, F, Stream>(x, panel, y, K, N, m0, n0);
    TileIf<MR - 1, F, Stream>(rows, x, panel, y, K, N, m0, n0);
  }
}

// Panels [p0, p1) for all M rows; a panel is re-read (from cache) once per row group, and a quantized one
// dequantized again: keeping the first group's float32 weights for the next groups (a per-thread copy in L2)
// was not faster (SmolLM2 batch 8, K = 4, 40 rows: 1.01x; batch 1, K = 8, 9 rows: 0.94x).
template <typename F, bool Stream>
void Panels(const float* x, const uint8_t* w, float* y, int64_t M, int64_t K, int64_t N, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* panel = w + p * (K / F::kK) * F::kBytes;
    int64_t m0 = 0;
    for (; m0 + kRowGroup <= M; m0 += kRowGroup) Tile<kRowGroup, F, Stream>(x, panel, y, K, N, m0, p * kPanel);
    TileIf<kRowGroup - 1, F, Stream>(M - m0, x, panel, y, K, N, m0, p * kPanel);
  }
}

template <typename F, bool Stream, typename Pool>
void Run(Pool& pool, const float* x, const void* w, float* y, int64_t M, int64_t K, int64_t panels) {
  int64_t chunks = (panels + kChunk - 1) / kChunk;
  const uint8_t* wb = static_cast<const uint8_t*>(w);
  specjax::ParallelFor(pool, chunks, [=](int64_t c) {
    int64_t p0 = c * kChunk, p1 = p0 + kChunk < panels ? p0 + kChunk : panels;
    Panels<F, Stream>(x, wb, y, M, K, panels * kPanel, p0, p1);
  });
}

// The format of panels w [P, K / kK, record elements] (kNone when w matches none), and their K in *K.
// float32 / bfloat16: [P, K, kPanel]; uint8: Q4_1 records [P, K / 32, 20 kPanel]; int8: Q8_0 [P, K / 32, 34 kPanel];
// uint32: Q4_1Dot [P, K / 32, 5 kPanel]; int32: Q8_0Dot [P, K / 32, 34 kPanel / 4].
enum class Format { kF32, kBF16, kQ4_1, kQ8_0, kQ4_1Dot, kQ8_0Dot, kNone };

inline Format FormatOf(const ffi::AnyBuffer& w, int64_t* K) {
  auto wd = w.dimensions();
  if (wd.size() != 3) return Format::kNone;
  switch (w.element_type()) {
    case ffi::F32: *K = wd[1]; return wd[2] == kPanel ? Format::kF32 : Format::kNone;
    case ffi::BF16: *K = wd[1]; return wd[2] == kPanel ? Format::kBF16 : Format::kNone;
    case ffi::U8: *K = wd[1] * 32; return wd[2] == Q4_1::kBytes ? Format::kQ4_1 : Format::kNone;
    case ffi::S8: *K = wd[1] * 32; return wd[2] == Q8_0::kBytes ? Format::kQ8_0 : Format::kNone;
    case ffi::U32: *K = wd[1] * 32; return wd[2] * 4 == Q4_1Dot::kBytes ? Format::kQ4_1Dot : Format::kNone;
    case ffi::S32: *K = wd[1] * 32; return wd[2] * 4 == Q8_0Dot::kBytes ? Format::kQ8_0Dot : Format::kNone;
    default: return Format::kNone;
  }
}

template <typename F>
struct Tag {
  using type = F;
};

// Calls fn(Tag<F>{}) for the format's record type F.
template <typename Fn>
void WithFormat(Format f, Fn fn) {
  switch (f) {
    case Format::kF32: return fn(Tag<Dense<float>>{});
    case Format::kBF16: return fn(Tag<Dense<uint16_t>>{});
    case Format::kQ4_1: return fn(Tag<Q4_1>{});
    case Format::kQ8_0: return fn(Tag<Q8_0>{});
    case Format::kQ4_1Dot: return fn(Tag<Q4_1Dot>{});
    case Format::kQ8_0Dot: return fn(Tag<Q8_0Dot>{});
    case Format::kNone: return;
  }
}

// y[M, P kPanel] = x[M, K] . panels w [P, ...]^T in w's format (FormatOf, which must not be kNone). stream: the
// model's weights exceed the last-level cache (the prefetch above; the products are the same either way).
template <typename Pool>
void Matmul(Pool& pool, Format format, const float* x, const void* w, float* y, int64_t M, int64_t K,
            int64_t panels, bool stream) {
  WithFormat(format, [&](auto tag) {
    using F = typename decltype(tag)::type;
    const auto run = [&](auto streams) {
      if constexpr (std::is_same_v<F, Q4_1Dot> || std::is_same_v<F, Q8_0Dot>)
        RunDot<F, decltype(streams)::value>(pool, x, w, y, M, K, panels);
      else
        Run<F, decltype(streams)::value>(pool, x, w, y, M, K, panels);
    };
    if (stream && M > 1)
      run(std::true_type{});
    else
      run(std::false_type{});
  });
}

}  // namespace specjax::panel

#endif  // SPECJAX_CPU_KERNELS_PANELS_H_

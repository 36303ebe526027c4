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
#include <type_traits>
#include <utility>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

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
typedef uint32_t uvec __attribute__((vector_size(4 * kLanes)));
typedef int32_t ivec __attribute__((vector_size(4 * kLanes)));

SPECJAX_INLINE fvec LoadVec(const float* p) {
  fvec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// bfloat16 -> float32: widened to 32 bits and shifted (exact). x86 widens with the one instruction that does it
// (vpmovzxwd): from the generic conversion GCC 12 made two half-width widenings and three shuffles per vector with
// AVX-512, all on the one shuffle port, which bounded the panel kernel's bfloat16 products (one thread, cache
// resident: 1 row 11.6 -> 21.5 GFMA/s, 5 rows 42 -> 62).
SPECJAX_INLINE fvec LoadVec(const uint16_t* p) {
#if defined(__AVX512F__)
  return (fvec)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#elif defined(__AVX2__)
  return (fvec)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
#else
  typedef uint16_t hvec __attribute__((vector_size(2 * kLanes)));
  hvec h;
  std::memcpy(&h, p, sizeof h);
  uvec u = __builtin_convertvector(h, uvec) << 16;
  fvec v;
  std::memcpy(&v, &u, sizeof v);
  return v;
#endif
}

SPECJAX_INLINE void StoreVec(float* p, fvec v) { std::memcpy(p, &v, sizeof v); }

// kLanes bytes widened to int32 lanes (uint8_t zero-, int8_t sign-extended). GCC 12 scalarizes a one-step
// __builtin_convertvector from bytes to int32 (16 moves and inserts per vector), so x86 uses the one
// instruction that does it (vpmovzxbd / vpmovsxbd).
template <typename B>
SPECJAX_INLINE ivec LoadBytes(const B* p) {
  constexpr bool kSigned = std::is_signed_v<B>;
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (ivec)(kSigned ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return (ivec)(kSigned ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
#else
  typedef B bvec __attribute__((vector_size(kLanes)));
  bvec b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, ivec);
#endif
}

// kLanes 32-bit words (4 bytes each) from p.
SPECJAX_INLINE uvec LoadWords(const uint8_t* p) {
  uvec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// AVX2 without VNNI (AMD Zen 1-3, Intel before Alder Lake): byte dot products by vpmaddubsw, which multiplies
// unsigned by signed bytes and sums pairs into int16 lanes, saturating, then vpmaddwd into the int32 lanes.
#if defined(__AVX2__) && !defined(__AVX512F__) && !defined(__AVXVNNI__)
#define SPECJAX_AVX2_BYTE_DOTS 1
#else
#define SPECJAX_AVX2_BYTE_DOTS 0
#endif
// The quantized weights' byte dot products take signed weight bytes (DotSignedBytes) where that is the machine's
// cheaper form, else unsigned ones offset by 128 (DotBytes).
constexpr bool kSignedByteDots = SPECJAX_AVX2_BYTE_DOTS;

// acc + the sums over each lane's 4 bytes of u's unsigned byte times x4's signed byte (x4: 4 int8 in one word,
// the same for every lane, each in [-127, 127] as QuantizedX makes them): VNNI's vpdpbusd where the machine has it
// (no saturation: int32 sums), else the same arithmetic in generic vector code.
SPECJAX_INLINE ivec DotBytes(ivec acc, uvec u, int32_t x4) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  return (ivec)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)u, _mm512_set1_epi32(x4));
#elif defined(__AVXVNNI__) && defined(__AVX__) && !defined(__AVX512F__)
  return (ivec)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)u, _mm256_set1_epi32(x4));
#else
  for (int b = 0; b < 4; ++b)
    acc += (ivec)((u >> (8 * b)) & 255u) * static_cast<int32_t>(static_cast<int8_t>(x4 >> (8 * b)));
  return acc;
#endif
}

// DotBytes for u's bytes at most 127 (4-bit weights): on AVX2 without VNNI one vpmaddubsw, which cannot saturate
// there (a pair sums to at most 2 * 127 * 127 = 32258 in magnitude).
SPECJAX_INLINE ivec DotSmallBytes(ivec acc, uvec u, int32_t x4) {
#if SPECJAX_AVX2_BYTE_DOTS
  const __m256i pairs = _mm256_maddubs_epi16((__m256i)u, _mm256_set1_epi32(x4));
  return acc + (ivec)_mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#else
  return DotBytes(acc, u, x4);
#endif
}

// acc + the sums over each lane's 4 bytes of s's signed byte times x4's (x4 as in DotBytes): on AVX2 |s| times x
// with s's sign, as llama.cpp's AVX2 dot products do (a pair is at most 2 * 128 * 127 = 32512 in magnitude: exact;
// vpmaddubsw on the unsigned s + 128 would saturate), else the same arithmetic in generic vector code.
SPECJAX_INLINE ivec DotSignedBytes(ivec acc, uvec s, int32_t x4) {
#if SPECJAX_AVX2_BYTE_DOTS
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8((__m256i)s), _mm256_sign_epi8(_mm256_set1_epi32(x4),
                                                                                           (__m256i)s));
  return acc + (ivec)_mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#else
  for (int b = 0; b < 4; ++b)
    acc += ((ivec)(s << (24 - 8 * b)) >> 24) * static_cast<int32_t>(static_cast<int8_t>(x4 >> (8 * b)));
  return acc;
#endif
}

// exp(v) for v clamped to [-87, 88] (exp(-87) ~ 1.6e-38 stays a normal float): range reduction to 2^k * exp(r),
// |r| <= ln2 / 2, and a degree-6 Taylor polynomial (truncation < 1e-7 relative, about float32 rounding), in plain
// arithmetic the compiler vectorizes in a loop (with -fno-trapping-math, build.py: the clamps are vector max / min).
SPECJAX_INLINE float Exp(float v) {
  constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  v = v > -87.f ? v : -87.f;
  v = v < 88.f ? v : 88.f;
  const float k = (v * kLog2e + kRound) - kRound;
  const float r = (v - k * kLn2Hi) - k * kLn2Lo;
  const float p = 1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720))))));
  return p * __builtin_bit_cast(float, (static_cast<int32_t>(k) + 127) << 23);
}

// float16 bits -> float32 (exact; every float16 is a float32).
SPECJAX_INLINE float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023;
  uint32_t u;
  if (exp == 31) {
    u = sign | 0x7F800000u | (man << 13);  // inf, nan
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else {  // zero or subnormal: man * 2^-24
    float f = static_cast<float>(man) * 5.9604644775390625e-8f;
    return sign ? -f : f;
  }
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// kLanes float16 -> float32 (F16C's vcvtph2ps where the machine has it).
SPECJAX_INLINE fvec LoadHalfVec(const uint16_t* p) {
#if defined(__AVX512F__)
  return (fvec)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__AVX__) && defined(__F16C__)
  return (fvec)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  fvec v;
  for (int i = 0; i < kLanes; ++i) v[i] = HalfToFloat(p[i]);
  return v;
#endif
}

SPECJAX_INLINE float ToFloat(float x) { return x; }

SPECJAX_INLINE float ToFloat(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// A kLanes x kLanes block v[row][lane] transposed in place, in registers: log2(kLanes) stages, each swapping
// the off-diagonal d x d blocks of every 2d x 2d block with two-source shuffles (vpermt2ps on AVX-512).
SPECJAX_INLINE void TransposeBlock(fvec* v) {
  for (int d = kLanes / 2; d >= 1; d /= 2) {
    ivec lo, hi;
    for (int c = 0; c < kLanes; ++c) {
      lo[c] = (c & d) ? kLanes + c - d : c;  // row i keeps its own columns, takes row i + d's on the right
      hi[c] = (c & d) ? kLanes + c : c + d;  // row i + d takes row i's right columns, keeps its own
    }
    for (int i = 0; i < kLanes; ++i) {
      if (i & d) continue;
      const fvec a = v[i], b = v[i + d];
      v[i] = __builtin_shuffle(a, b, lo);
      v[i + d] = __builtin_shuffle(a, b, hi);
    }
  }
}

// A pool of one thread (the caller): ParallelFor(OneThread{}, ...) runs the tasks in order, scheduling nothing.
struct OneThread {
  int64_t num_threads() const { return 1; }
  template <typename T>
  void Schedule(T&&) {}
};

// Pool: xla::ffi::ThreadPool, or OneThread.
template <typename Pool, typename F>
void ParallelFor(Pool& pool, int64_t n, F task) {
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

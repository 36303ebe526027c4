// Causal attention of query tokens over each row's paged KV cache, on the CPU (issue 14).
//
// Kernel body (Attend) / XLA FFI handler (SpecjaxPagedAttention) / validated entry in
// models/cpu_kernels/paged_attention.py, with a numpy reference there.
//
// Why: the XLA path (specjax.attention.paged_attention_xla) gathers each 64-key chunk of
// the cache into a new array and runs small einsums in a loop; at decode sizes that is
// all overhead, and it grows with the number of query tokens, so on SmolLM2-135M a
// 5-token verify spent 1.6x a 1-token step's attention time. Here each task reads its
// keys and values once, in place through the block table, for every query token and
// every query head that shares the kv head, so a (K+1)-token verify reads the cache once.
//
// Semantics (those of paged_attention_xla): the query token at position p sees the keys
// at positions 0..p of its row; p < 0 (a padding token) sees nothing and gets zeros.
// Block-table entries < 0 read block 0 (such keys are beyond every valid position).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using specjax::fvec;
using specjax::kLanes;
using specjax::LoadVec;
using specjax::StoreVec;
using specjax::ToFloat;

constexpr int64_t kKeys = 64;         // keys per softmax chunk: scores of a chunk stay in L1
constexpr int64_t kQueryTokens = 16;  // query tokens per task (prefill chunks split over threads)

struct Shape {
  int64_t B, T, H, G, E, M, block_size, num_blocks;
  float scale;
};

// Cache slot of key position pos of a row (table entries < 0 read block 0; out-of-range ids are clamped).
inline int64_t Slot(const int32_t* table, const Shape& s, int64_t pos) {
  const int64_t block = std::clamp<int64_t>(table[pos / s.block_size], 0, s.num_blocks - 1);
  return block * s.block_size + pos % s.block_size;
}

// Where the values (or keys) c0..c0+nk-1 of kv head g are: rows[j] -> [E] in the cache.
template <typename KV>
void Rows(const KV* cache, const int32_t* table, const Shape& s, int64_t g, int64_t c0, int64_t nk, const KV** rows) {
  for (int64_t j = 0; j < nk; ++j) rows[j] = cache + (Slot(table, s, c0 + j) * s.G + g) * s.E;
}

// Keys rows[0..nk) as float32, transposed: dst[e * kKeys + j] = rows[j][e] (columns past nk are zero). Keys
// along the vector lanes let a query row's scores be broadcast FMAs, with no horizontal sums. Moved in 8 x 8
// blocks.
template <typename KV>
void Transpose(const KV* const* rows, int64_t nk, int64_t E, float* dst) {
  int64_t j0 = 0;
  for (; j0 + 8 <= nk; j0 += 8) {
    int64_t e0 = 0;
    for (; e0 + 8 <= E; e0 += 8)
      for (int jj = 0; jj < 8; ++jj)
        for (int ee = 0; ee < 8; ++ee) dst[(e0 + ee) * kKeys + j0 + jj] = ToFloat(rows[j0 + jj][e0 + ee]);
    for (; e0 < E; ++e0)
      for (int jj = 0; jj < 8; ++jj) dst[e0 * kKeys + j0 + jj] = ToFloat(rows[j0 + jj][e0]);
  }
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t j = j0; j < nk; ++j) dst[e * kKeys + j] = ToFloat(rows[j][e]);
    for (int64_t j = nk; j < kKeys; ++j) dst[e * kKeys + j] = 0.f;
  }
}

// x[j] = exp(x[j] - shift) for j < n, and their sum. Range reduction to 2^k * exp(r), |r| <= ln2 / 2, and
// a degree-6 Taylor polynomial (truncation < 1e-7 relative, about float32 rounding), in plain arithmetic the
// compiler vectorizes (with -fno-trapping-math, build.py: the clamp is then a vector max); libm's expf is one
// call per score. Inputs are <= shift (shift is their maximum).
inline float ExpShifted(float* __restrict x, int64_t n, float shift) {
  constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  for (int64_t j = 0; j < n; ++j) {
    const float d = x[j] - shift;
    const float v = d > -87.f ? d : -87.f;  // exp(-87) ~ 1.6e-38 stays a normal float
    const float k = (v * kLog2e + kRound) - kRound;
    const float r = (v - k * kLn2Hi) - k * kLn2Lo;
    const float p =
        1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720))))));
    x[j] = p * __builtin_bit_cast(float, (static_cast<int32_t>(k) + 127) << 23);
  }
  // The sum in 16 lanes (a serial float sum would not vectorize), then across them.
  float lanes[16] = {};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (int l = 0; l < 16; ++l) lanes[l] += x[j + l];
  float sum = 0.f;
  for (; j < n; ++j) sum += x[j];
  for (int l = 0; l < 16; ++l) sum += lanes[l];
  return sum;
}

// scores[j] = q . key_j for the kKeys keys of a transposed chunk: broadcast FMAs into kKeys / kLanes register
// accumulators, no horizontal sums.
inline void Scores(const float* q, const float* keys_t, int64_t E, float* scores) {
  constexpr int kAcc = kKeys / kLanes;
  fvec acc[kAcc] = {};
  for (int64_t e = 0; e < E; ++e) {
    const float x = q[e];
    const float* k = keys_t + e * kKeys;
    for (int a = 0; a < kAcc; ++a) acc[a] += x * LoadVec(k + a * kLanes);
  }
  for (int a = 0; a < kAcc; ++a) StoreVec(scores + a * kLanes, acc[a]);
}

// acc[:E] += sum_j p[j] * rows[j][:E] for j < nk, read in place from the cache: kLanes-wide column blocks of
// acc stay in registers over j (8 independent accumulators cover the FMA latency).
template <typename KV>
inline void WeighValues(const float* p, const KV* const* rows, int64_t nk, int64_t E, float* acc) {
  constexpr int kBlock = 8;
  int64_t e0 = 0;
  for (; e0 + kBlock * kLanes <= E; e0 += kBlock * kLanes) {
    fvec a[kBlock];
    for (int b = 0; b < kBlock; ++b) a[b] = LoadVec(acc + e0 + b * kLanes);
    for (int64_t j = 0; j < nk; ++j)
      for (int b = 0; b < kBlock; ++b) a[b] += p[j] * LoadVec(rows[j] + e0 + b * kLanes);
    for (int b = 0; b < kBlock; ++b) StoreVec(acc + e0 + b * kLanes, a[b]);
  }
  for (; e0 + kLanes <= E; e0 += kLanes) {
    fvec a = LoadVec(acc + e0);
    for (int64_t j = 0; j < nk; ++j) a += p[j] * LoadVec(rows[j] + e0);
    StoreVec(acc + e0, a);
  }
  for (; e0 < E; ++e0) {
    float a = acc[e0];
    for (int64_t j = 0; j < nk; ++j) a += p[j] * ToFloat(rows[j][e0]);
    acc[e0] = a;
  }
}

// Query tokens [t0, t1) of row b, the R = H / G query heads of kv head g.
template <typename KV>
void Attend(const float* q, const KV* kc, const KV* vc, const int32_t* positions, const int32_t* tables, float* out,
            const Shape& s, int64_t b, int64_t g, int64_t t0, int64_t t1) {
  const int64_t R = s.H / s.G, E = s.E, n = (t1 - t0) * R;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<float> qs(n * E), acc(n * E, 0.f), m(n, neg_inf), l(n, 0.f), p(n * kKeys), keys_t(kKeys * E);
  const KV* rows[kKeys];  // this chunk's keys, then its values, in the cache
  std::vector<int64_t> pos(n);
  int64_t max_pos = -1;
  for (int64_t t = t0; t < t1; ++t) {
    int64_t pt = positions[b * s.T + t];
    max_pos = std::max(max_pos, pt);
    for (int64_t r = 0; r < R; ++r) {
      int64_t i = (t - t0) * R + r;
      pos[i] = pt;
      const float* src = q + ((b * s.T + t) * s.H + g * R + r) * E;
      for (int64_t e = 0; e < E; ++e) qs[i * E + e] = src[e] * s.scale;
    }
  }
  const int32_t* table = tables + b * s.M;
  const int64_t num_keys = std::min(max_pos + 1, s.M * s.block_size);
  for (int64_t c0 = 0; c0 < num_keys; c0 += kKeys) {
    const int64_t nk = std::min(kKeys, num_keys - c0);
    Rows(kc, table, s, g, c0, nk, rows);
    Transpose(rows, nk, E, keys_t.data());
    for (int64_t i = 0; i < n; ++i) {
      float* pi = p.data() + i * kKeys;
      const int64_t visible = std::clamp<int64_t>(pos[i] - c0 + 1, 0, nk);  // keys c0..c0+visible-1
      if (visible > 0) Scores(qs.data() + i * E, keys_t.data(), E, pi);
      float mx = m[i];
      for (int64_t j = 0; j < visible; ++j) mx = std::max(mx, pi[j]);
      for (int64_t j = visible; j < nk; ++j) pi[j] = 0.f;
      if (visible == 0) continue;
      const float correction = std::exp(m[i] - mx);  // 0 when m[i] is still -inf
      l[i] = l[i] * correction + ExpShifted(pi, visible, mx);
      m[i] = mx;
      for (int64_t e = 0; e < E; ++e) acc[i * E + e] *= correction;
    }
    Rows(vc, table, s, g, c0, nk, rows);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t visible = std::clamp<int64_t>(pos[i] - c0 + 1, 0, nk);
      WeighValues(p.data() + i * kKeys, rows, visible, E, acc.data() + i * E);
    }
  }
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t r = 0; r < R; ++r) {
      int64_t i = (t - t0) * R + r;
      float* dst = out + ((b * s.T + t) * s.H + g * R + r) * E;
      const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
      for (int64_t e = 0; e < E; ++e) dst[e] = acc[i * E + e] * inv;
    }
  }
}

template <typename KV>
void Run(ffi::ThreadPool& pool, const float* q, const KV* kc, const KV* vc, const int32_t* positions,
         const int32_t* tables, float* out, const Shape& s) {
  const int64_t splits = (s.T + kQueryTokens - 1) / kQueryTokens;
  specjax::ParallelFor(pool, s.B * s.G * splits, [=](int64_t task) {
    const int64_t split = task % splits, bg = task / splits;
    const int64_t t0 = split * kQueryTokens, t1 = std::min(s.T, t0 + kQueryTokens);
    Attend(q, kc, vc, positions, tables, out, s, bg / s.G, bg % s.G, t0, t1);
  });
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                          ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> block_tables,
                          ffi::Result<ffi::AnyBuffer> out, int64_t block_size, float scale) {
  auto qd = q.dimensions(), kd = k_cache.dimensions(), vd = v_cache.dimensions();
  auto pd = positions.dimensions(), td = block_tables.dimensions(), od = out->dimensions();
  if (q.element_type() != ffi::F32 || qd.size() != 4)
    return ffi::Error::InvalidArgument("specjax_paged_attention: q must be float32 [B, T, H, E]");
  if (kd.size() != 3 || vd.size() != 3 || kd[0] != vd[0] || kd[1] != vd[1] || kd[2] != qd[3] || vd[2] != qd[3] ||
      k_cache.element_type() != v_cache.element_type())
    return ffi::Error::InvalidArgument("specjax_paged_attention: k/v caches must be [num_slots, G, E] alike");
  if (kd[1] <= 0 || qd[2] % kd[1] != 0)
    return ffi::Error::InvalidArgument("specjax_paged_attention: H must be a multiple of G");
  if (pd.size() != 2 || pd[0] != qd[0] || pd[1] != qd[1] || td.size() != 2 || td[0] != qd[0])
    return ffi::Error::InvalidArgument("specjax_paged_attention: positions [B, T], block_tables [B, M]");
  if (out->element_type() != ffi::F32 || od.size() != 4 || od[0] != qd[0] || od[1] != qd[1] || od[2] != qd[2] ||
      od[3] != qd[3])
    return ffi::Error::InvalidArgument("specjax_paged_attention: out must be float32 like q");
  if (block_size <= 0 || kd[0] < block_size || kd[0] % block_size != 0)
    return ffi::Error::InvalidArgument("specjax_paged_attention: num_slots must be a multiple of block_size");
  Shape s{qd[0], qd[1], qd[2], kd[1], qd[3], td[1], block_size, kd[0] / block_size, scale};
  const float* qp = static_cast<const float*>(q.untyped_data());
  float* op = static_cast<float*>(out->untyped_data());
  if (k_cache.element_type() == ffi::F32) {
    Run(pool, qp, static_cast<const float*>(k_cache.untyped_data()), static_cast<const float*>(v_cache.untyped_data()),
        positions.typed_data(), block_tables.typed_data(), op, s);
  } else if (k_cache.element_type() == ffi::BF16) {
    Run(pool, qp, static_cast<const uint16_t*>(k_cache.untyped_data()),
        static_cast<const uint16_t*>(v_cache.untyped_data()), positions.typed_data(), block_tables.typed_data(), op,
        s);
  } else {
    return ffi::Error::InvalidArgument("specjax_paged_attention: the caches must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxPagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // q [B, T, H, E] float32
                                  .Arg<ffi::AnyBuffer>()         // k_cache [num_slots, G, E] float32 or bfloat16
                                  .Arg<ffi::AnyBuffer>()         // v_cache, like k_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions [B, T]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables [B, M]
                                  .Ret<ffi::AnyBuffer>()         // out [B, T, H, E] float32
                                  .Attr<int64_t>("block_size")
                                  .Attr<float>("scale"));

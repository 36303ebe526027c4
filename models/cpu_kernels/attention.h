// Causal attention of query tokens over each row's paged KV cache, on the CPU (issue 14).
//
// Kernel body (Attend, here) / XLA FFI handler (SpecjaxPagedAttention, paged_attention.cc) / validated entry
// in models/cpu_kernels/paged_attention.py, with a numpy reference there. The fused decoder layer
// (decoder_layer.cc) calls the same body.
//
// Why: the XLA path (specjax.attention.paged_attention_xla) gathers each 64-key chunk of
// the cache into a new array and runs small einsums in a loop; at decode sizes that is
// all overhead, and it grows with the number of query tokens, so on SmolLM2-135M a
// 5-token verify spent 1.6x a 1-token step's attention time. Here a task (a row's query
// tokens; a part of its keys or of its kv heads when the rows alone leave threads idle)
// reads each cache slot once, in place through the block table, all its kv heads at once,
// for every query token and query head, so a (K+1)-token verify reads the cache once.
//
// Semantics (those of paged_attention_xla): the query token at position p sees the keys
// at positions 0..p of its row; p < 0 (a padding token) sees nothing and gets zeros.
// Block-table entries < 0 read block 0 (such keys are beyond every valid position).

#ifndef SPECJAX_CPU_KERNELS_ATTENTION_H_
#define SPECJAX_CPU_KERNELS_ATTENTION_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace specjax::attention {

namespace ffi = xla::ffi;
using specjax::fvec;
using specjax::kLanes;
using specjax::LoadVec;
using specjax::StoreVec;
using specjax::ToFloat;
using specjax::TransposeBlock;

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

// Where the values (or keys) of positions c0..c0+nk-1 are: slots[j] -> [G, E] in the cache. The cache lines of
// kv heads [g0, g1) are requested (into L2) ahead of their use: the slots are scattered over blocks.
template <typename KV>
void SlotRows(const KV* cache, const int32_t* table, const Shape& s, int64_t c0, int64_t nk, int64_t g0, int64_t g1,
              const KV** slots) {
  const int64_t begin = g0 * s.E * int64_t(sizeof(KV)), end = g1 * s.E * int64_t(sizeof(KV));
  for (int64_t j = 0; j < nk; ++j) {
    slots[j] = cache + Slot(table, s, c0 + j) * s.G * s.E;
    for (int64_t off = begin; off < end; off += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(slots[j]) + off, 0, 2);
  }
}

// Keys rows[0..nk) as float32, transposed: dst[e * kKeys + j] = rows[j][e] (columns past nk are zero). Keys
// along the vector lanes let a query row's scores be broadcast FMAs, with no horizontal sums. Moved in
// kLanes x kLanes blocks transposed in registers (TransposeBlock); GCC turned the scalar version into gathers,
// a fifth of the kernel's time.
template <typename KV>
void Transpose(const KV* const* rows, int64_t nk, int64_t E, float* dst) {
  const int64_t e_vec = E - E % kLanes;
  int64_t j0 = 0;
  for (; j0 < nk; j0 += kLanes) {
    const bool full = j0 + kLanes <= nk;
    for (int64_t e0 = 0; e0 < e_vec; e0 += kLanes) {
      fvec block[kLanes];
      if (full) {
        for (int jj = 0; jj < kLanes; ++jj) block[jj] = LoadVec(rows[j0 + jj] + e0);
      } else {
        for (int jj = 0; jj < kLanes; ++jj) block[jj] = j0 + jj < nk ? LoadVec(rows[j0 + jj] + e0) : fvec{};
      }
      TransposeBlock(block);
      for (int ee = 0; ee < kLanes; ++ee) StoreVec(dst + (e0 + ee) * kKeys + j0, block[ee]);
    }
  }
  for (; j0 < kKeys; j0 += kLanes)
    for (int64_t e = 0; e < e_vec; ++e) StoreVec(dst + e * kKeys + j0, fvec{});
  for (int64_t e = e_vec; e < E; ++e) {
    for (int64_t j = 0; j < nk; ++j) dst[e * kKeys + j] = ToFloat(rows[j][e]);
    for (int64_t j = nk; j < kKeys; ++j) dst[e * kKeys + j] = 0.f;
  }
}

// max(init, x[0..n)): in kLanes lanes, then across them (a serial max is one dependent vmaxss per score).
inline float MaxOf(const float* x, int64_t n, float init) {
  fvec lanes = fvec{} + init;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const fvec v = LoadVec(x + j);
    lanes = v > lanes ? v : lanes;
  }
  float mx = init;
  for (; j < n; ++j) mx = std::max(mx, x[j]);
  for (int l = 0; l < kLanes; ++l) mx = std::max(mx, lanes[l]);
  return mx;
}

// x[j] = exp(x[j] - shift) for j < n (specjax::Exp: libm's expf is one call per score), and their sum. Inputs are
// <= shift (shift is their maximum).
inline float ExpShifted(float* __restrict x, int64_t n, float shift) {
  for (int64_t j = 0; j < n; ++j) x[j] = specjax::Exp(x[j] - shift);
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

// f(std::integral_constant<int, NR>, i) over rows i in groups of NR = 4 (then 3, 2 or 1): the row-group
// kernels below load each key or value vector once for NR query rows.
template <typename F>
SPECJAX_INLINE void ForRowGroups(int64_t n, F f) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) f(std::integral_constant<int, 4>{}, i);
  switch (n - i) {
    case 3: f(std::integral_constant<int, 3>{}, i); break;
    case 2: f(std::integral_constant<int, 2>{}, i); break;
    case 1: f(std::integral_constant<int, 1>{}, i); break;
    default: break;
  }
}

// scores[r][j] = q[r] . key_j for NR query rows (stride E) and the kKeys keys of a transposed chunk: broadcast
// FMAs into NR * kKeys / kLanes register accumulators, no horizontal sums.
template <int NR>
SPECJAX_INLINE void Scores(const float* q, const float* keys_t, int64_t E, float* scores) {
  constexpr int kAcc = kKeys / kLanes;
  fvec acc[NR][kAcc] = {};
  for (int64_t e = 0; e < E; ++e) {
    fvec k[kAcc];
    for (int a = 0; a < kAcc; ++a) k[a] = LoadVec(keys_t + e * kKeys + a * kLanes);
    for (int r = 0; r < NR; ++r) {
      const float x = q[r * E + e];
      for (int a = 0; a < kAcc; ++a) acc[r][a] += x * k[a];
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int a = 0; a < kAcc; ++a) StoreVec(scores + r * kKeys + a * kLanes, acc[r][a]);
}

// acc[r][e0 : e0 + NB * kLanes] += sum_j p[r][j] * rows[j][same columns] for NR query rows (p stride kKeys, acc
// stride E) and j < nk: NR * NB register accumulators, each value vector read once for the NR rows.
template <int NR, int NB, typename KV>
SPECJAX_INLINE void WeighColumns(const float* p, const KV* const* rows, int64_t nk, int64_t E, int64_t e0,
                                 float* acc) {
  fvec a[NR][NB];
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NB; ++v) a[r][v] = LoadVec(acc + r * E + e0 + v * kLanes);
  for (int64_t j = 0; j < nk; ++j) {
    fvec x[NB];
    for (int v = 0; v < NB; ++v) x[v] = LoadVec(rows[j] + e0 + v * kLanes);
    for (int r = 0; r < NR; ++r)
      for (int v = 0; v < NB; ++v) a[r][v] += p[r * kKeys + j] * x[v];
  }
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NB; ++v) StoreVec(acc + r * E + e0 + v * kLanes, a[r][v]);
}

// acc[r][:E] += sum_j p[r][j] * rows[j][:E] for NR query rows and j < nk, read in place from the cache
// (p[r][j] is 0 past row r's visible keys), 4 vectors of columns at a time.
template <int NR, typename KV>
SPECJAX_INLINE void WeighValues(const float* p, const KV* const* rows, int64_t nk, int64_t E, float* acc) {
  int64_t e0 = 0;
  for (; e0 + 4 * kLanes <= E; e0 += 4 * kLanes) WeighColumns<NR, 4>(p, rows, nk, E, e0, acc);
  for (; e0 + kLanes <= E; e0 += kLanes) WeighColumns<NR, 1>(p, rows, nk, E, e0, acc);
  for (; e0 < E; ++e0)
    for (int r = 0; r < NR; ++r) {
      float a = acc[r * E + e0];
      for (int64_t j = 0; j < nk; ++j) a += p[r * kKeys + j] * ToFloat(rows[j][e0]);
      acc[r * E + e0] = a;
    }
}

// Query tokens [t0, t1) of row b, the query heads of kv heads [g0, g1), over the keys [first, last) of the
// positions they see, where first / last split those positions into ``splits`` parts (multiples of kLanes
// apart). With one split the result goes to out; with several, each query row's running max m, sum l and
// unnormalized acc go to part[(query row * splits + split) * (E + 2)] for Combine.
//
// A task reads those kv heads of each cache slot (contiguous in its [G, E] row; usually all of them) where one
// task per kv head read every G-th run of E values: the strided reads ran at a third of the bandwidth.
template <typename KV>
void Attend(const float* q, const KV* kc, const KV* vc, const int32_t* positions, const int32_t* tables, float* out,
            const Shape& s, int64_t b, int64_t t0, int64_t t1, int64_t g0, int64_t g1, int64_t split, int64_t splits,
            float* part) {
  // Row i = (g - g0) * per_head + (t - t0) * R + r holds query head h = g * R + r of token t: a kv head's rows
  // are contiguous, for the row-group kernels.
  const int64_t R = s.H / s.G, E = s.E, per_head = (t1 - t0) * R, n = per_head * (g1 - g0);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<float> qs(n * E), acc(n * E, 0.f), m(n, neg_inf), l(n, 0.f), p(n * kKeys), keys_t(kKeys * E);
  std::vector<int64_t> pos(n), qrow(n);  // qrow: the row's index in q and out ([B, T, H] flattened)
  const KV* key_slots[2][kKeys];  // this chunk's keys, the next chunk's
  const KV* value_slots[kKeys];
  const KV* rows[kKeys];  // one kv head's keys or values within the slots
  int64_t max_pos = -1;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t pt = positions[b * s.T + t];
    max_pos = std::max(max_pos, pt);
    for (int64_t h = g0 * R; h < g1 * R; ++h) {
      const int64_t i = (h / R - g0) * per_head + (t - t0) * R + h % R;
      pos[i] = pt;
      qrow[i] = (b * s.T + t) * s.H + h;
      for (int64_t e = 0; e < E; ++e) qs[i * E + e] = q[qrow[i] * E + e] * s.scale;
    }
  }
  const int32_t* table = tables + b * s.M;
  const int64_t seen = std::min(max_pos + 1, s.M * s.block_size);  // key positions any token sees
  const int64_t first = seen * split / splits / kLanes * kLanes;
  const int64_t last = split + 1 == splits ? seen : seen * (split + 1) / splits / kLanes * kLanes;
  if (first < last) SlotRows(kc, table, s, first, std::min(kKeys, last - first), g0, g1, key_slots[0]);
  for (int64_t c0 = first, c = 0; c0 < last; c0 += kKeys, c ^= 1) {
    const int64_t nk = std::min(kKeys, last - c0);
    SlotRows(vc, table, s, c0, nk, g0, g1, value_slots);
    if (c0 + kKeys < last)
      SlotRows(kc, table, s, c0 + kKeys, std::min(kKeys, last - c0 - kKeys), g0, g1, key_slots[c ^ 1]);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t i0 = (g - g0) * per_head;
      for (int64_t j = 0; j < nk; ++j) rows[j] = key_slots[c][j] + g * E;
      Transpose(rows, nk, E, keys_t.data());
      ForRowGroups(per_head, [&](auto nr, int64_t i) {
        Scores<decltype(nr)::value>(qs.data() + (i0 + i) * E, keys_t.data(), E, p.data() + (i0 + i) * kKeys);
      });
      int64_t weigh = 0;  // keys any of the kv head's rows sees
      for (int64_t i = i0; i < i0 + per_head; ++i) {
        float* pi = p.data() + i * kKeys;
        const int64_t visible = std::clamp<int64_t>(pos[i] - c0 + 1, 0, nk);  // keys c0..c0+visible-1
        weigh = std::max(weigh, visible);
        const float mx = MaxOf(pi, visible, m[i]);
        for (int64_t j = visible; j < nk; ++j) pi[j] = 0.f;
        if (visible == 0) continue;
        const float correction = std::exp(m[i] - mx);  // 0 when m[i] is still -inf
        l[i] = l[i] * correction + ExpShifted(pi, visible, mx);
        m[i] = mx;
        for (int64_t e = 0; e < E; ++e) acc[i * E + e] *= correction;
      }
      for (int64_t j = 0; j < weigh; ++j) rows[j] = value_slots[j] + g * E;
      ForRowGroups(per_head, [&](auto nr, int64_t i) {
        WeighValues<decltype(nr)::value>(p.data() + (i0 + i) * kKeys, rows, weigh, E, acc.data() + (i0 + i) * E);
      });
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    if (splits > 1) {
      float* dst = part + (qrow[i] * splits + split) * (E + 2);
      dst[0] = m[i];
      dst[1] = l[i];
      std::copy_n(acc.data() + i * E, E, dst + 2);
      continue;
    }
    float* dst = out + qrow[i] * E;
    const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
    for (int64_t e = 0; e < E; ++e) dst[e] = acc[i * E + e] * inv;
  }
}

// out[row] from the splits' partial softmax sums of query row ``row`` (Attend's part).
inline void Combine(const float* part, int64_t splits, int64_t E, float* out) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t k = 0; k < splits; ++k) mx = std::max(mx, part[k * (E + 2)]);
  std::fill_n(out, E, 0.f);
  if (mx == -std::numeric_limits<float>::infinity()) return;  // no visible key (padding)
  float l = 0.f;
  for (int64_t k = 0; k < splits; ++k) {
    const float* pk = part + k * (E + 2);
    if (pk[1] == 0.f) continue;
    const float w = std::exp(pk[0] - mx);
    l += pk[1] * w;
    for (int64_t e = 0; e < E; ++e) out[e] += pk[2 + e] * w;
  }
  const float inv = 1.f / l;
  for (int64_t e = 0; e < E; ++e) out[e] *= inv;
}

template <typename KV, typename Pool>
void Run(Pool& pool, const float* q, const KV* kc, const KV* vc, const int32_t* positions,
         const int32_t* tables, float* out, const Shape& s) {
  const int64_t t_splits = (s.T + kQueryTokens - 1) / kQueryTokens, tasks = s.B * t_splits;
  // Few tasks for the threads (batch 1: one) leave threads idle or unevenly loaded: each is then split into as
  // many parts as make the task count a multiple of the threads: its keys, where each part gets a chunk or more,
  // else its kv heads (the shipped 7.5M target at batch 1, contexts of 64-128: on one thread its plain decoding
  // took 1.13x the time).
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t k_splits = 1, g_splits = 1;
  if (tasks < 4 * threads && tasks % threads != 0) {
    const int64_t need = threads / std::gcd(tasks, threads);
    int32_t max_pos = -1;
    for (int64_t i = 0; i < s.B * s.T; ++i) max_pos = std::max(max_pos, positions[i]);
    if (max_pos + 1 >= need * kKeys || s.G == 1)
      k_splits = std::max<int64_t>(1, std::min<int64_t>(need, (max_pos + 1) / kLanes));
    else
      g_splits = std::min(need, s.G);
  }
  std::vector<float> part(k_splits > 1 ? s.B * s.T * s.H * k_splits * (s.E + 2) : 0);
  float* part_ptr = part.data();
  specjax::ParallelFor(pool, tasks * g_splits * k_splits, [=](int64_t task) {
    const int64_t k_split = task % k_splits, g_split = task / k_splits % g_splits;
    const int64_t rest = task / k_splits / g_splits, t_split = rest % t_splits, b = rest / t_splits;
    const int64_t t0 = t_split * kQueryTokens, t1 = std::min(s.T, t0 + kQueryTokens);
    const int64_t g0 = s.G * g_split / g_splits, g1 = s.G * (g_split + 1) / g_splits;
    Attend(q, kc, vc, positions, tables, out, s, b, t0, t1, g0, g1, k_split, k_splits, part_ptr);
  });
  if (k_splits > 1)
    for (int64_t row = 0; row < s.B * s.T * s.H; ++row)
      Combine(part_ptr + row * k_splits * (s.E + 2), k_splits, s.E, out + row * s.E);
}

}  // namespace specjax::attention

#endif  // SPECJAX_CPU_KERNELS_ATTENTION_H_

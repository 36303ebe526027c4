// One Llama decoder layer of a few query tokens in one call, on the CPU (issues 13 and 14).
//
// Kernel body (Layer, calling the panel kernel of panels.h and the attention of attention.h) / XLA FFI handler
// (SpecjaxDecoderLayer) / validated entry in models/cpu_kernels/decoder_layer.py, whose test checks it against
// the layer as separate operations (models/llama.py's DecoderLayer).
//
// Why: a layer in the CPU layout was ~30 operations (5 custom calls, ~25 XLA fusions for the norms, RoPE, the KV
// write, residual adds and SiLU), each with its own dispatch and pass over its inputs; a draft model runs K of
// its forwards in every speculative step. In one call the shipped pair's batch-1 steps took 0.89-0.95x the time
// and SmolLM2's 0.93-0.95x (benchmarks/README.md, "Verify cost on CPU").
//
// Semantics, those of DecoderLayer for a float32 residual stream, no biases, no q/k norms, SiLU MLP:
//   h = RMSNorm(x) * in_scale;  q, k, v = h . Wqkv^T (fused, q heads then k then v);  RoPE(q, k) (HF rotate-half,
//   cos and sin of each token's angles given);  k, v written to the caches at slot_mapping (slots
//   < 0 or past the cache write nothing; bfloat16 caches round to nearest even);  a = attention(q, caches);
//   x += a . Wo^T;  h = RMSNorm(x) * post_scale;  g, u = h . Wgu^T;  x += (silu(g) * u) . Wdown^T.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attention.h"
#include "panels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

namespace panel = specjax::panel;
namespace attention = specjax::attention;

constexpr int64_t kOneThreadWork = 1 << 19;  // multiply-adds below which a layer runs on one thread
constexpr int64_t kParallelRows = 16;  // rows from which the elementwise work goes over the pool

// y = x * rsqrt(mean(x^2) + eps) * scale for one row of D, as RMSNorm orders it (normalize, then scale).
void RmsNorm(const float* x, const float* scale, float* y, int64_t D, float eps) {
  float lanes[16] = {};
  int64_t d = 0;
  for (; d + 16 <= D; d += 16)
    for (int l = 0; l < 16; ++l) lanes[l] += x[d + l] * x[d + l];
  float sum = 0.f;
  for (; d < D; ++d) sum += x[d] * x[d];
  for (int l = 0; l < 16; ++l) sum += lanes[l];
  const float r = 1.f / std::sqrt(sum / static_cast<float>(D) + eps);
  for (d = 0; d < D; ++d) y[d] = (x[d] * r) * scale[d];
}

// Rotate-half RoPE of heads [n_heads, E] in place, cos_sin [E] = cos then sin of the token's E / 2 angles.
void Rope(float* heads, int64_t n_heads, int64_t E, const float* cos_sin) {
  const int64_t half = E / 2;
  for (int64_t h = 0; h < n_heads; ++h) {
    float* x = heads + h * E;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = x[i], x2 = x[half + i], c = cos_sin[i], s = cos_sin[half + i];
      x[i] = x1 * c - x2 * s;
      x[half + i] = x2 * c + x1 * s;
    }
  }
}

inline void Store(float* dst, float v) { *dst = v; }

inline void Store(uint16_t* dst, float v) {  // float32 -> bfloat16, round to nearest even (XLA's convert)
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  *dst = (u & 0x7fffffffu) > 0x7f800000u ? static_cast<uint16_t>((u >> 16) | 0x40u)
                                         : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

struct Weights {
  const float* in_scale;
  const float* post_scale;
  const float* rope;  // [B T, E]: per token cos then sin of its E / 2 angles
  const ffi::AnyBuffer* qkv;
  const ffi::AnyBuffer* o;
  const ffi::AnyBuffer* gate_up;
  const ffi::AnyBuffer* down;
  bool stream;  // the model's weights exceed the last-level cache (panel::Matmul)
};

// y = panels . x for a weight buffer already validated (FormatOf != kNone), into a [M, P kPanel] scratch; returns
// its row width P kPanel.
template <typename Pool>
int64_t Product(Pool& pool, const ffi::AnyBuffer& w, const float* x, int64_t M, std::vector<float>& y,
                bool stream) {
  int64_t K = -1;
  const panel::Format format = panel::FormatOf(w, &K);
  const int64_t panels = w.dimensions()[0];
  y.resize(M * panels * panel::kPanel);
  panel::Matmul(pool, format, x, w.untyped_data(), y.data(), M, K, panels, stream);
  return panels * panel::kPanel;
}

// fn(n) for rows n < N: over the pool for prefill-sized inputs, else in order on this thread (scheduling costs more
// than a few rows' norms and activations).
template <typename Pool, typename Fn>
void EachRow(Pool& pool, int64_t N, Fn fn) {
  if (N >= kParallelRows) {
    specjax::ParallelFor(pool, N, fn);
  } else {
    for (int64_t n = 0; n < N; ++n) fn(n);
  }
}

template <typename KV, typename Pool>
void Layer(Pool& pool, const float* x, const int32_t* positions, const int32_t* slots,
           const int32_t* tables, KV* kc, KV* vc, const Weights& w, float* out, const attention::Shape& s,
           int64_t D, int64_t F, int64_t num_slots, float eps) {
  const int64_t N = s.B * s.T, H = s.H, G = s.G, E = s.E;
  std::vector<float> h(N * D), qkv, q(N * H * E), attn(N * H * E), proj, act(N * F);
  float* hp = h.data();
  EachRow(pool, N, [&](int64_t n) { RmsNorm(x + n * D, w.in_scale, hp + n * D, D, eps); });
  const int64_t stride = Product(pool, *w.qkv, hp, N, qkv, w.stream);
  EachRow(pool, N, [&](int64_t n) {
    float* row = qkv.data() + n * stride;  // q heads, k heads, v heads
    Rope(row, H + G, E, w.rope + n * E);
    std::memcpy(q.data() + n * H * E, row, H * E * sizeof(float));
    const int64_t slot = slots[n];
    if (slot < 0 || slot >= num_slots) return;
    for (int64_t i = 0; i < G * E; ++i) {
      Store(kc + slot * G * E + i, row[H * E + i]);
      Store(vc + slot * G * E + i, row[(H + G) * E + i]);
    }
  });
  attention::Run(pool, q.data(), kc, vc, positions, tables, attn.data(), s);
  int64_t width = Product(pool, *w.o, attn.data(), N, proj, w.stream);
  EachRow(pool, N, [&](int64_t n) {  // the residual, then the MLP's norm
    const float* p = proj.data() + n * width;
    for (int64_t d = 0; d < D; ++d) out[n * D + d] = x[n * D + d] + p[d];
    RmsNorm(out + n * D, w.post_scale, hp + n * D, D, eps);
  });
  width = Product(pool, *w.gate_up, hp, N, proj, w.stream);
  EachRow(pool, N, [&](int64_t n) {
    const float* __restrict gate = proj.data() + n * width;
    float* __restrict a = act.data() + n * F;
    for (int64_t f = 0; f < F; ++f) a[f] = gate[f] / (1.f + specjax::Exp(-gate[f])) * gate[F + f];  // silu(g) u
  });
  width = Product(pool, *w.down, act.data(), N, proj, w.stream);
  EachRow(pool, N, [&](int64_t n) {
    const float* p = proj.data() + n * width;
    for (int64_t d = 0; d < D; ++d) out[n * D + d] += p[d];
  });
}

// Whether w is panels of at least `rows` output columns over K inputs.
bool Fits(const ffi::AnyBuffer& w, int64_t K, int64_t rows) {
  int64_t k = -1;
  return panel::FormatOf(w, &k) != panel::Format::kNone && k == K && w.dimensions()[0] * panel::kPanel >= rows;
}

ffi::Error DecoderLayer(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> positions,
                        ffi::Buffer<ffi::S32> slot_mapping, ffi::Buffer<ffi::S32> block_tables, ffi::AnyBuffer k_cache,
                        ffi::AnyBuffer v_cache, ffi::Buffer<ffi::F32> rope, ffi::Buffer<ffi::F32> in_scale,
                        ffi::AnyBuffer qkv, ffi::AnyBuffer o, ffi::Buffer<ffi::F32> post_scale, ffi::AnyBuffer gate_up,
                        ffi::AnyBuffer down, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> k_out,
                        ffi::Result<ffi::AnyBuffer> v_out, int64_t num_heads, int64_t intermediate, int64_t block_size,
                        float eps, float scale, bool stream) {
  auto xd = x.dimensions(), kd = k_cache.dimensions(), pd = positions.dimensions(), td = block_tables.dimensions();
  if (x.element_type() != ffi::F32 || xd.size() != 3 || out->element_type() != ffi::F32 ||
      out->dimensions().size() != 3 || out->element_count() != x.element_count())
    return ffi::Error::InvalidArgument("specjax_decoder_layer: x and out must be float32 [B, T, D]");
  const int64_t B = xd[0], T = xd[1], D = xd[2];
  auto vd = v_cache.dimensions();
  if (kd.size() != 3 || vd.size() != 3 || kd[0] != vd[0] || kd[1] != vd[1] || kd[2] != vd[2] ||
      k_cache.element_type() != v_cache.element_type() || k_out->element_type() != k_cache.element_type() ||
      v_out->element_type() != k_cache.element_type())
    return ffi::Error::InvalidArgument("specjax_decoder_layer: k/v caches must be [num_slots, G, E] alike");
  const int64_t G = kd[1], E = kd[2], H = num_heads;
  if (G <= 0 || H % G != 0 || E % 2 != 0 || rope.element_count() != B * T * E)
    return ffi::Error::InvalidArgument("specjax_decoder_layer: num_heads a multiple of G, even E, rope [B, T, E]");
  if (pd.size() != 2 || pd[0] != B || pd[1] != T || slot_mapping.element_count() != B * T || td.size() != 2 ||
      td[0] != B)
    return ffi::Error::InvalidArgument("specjax_decoder_layer: positions, slot_mapping [B, T], block_tables [B, M]");
  if (block_size <= 0 || kd[0] < block_size || kd[0] % block_size != 0)
    return ffi::Error::InvalidArgument("specjax_decoder_layer: num_slots must be a multiple of block_size");
  if (in_scale.element_count() != D || post_scale.element_count() != D)
    return ffi::Error::InvalidArgument("specjax_decoder_layer: the norm scales must be float32 [D]");
  if (!Fits(qkv, D, (H + 2 * G) * E) || !Fits(o, H * E, D) || !Fits(gate_up, D, 2 * intermediate) ||
      !Fits(down, intermediate, D))
    return ffi::Error::InvalidArgument(
        "specjax_decoder_layer: weights must be panels (see specjax_panel_matmul): qkv [(H + 2 G) E, D], "
        "o [D, H E], gate_up [2 F, D], down [D, F]");
  if (k_cache.element_type() != ffi::F32 && k_cache.element_type() != ffi::BF16)
    return ffi::Error::InvalidArgument("specjax_decoder_layer: the caches must be float32 or bfloat16");
  const attention::Shape s{B, T, H, G, E, td[1], block_size, kd[0] / block_size, scale};
  const Weights w{in_scale.typed_data(), post_scale.typed_data(), rope.typed_data(), &qkv, &o, &gate_up, &down,
                  stream};
  // The caches are aliased to k_out / v_out (the entry's input_output_aliases): written and read in place there.
  const float* xp = static_cast<const float*>(x.untyped_data());
  float* op = static_cast<float*>(out->untyped_data());
  const auto layer = [&](auto& workers) {
    if (k_cache.element_type() == ffi::F32)
      Layer(workers, xp, positions.typed_data(), slot_mapping.typed_data(), block_tables.typed_data(),
            static_cast<float*>(k_out->untyped_data()), static_cast<float*>(v_out->untyped_data()), w, op, s, D,
            intermediate, kd[0], eps);
    else
      Layer(workers, xp, positions.typed_data(), slot_mapping.typed_data(), block_tables.typed_data(),
            static_cast<uint16_t*>(k_out->untyped_data()), static_cast<uint16_t*>(v_out->untyped_data()), w, op,
            s, D, intermediate, kd[0], eps);
  };
  // A small layer runs on the calling thread alone: its products take a few microseconds, about what handing
  // half of each to the pool's helper costs.
  const int64_t work = B * T * D * ((H + 2 * G) * E + H * E + 3 * intermediate);  // multiply-adds
  if (work < kOneThreadWork) {
    specjax::OneThread one;
    layer(one);
  } else {
    layer(pool);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxDecoderLayer, DecoderLayer,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // x [B, T, D] float32
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions [B, T]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_mapping [B, T]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables [B, M]
                                  .Arg<ffi::AnyBuffer>()         // k_cache [num_slots, G, E] float32 or bfloat16
                                  .Arg<ffi::AnyBuffer>()         // v_cache, like k_cache
                                  .Arg<ffi::Buffer<ffi::F32>>()  // rope [B, T, E]: cos then sin of the angles
                                  .Arg<ffi::Buffer<ffi::F32>>()  // input_layernorm scale [D]
                                  .Arg<ffi::AnyBuffer>()         // qkv panels of [(H + 2 G) E, D]
                                  .Arg<ffi::AnyBuffer>()         // o panels of [D, H E]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // post_attention_layernorm scale [D]
                                  .Arg<ffi::AnyBuffer>()         // gate_up panels of [2 F, D]
                                  .Arg<ffi::AnyBuffer>()         // down panels of [D, F]
                                  .Ret<ffi::AnyBuffer>()         // out [B, T, D] float32
                                  .Ret<ffi::AnyBuffer>()         // k_cache, aliased to the argument
                                  .Ret<ffi::AnyBuffer>()         // v_cache, aliased to the argument
                                  .Attr<int64_t>("num_heads")
                                  .Attr<int64_t>("intermediate")
                                  .Attr<int64_t>("block_size")
                                  .Attr<float>("eps")
                                  .Attr<float>("scale")
                                  .Attr<bool>("stream"));  // the model's weights exceed the last-level cache

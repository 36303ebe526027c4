// XLA FFI handler of the paged-attention kernel (attention.h): causal attention of query tokens over each row's
// paged KV cache (SpecjaxPagedAttention). Validated entry in models/cpu_kernels/paged_attention.py, with a numpy
// reference there.

#include <cstdint>

#include "attention.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace specjax::attention;  // NOLINT: the kernel body

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

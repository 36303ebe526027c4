// XLA FFI handlers of the panel kernel (panels.h): y[M, N] = x[M, K] . W[N, K]^T with W stored as panels
// (SpecjaxPanelMatmul), and rows of panels as float32 (SpecjaxPanelRows, an embedding lookup). Validated entries
// in models/cpu_kernels/panel_matmul.py, with a numpy reference there.

#include <cstdint>

#include "panels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace specjax::panel;  // NOLINT: the kernel body's formats and runners

ffi::Error PanelMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y,
                       bool stream) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (x.element_type() != ffi::F32 || xd.size() != 2)
    return ffi::Error::InvalidArgument("specjax_panel_matmul: x must be float32 [M, K]");
  int64_t K = -1;
  const Format format = FormatOf(w, &K);
  if (format == Format::kNone || K != xd[1])
    return ffi::Error::InvalidArgument(
        "specjax_panel_matmul: w must be panels with x's K: float32 or bfloat16 [P, K, SpecjaxPanelWidth()], "
        "Q4_1 uint8 [P, K / 32, 20 SpecjaxPanelWidth()], Q8_0 int8 [P, K / 32, 34 SpecjaxPanelWidth()], or the "
        "dot-product layouts uint32 [P, K / 32, 5 SpecjaxPanelWidth()] and int32 "
        "[P, K / 32, 34 SpecjaxPanelWidth() / 4]");
  if (y->element_type() != ffi::F32 || yd.size() != 2 || yd[0] != xd[0] || yd[1] != wd[0] * kPanel)
    return ffi::Error::InvalidArgument("specjax_panel_matmul: y must be float32 [M, P * SpecjaxPanelWidth()]");
  const float* xp = static_cast<const float*>(x.untyped_data());
  float* yp = static_cast<float*>(y->untyped_data());
  Matmul(pool, format, xp, w.untyped_data(), yp, xd[0], K, wd[0], stream);
  return ffi::Error::Success();
}

// out[i, :] = W[id_i, :] in float32, read from the panels (an embedding lookup on a packed tied table); ids
// are clipped into [0, P * kPanel). Why a kernel: XLA:CPU gathers a bfloat16 table by widening all of it to
// float32 first, and in a head's drafting loop it hoists that widening out of the loop as a copy of the whole
// table (1.1 ms per step for the shipped 4096-row target); this reads only the rows asked for.
template <typename F>
void Rows(const int32_t* ids, const uint8_t* w, float* out, int64_t n, int64_t K, int64_t panels) {
  const int64_t last = panels * kPanel - 1, records = K / F::kK;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = ids[i] < 0 ? 0 : (ids[i] > last ? last : ids[i]);
    const uint8_t* panel = w + (id / kPanel) * records * F::kBytes;
    for (int64_t r = 0; r < records; ++r) {
      const F f(panel + r * F::kBytes);
      for (int k = 0; k < F::kK; ++k) out[i * K + r * F::kK + k] = f.At(k, id % kPanel);
    }
  }
}

ffi::Error PanelRows(ffi::Buffer<ffi::S32> ids, ffi::AnyBuffer w, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto wd = w.dimensions(), od = out->dimensions();
  const int64_t n = static_cast<int64_t>(ids.element_count());
  int64_t K = -1;
  const Format format = FormatOf(w, &K);
  if (format == Format::kNone)
    return ffi::Error::InvalidArgument("specjax_panel_rows: w must be panels (see specjax_panel_matmul)");
  if (od.size() != 2 || od[0] != n || od[1] != K)
    return ffi::Error::InvalidArgument("specjax_panel_rows: out must be float32 [number of ids, K]");
  WithFormat(format, [&](auto tag) {
    Rows<typename decltype(tag)::type>(ids.typed_data(), static_cast<const uint8_t*>(w.untyped_data()),
                                       out->typed_data(), n, K, wd[0]);
  });
  return ffi::Error::Success();
}

}  // namespace

// Output columns per panel in this build (what the packing in panel_matmul.py must use).
extern "C" int SpecjaxPanelWidth() { return static_cast<int>(kPanel); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxPanelMatmul, PanelMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [M, K] float32
                                  .Arg<ffi::AnyBuffer>()  // w panels in any format (FormatOf)
                                  .Ret<ffi::AnyBuffer>()  // y [M, kPanel * P] float32
                                  .Attr<bool>("stream")  // the model's weights exceed the last-level cache
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxPanelRows, PanelRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ids [...] int32
                                  .Arg<ffi::AnyBuffer>()  // w panels in any format (FormatOf)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [number of ids, K] float32
);

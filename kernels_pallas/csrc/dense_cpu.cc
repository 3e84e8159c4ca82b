// The model's dense projections on CPU, an XLA FFI custom call over panel-packed weights.
//
// Data flow: y f32[M, N] = x f32[M, K] @ W, where W [K, N] is stored as 16-column panels:
// panels f32[L, P, K, 16] (a stack of L layers' weights; or [P, K, 16], one weight),
// P = ceil(N / 16), W[k, j] = panels[layer, j / 16, k, j % 16] (columns past N are zero).
// `layer` is an s32 scalar. The engine packs its weights this way once at load
// (kernels_pallas/dense_cpu.py), because each panel is then one contiguous K x 64-byte run:
// - streaming it is a plain sequential read, which a decode step of a few rows needs (it is
//   bound by memory bandwidth), where [K, N] rows would be read 64 bytes per 6 KB stride;
// - the layer's panel is read where it lies in the stack: XLA's dot inside the scan over
//   layers first copies w[layer] out (a dynamic slice), then packs it again in its GEMM.
// On a 2-core EPYC, 576 x 1536, f32: M = 8 0.30 ms (XLA:CPU 0.5-0.9 ms), M = 512 6.4 ms
// (XLA 9.7 ms).
//
// Work items are (panel, row chunk) on XLA's intra-op thread pool (dense_common.h). Each item
// sweeps its panel down K once per block of up to 6 rows, 6 x 16 accumulators in registers;
// the panel (K x 64 bytes) stays in L2 between row blocks.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "dense_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxserve_dense::kPanel;
using jaxserve_dense::kRows;
using jaxserve_dense::rows_block;

ffi::Error Dense(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> panels,
                 ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  auto xd = x.dimensions(), pd = panels.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || (pd.size() != 3 && pd.size() != 4) || yd.size() != 2 ||
      pd[pd.size() - 1] != kPanel) {
    return ffi::Error::InvalidArgument(
        "dense: x must be [M, K], panels [L, P, K, 16] or [P, K, 16], y [M, N]");
  }
  const int64_t L = pd.size() == 4 ? pd[0] : 1, P = pd[pd.size() - 3], K = pd[pd.size() - 2];
  const int64_t M = xd[0], N = yd[1];
  if (xd[1] != K || yd[0] != M || N > P * kPanel || N <= (P - 1) * kPanel) {
    return ffi::Error::InvalidArgument("dense: x / panels / y shapes do not agree");
  }
  if (layer.element_count() != 1) {
    return ffi::Error::InvalidArgument("dense: layer must be one s32");
  }
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("dense: layer index out of range");
  if (M == 0) return ffi::Error::Success();
  const float* xs = x.typed_data();
  const float* base = panels.typed_data() + l * P * K * kPanel;
  float* ys = y->typed_data();
  // Rows [r0, r1) of y's columns [16 j, 16 j + 16) (fewer in the last panel).
  auto item = [=](int64_t j, int64_t r0, int64_t r1) {
    const float* panel = base + j * K * kPanel;
    const int64_t cols = std::min(kPanel, N - j * kPanel);
    float out[kRows][kPanel];
    for (int64_t r = r0; r < r1; r += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, r1 - r));
      rows_block(rows, xs + r * K, K, panel, &out[0][0]);
      for (int i = 0; i < rows; ++i) {
        std::memcpy(ys + (r + i) * N + j * kPanel, out[i], sizeof(float) * cols);
      }
    }
  };
  jaxserve_dense::run_panels(pool, M, P, M * K * N, item);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveDenseCpu, Dense,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // panels [(L,) P, K, 16]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer (scalar)
                                  .Ret<ffi::Buffer<ffi::F32>>()); // y [M, N]

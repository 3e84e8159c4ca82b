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
// Work items are (panel group, row chunk) on XLA's intra-op thread pool (dense_common.h). Each
// item sweeps its group's panels down K once per register tile of rows (AVX-512: 12 rows x 2
// panels; AVX2: 6 rows x 1 panel); the panels (K x 64 bytes each) stay in L2 between tiles.
// This file is compiled once per instruction set (cpu_build.py), the tile chosen by the
// compiler's target macros (dense_common.h).
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "dense_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxserve_dense::kGroup;
using jaxserve_dense::kPanel;

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
  // Rows [r0, r1) of y's columns [16 kGroup g, 16 kGroup (g + 1)) (fewer in the last group).
  auto item = [=](int64_t g, int64_t r0, int64_t r1) {
    const int64_t j0 = g * kGroup;
    const int np = static_cast<int>(std::min(kGroup, P - j0));
    const float* panel = base + j0 * K * kPanel;
    const int64_t cols = std::min(np * kPanel, N - j0 * kPanel);
    float out[jaxserve_dense::kRowChunk][kGroup * kPanel];
    jaxserve_dense::chunk(r1 - r0, np, xs + r0 * K, K, panel, K * kPanel, &out[0][0]);
    for (int64_t r = r0; r < r1; ++r) {
      std::memcpy(ys + r * N + j0 * kPanel, out[r - r0], sizeof(float) * cols);
    }
  };
  jaxserve_dense::run_panels(pool, M, (P + kGroup - 1) / kGroup, M * K * N, item);
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

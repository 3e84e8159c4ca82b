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
// Work items are (panel, row chunk of kRowChunk rows), run on XLA's intra-op thread pool, panel
// fastest so a row chunk of x stays in L2 while the panels stream past. Each item sweeps its
// panel down K once per block of up to 6 rows, 6 x 16 accumulators in registers; the panel
// (K x 64 bytes) stays in L2 between row blocks.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  // unaligned access

constexpr int64_t kPanel = 16;     // columns per panel (two 8-float vectors)
constexpr int kRows = 6;           // rows per register block
constexpr int64_t kRowChunk = 96;  // rows per work item
constexpr int64_t kPrefetch = 32;  // panel rows ahead (2 KB): the stream stays ahead of the FMAs

inline v8 load8(const float* p) { return *reinterpret_cast<const v8u*>(p); }
inline v8 splat(float s) { return v8{s, s, s, s, s, s, s, s}; }

// out[r, 0:16] = sum_k x[r, k] * panel[k, 0:16] for r < R (x stride K, out stride 16).
template <int R>
void block(const float* x, int64_t K, const float* panel, float* out) {
  v8 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = splat(0.0f);
  for (int64_t k = 0; k < K; ++k) {
    const float* pk = panel + k * kPanel;
    if (k + kPrefetch < K) __builtin_prefetch(pk + kPrefetch * kPanel);
    const v8 w0 = load8(pk), w1 = load8(pk + 8);
    for (int r = 0; r < R; ++r) {
      const v8 a = splat(x[r * K + k]);
      acc[r][0] += a * w0;
      acc[r][1] += a * w1;
    }
  }
  std::memcpy(out, acc, sizeof(float) * R * kPanel);
}

void rows_block(int rows, const float* x, int64_t K, const float* panel, float* out) {
  switch (rows) {
    case 1: block<1>(x, K, panel, out); break;
    case 2: block<2>(x, K, panel, out); break;
    case 3: block<3>(x, K, panel, out); break;
    case 4: block<4>(x, K, panel, out); break;
    case 5: block<5>(x, K, panel, out); break;
    default: block<6>(x, K, panel, out); break;
  }
}

struct Work {
  const float* x;       // [M, K]
  const float* panels;  // [P, K, 16]: this layer's
  float* y;             // [M, N]
  int64_t M, K, N, P, chunks;
  std::atomic<int64_t> next{0}, done{0};

  // Rows [r0, r1) of y's columns [16 j, 16 j + 16) (fewer in the last panel).
  void run_item(int64_t j, int64_t r0, int64_t r1) const {
    const float* panel = panels + j * K * kPanel;
    const int64_t cols = std::min(kPanel, N - j * kPanel);
    float out[kRows][kPanel];
    for (int64_t r = r0; r < r1; r += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, r1 - r));
      rows_block(rows, x + r * K, K, panel, &out[0][0]);
      for (int i = 0; i < rows; ++i) {
        std::memcpy(y + (r + i) * N + j * kPanel, out[i], sizeof(float) * cols);
      }
    }
  }

  void drain() {
    for (int64_t i; (i = next.fetch_add(1)) < P * chunks;) {
      const int64_t j = i % P, ch = i / P;
      run_item(j, ch * kRowChunk, std::min(M, (ch + 1) * kRowChunk));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

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
  auto work = std::make_shared<Work>();
  work->x = x.typed_data();
  work->panels = panels.typed_data() + l * P * K * kPanel;
  work->y = y->typed_data();
  work->M = M, work->K = K, work->N = N, work->P = P;
  work->chunks = (M + kRowChunk - 1) / kRowChunk;
  const int64_t items = P * work->chunks;
  // A small product is done before a helper would wake up: this thread alone runs it.
  const bool small = M * K * N < (int64_t{1} << 17);
  const int64_t helpers = small ? 0 : std::min<int64_t>(pool.num_threads(), items) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->drain(); });
  work->drain();
  while (work->done.load(std::memory_order_acquire) < items) std::this_thread::yield();
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

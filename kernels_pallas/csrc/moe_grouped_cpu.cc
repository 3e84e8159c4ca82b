// The MoE block's grouped expert MLP on CPU, one XLA FFI custom call over panel-packed expert
// weights (float32 or bfloat16; activations and accumulation float32).
//
// Data flow: rows xs f32[M, H] sorted by expert, group sizes s32[E] (data: expert e owns the
// next sizes[e] rows) -> for each expert's rows, its SwiGLU MLP
//   h = silu(x @ Wg[e]) * (x @ Wu[e])   [rows, I]     (phase 1)
//   y = h @ Wd[e]                        [rows, H]     (phase 2)
// -> y f32[M, H]; rows past sum(sizes) are zero, and an expert with no rows costs nothing.
// Weights are stacks of 16-column panels, the dense kernel's layout (dense_cpu.cc says why:
// each panel is one sequential K x 16 run), with the expert axis before the panel axis:
//   gate, up  W[(L,) E, ceil(I / 16), H, 16]     Wg[e][k, j] = gate[l, e, j / 16, k, j % 16]
//   down      W[(L,) E, ceil(H / 16), I, 16]
// (columns past I / H are zero), `layer` an s32 scalar picking the stack's layer in place.
//
// Work: phase 1's items are (row chunk of one expert, 16 columns of h); each sweeps the gate
// and up panels of those columns together (a register tile of rows x {gate, up}: AVX-512 12
// rows x 2 panels in 24 zmm, AVX2 2 x 2 in 8 ymm) and writes silu(gate) * up. Phase 2's items
// are (row chunk, one or two 16-column panels of y) over h. Items go to XLA's intra-op pool
// from one atomic counter; the calling thread works too and waits for every item of phase 1
// before phase 2 reads h (a barrier inside the call, so gate / up / act / down is one call).
// A one-token decode step (k rows of k experts) is k x ceil(I / 16) items: every core gets
// some. Only the experts with rows are read, each once per row chunk of up to 256 rows.
//
// Compiled once per instruction set (cpu_build.py); the tile shape follows the target macros.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "pool_items.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 16;      // columns per panel
constexpr int64_t kRowChunk = 256;  // rows per work item (as dense_common.h)
constexpr int64_t kKBlock = 192;    // k per block when a chunk holds several tiles
constexpr int64_t kPrefetch = 32;   // panel rows ahead

// One native vector: a zmm (16 floats) with AVX-512, a ymm (8) otherwise (a 64-byte generic
// vector on AVX2 is lowered through memory: 3-11x slower, measured); kVecs per panel row.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kRowsGU = 12;  // phase 1 tile: rows x {gate, up} (24 zmm accumulators)
constexpr int kRowsD = 12;   // phase 2 tile: rows x kGroupD panels
constexpr int64_t kGroupD = 2;
#else
constexpr int kLanes = 8;
// 2 rows x 2 panels x 2 ymm = 8 accumulators + 4 weights: 3 rows would spill (2.1x the
// dense MLP at 128 tokens against 1.6x; gate and up as two 6-row blocks: the same 1.6x)
constexpr int kRowsGU = 2;
constexpr int kRowsD = 6;    // 6 x 1 panel x 2 ymm = 12 (the dense kernel's AVX2 block)
constexpr int64_t kGroupD = 1;
#endif
constexpr int kVecs = kPanel / kLanes;

typedef float vf __attribute__((vector_size(4 * kLanes)));
typedef float vfu __attribute__((vector_size(4 * kLanes), aligned(4)));
typedef uint16_t vhu __attribute__((vector_size(2 * kLanes), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(4 * kLanes)));

inline vf loadv(const float* p) { return *reinterpret_cast<const vfu*>(p); }
// bfloat16 is the top half of a float32: widen and shift.
inline vf loadv(const uint16_t* p) {
  const vu w = __builtin_convertvector(*reinterpret_cast<const vhu*>(p), vu) << 16;
  return (vf)w;
}
inline vf splat(float s) {
#if defined(__AVX512F__)
  return vf{s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s};
#else
  return vf{s, s, s, s, s, s, s, s};
#endif
}

// out[r, 16 p + c] (+)= sum_{k0 <= k < k1} x[r, k] * pan[p][k, c] for r < R, p < NP
// (x stride ldx, out stride NP * 16); `add`: onto out (a later k block).
template <int R, int NP, class W>
void tile(const float* x, int64_t ldx, int64_t k0, int64_t k1, const W* const* pan,
          float* out, bool add) {
  constexpr int64_t ldo = NP * kPanel;
  constexpr int V = NP * kVecs;  // vectors per tile row
  vf acc[R][V];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) acc[r][v] = add ? loadv(out + r * ldo + v * kLanes) : vf{};
  }
  for (int64_t k = k0; k < k1; ++k) {
    vf w[V];
    for (int p = 0; p < NP; ++p) {
      const W* pk = pan[p] + k * kPanel;
      if (k + kPrefetch < k1) __builtin_prefetch(pk + kPrefetch * kPanel);
      for (int j = 0; j < kVecs; ++j) w[p * kVecs + j] = loadv(pk + j * kLanes);
    }
    for (int r = 0; r < R; ++r) {
      const vf a = splat(x[r * ldx + k]);
      for (int v = 0; v < V; ++v) acc[r][v] += a * w[v];
    }
  }
  for (int r = 0; r < R; ++r) {
    std::memcpy(out + r * ldo, acc[r], sizeof(float) * ldo);
  }
}

// tile<rows, ...> for 1 <= rows <= R.
template <int R, int NP, class W>
void tile_n(int rows, const float* x, int64_t ldx, int64_t k0, int64_t k1, const W* const* pan,
            float* out, bool add) {
  if constexpr (R > 1) {
    if (rows < R) return tile_n<R - 1, NP, W>(rows, x, ldx, k0, k1, pan, out, add);
  }
  tile<R, NP, W>(x, ldx, k0, k1, pan, out, add);
}

// out[r, :] = x[r, 0:K] @ the NP panels, r < rows <= kRowChunk (out stride NP * 16). One tile
// takes the whole K at once; several go over K in blocks, so a block's panel slice is read
// from memory once and from L1 by the chunk's other tiles.
template <int TR, int NP, class W>
void chunk(int64_t rows, const float* x, int64_t ldx, int64_t K, const W* const* pan,
           float* out) {
  if (rows <= TR) {
    tile_n<TR, NP, W>(static_cast<int>(rows), x, ldx, 0, K, pan, out, false);
    return;
  }
  for (int64_t k0 = 0; k0 < K; k0 += kKBlock) {
    const int64_t k1 = std::min(K, k0 + kKBlock);
    for (int64_t r = 0; r < rows; r += TR) {
      const int n = static_cast<int>(std::min<int64_t>(TR, rows - r));
      tile_n<TR, NP, W>(n, x + r * ldx, ldx, k0, k1, pan, out + r * NP * kPanel, k0 > 0);
    }
  }
}

using jaxserve_cpu::run_items;  // pool_items.h

struct Job {  // rows [r0, r1) of expert e
  int64_t e, r0, r1;
};

template <ffi::DataType T>
ffi::Error Grouped(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> sizes,
                   ffi::Buffer<T> gate, ffi::Buffer<T> up, ffi::Buffer<T> down,
                   ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  using W = ffi::NativeType<T>;
  auto xd = x.dimensions(), gd = gate.dimensions(), dd = down.dimensions();
  auto ud = up.dimensions(), yd = y->dimensions();
  const size_t rank = gd.size();
  if (xd.size() != 2 || yd.size() != 2 || sizes.dimensions().size() != 1 ||
      (rank != 4 && rank != 5) || ud.size() != rank || dd.size() != rank ||
      gd[rank - 1] != kPanel || dd[rank - 1] != kPanel) {
    return ffi::Error::InvalidArgument(
        "moe_grouped: x must be [M, H], sizes [E], gate / up [(L,) E, PI, H, 16], "
        "down [(L,) E, PH, I, 16], y [M, H]");
  }
  for (size_t i = 0; i < rank; ++i) {
    if (ud[i] != gd[i]) return ffi::Error::InvalidArgument("moe_grouped: up's shape != gate's");
  }
  const int64_t L = rank == 5 ? gd[0] : 1, E = gd[rank - 4], PI = gd[rank - 3];
  const int64_t H = gd[rank - 2], PH = dd[rank - 3], I = dd[rank - 2], M = xd[0];
  if (xd[1] != H || yd[0] != M || yd[1] != H || sizes.dimensions()[0] != E ||
      (rank == 5 && dd[0] != L) || dd[rank - 4] != E || PH != (H + kPanel - 1) / kPanel ||
      PI != (I + kPanel - 1) / kPanel) {
    return ffi::Error::InvalidArgument("moe_grouped: x / sizes / panels / y shapes disagree");
  }
  if (layer.element_count() != 1) {
    return ffi::Error::InvalidArgument("moe_grouped: layer must be one s32");
  }
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("moe_grouped: layer out of range");
  const float* xs = x.typed_data();
  float* ys = y->typed_data();
  const int32_t* sz = sizes.typed_data();
  const int64_t gu_expert = PI * H * kPanel, d_expert = PH * I * kPanel;
  const W* gbase = gate.typed_data() + l * E * gu_expert;
  const W* ubase = up.typed_data() + l * E * gu_expert;
  const W* dbase = down.typed_data() + l * E * d_expert;

  // Groups in row order; a negative size counts as empty, rows past M are not there.
  std::vector<Job> jobs;
  int64_t total = 0;
  for (int64_t e = 0; e < E && total < M; ++e) {
    const int64_t end = std::min(M, total + std::max<int64_t>(0, sz[e]));
    for (int64_t r = total; r < end; r += kRowChunk) {
      jobs.push_back({e, r, std::min(end, r + kRowChunk)});
    }
    total = end;
  }
  if (total < M) std::memset(ys + total * H, 0, sizeof(float) * (M - total) * H);
  if (total == 0) return ffi::Error::Success();
  const int64_t ldh = PI * kPanel;
  std::unique_ptr<float[]> hbuf(new float[total * ldh]);
  float* h = hbuf.get();
  const bool parallel = total * H * ldh * 3 >= (int64_t{1} << 17);
  const Job* jb = jobs.data();

  // Phase 1: h[rows, 16 p : 16 p + 16] = silu(x @ gate panel p) * (x @ up panel p).
  run_items(pool, static_cast<int64_t>(jobs.size()) * PI, parallel, [=](int64_t i) {
    const Job& j = jb[i / PI];
    const int64_t p = i % PI, rows = j.r1 - j.r0;
    const W* pan[2] = {gbase + j.e * gu_expert + p * H * kPanel,
                       ubase + j.e * gu_expert + p * H * kPanel};
    float out[kRowChunk][2 * kPanel];  // [gate | up] per row
    chunk<kRowsGU, 2, W>(rows, xs + j.r0 * H, H, H, pan, &out[0][0]);
    for (int64_t r = 0; r < rows; ++r) {
      float* hr = h + (j.r0 + r) * ldh + p * kPanel;
      for (int64_t c = 0; c < kPanel; ++c) {
        const float g = out[r][c];
        hr[c] = g / (1.0f + std::exp(-g)) * out[r][kPanel + c];
      }
    }
  });

  // Phase 2: y[rows, 16 q : ...] = h[rows, 0:I] @ down panels q (kGroupD at a time).
  const int64_t groups = (PH + kGroupD - 1) / kGroupD;
  run_items(pool, static_cast<int64_t>(jobs.size()) * groups, parallel, [=](int64_t i) {
    const Job& j = jb[i / groups];
    const int64_t q0 = (i % groups) * kGroupD, rows = j.r1 - j.r0;
    const int64_t np = std::min(kGroupD, PH - q0);
    const W* pan[kGroupD];
    for (int64_t p = 0; p < np; ++p) pan[p] = dbase + j.e * d_expert + (q0 + p) * I * kPanel;
    float out[kRowChunk][kGroupD * kPanel];
    if (np == kGroupD) {
      chunk<kRowsD, kGroupD, W>(rows, h + j.r0 * ldh, ldh, I, pan, &out[0][0]);
    } else {
      chunk<kRowsD, 1, W>(rows, h + j.r0 * ldh, ldh, I, pan, &out[0][0]);
    }
    const int64_t ldo = np * kPanel, cols = std::min(ldo, H - q0 * kPanel);
    const float* o = &out[0][0];
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(ys + (j.r0 + r) * H + q0 * kPanel, o + r * ldo, sizeof(float) * cols);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

#define JAXSERVE_MOE_GROUPED(NAME, T)                                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, Grouped<T>,                              \
                                ffi::Ffi::Bind()                               \
                                    .Ctx<ffi::ThreadPool>()                    \
                                    .Arg<ffi::Buffer<ffi::F32>>() /* xs */     \
                                    .Arg<ffi::Buffer<ffi::S32>>() /* sizes */  \
                                    .Arg<ffi::Buffer<T>>()        /* gate */   \
                                    .Arg<ffi::Buffer<T>>()        /* up */     \
                                    .Arg<ffi::Buffer<T>>()        /* down */   \
                                    .Arg<ffi::Buffer<ffi::S32>>() /* layer */  \
                                    .Ret<ffi::Buffer<ffi::F32>>() /* y */);

JAXSERVE_MOE_GROUPED(JaxserveMoeGroupedF32Cpu, ffi::F32)
JAXSERVE_MOE_GROUPED(JaxserveMoeGroupedBf16Cpu, ffi::BF16)

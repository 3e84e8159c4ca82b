// The multi-LoRA delta of one projection on CPU, one XLA FFI custom call
// (kernels_pallas/lora_cpu.py; the contract is kernels_pallas/lora.py's).
//
// Data flow: x f32[T, K], the whole stacks a W[L, S, K, R] and b W[L, S, R, N] (W float32 or
// bfloat16, read in place at layer `layer`, an s32 scalar), slots s32[T] -> y f32[T, N]:
//   y[t] = (x[t] @ a[layer, s]) @ b[layer, s]  with s = slots[t] in [1, S)
//   y[t] = 0                                   otherwise (slot 0: no adapter; and a slot
//                                              outside [0, S), as the masked XLA path does)
// accumulated in float32. A slot-0 row is a memset: no weight is read for it.
//
// Grouping (Punica's SGMV on a CPU): the rows are counting-sorted by slot, and each slot's
// rows are cut into jobs of up to kJobRows rows, so an adapter's A and B are read once per
// job (a decode step of 32 rows on 8 adapters: once per step) instead of once per row.
//   phase 1 (shrink), one item per job: u[rows, R] = x[rows] @ A  (A [K, R]: row k is R
//     contiguous values, so a k step is one R-wide vector per row: R = 16 is one zmm);
//   phase 2 (expand), items (job, block of kColBlock columns of y): y[rows, cols] =
//     u[rows] @ B[:, cols]  (B [R, N]: row r is contiguous over the columns, the vectors).
// Items go to XLA's intra-op pool from one atomic counter (the dense kernels' scheme,
// dense_common.h); the calling thread works too and waits for phase 1 before phase 2 reads
// u. A call whose work (active rows x R x (K + N) FMAs) is under kParallelWork runs on the
// calling thread alone, as the dense kernels' small products do (waking a helper costs
// microseconds). Whether two threads pay at decode sizes is not settled: the 2-vCPU host was
// shared by other jobs throughout, and a serial build ran within the noise of this one.
//
// Register tiles (vectors: zmm with AVX-512, ymm with AVX2; R or N not a multiple of the
// vector width falls to narrower vectors and then a scalar tail, toy shapes only):
//   shrink: up to kShrinkRows rows x one vector of R's columns, K unrolled into kShrinkStreams
//     independent accumulators when the tile has few rows (one decode row would otherwise be
//     a single K-long chain of dependent FMAs);
//   expand: up to kExpandRows rows x kExpandVecs vectors of columns, R steps.
// One thread runs the 512-row prefill of the bundled model's 576 x 1536 at ~70 GFLOP/s
// (float32, AVX-512 on a shared Zen 4: ~60% of its FMA peak; 8 x 3 expand tiles, 16 K
// streams, whole-row column blocks all within 2% of it, 4 x 6 tiles 12% slower): the expand
// writes y at ~8 GB/s, so the activations' traffic (x read, y written once each), not the
// weights, sets the pace there; only a kernel fused with the base projection's would save it.
// Compiled once per instruction set with the dense kernels (cpu_build.py).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#if defined(__FMA__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"
#include "pool_items.h"

namespace ffi = xla::ffi;

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef uint16_t h16 __attribute__((vector_size(32)));
typedef uint16_t h8 __attribute__((vector_size(16)));
typedef uint32_t u16v __attribute__((vector_size(64)));
typedef uint32_t u8v __attribute__((vector_size(32)));

#if defined(__AVX512F__)
typedef v16 vw;                  // the widest native vector
constexpr int kExpandRows = 6;   // 6 x 4 zmm = 24 accumulators + 4 weights + 1 broadcast
constexpr int kExpandVecs = 4;
#else
typedef v8 vw;                   // a 64-byte generic vector on AVX2 goes through memory
constexpr int kExpandRows = 6;   // 6 x 2 ymm = 12 accumulators (the dense AVX2 block)
constexpr int kExpandVecs = 2;
#endif
constexpr int kShrinkRows = 8;
constexpr int kShrinkStreams = 8;      // FMA latency x ports: ~8 chains keep the units busy
constexpr int64_t kJobRows = 16;       // rows per job: A / B read once per 16 rows of a slot
constexpr int64_t kColBlock = 256;     // columns of y per phase-2 item
constexpr int64_t kParallelWork = int64_t{1} << 18;

template <class V>
constexpr int lanes() { return sizeof(V) / sizeof(float); }

// Loads of L lanes from float32 or bfloat16 (the top half of a float32: widen and shift).
inline void load(float& v, const float* p) { v = *p; }
inline void load(v8& v, const float* p) { std::memcpy(&v, p, sizeof v); }
inline void load(v16& v, const float* p) { std::memcpy(&v, p, sizeof v); }
inline void load(float& v, const uint16_t* p) {
  const uint32_t w = uint32_t{*p} << 16;
  std::memcpy(&v, &w, sizeof v);
}
inline void load(v8& v, const uint16_t* p) {
  h8 h;
  std::memcpy(&h, p, sizeof h);
  v = (v8)(__builtin_convertvector(h, u8v) << 16);
}
inline void load(v16& v, const uint16_t* p) {
  h16 h;
  std::memcpy(&h, p, sizeof h);
  v = (v16)(__builtin_convertvector(h, u16v) << 16);
}
template <class V>
inline void store(float* p, const V& v) { std::memcpy(p, &v, sizeof v); }
template <class V>
inline V splat(float s) { return V{} + s; }

// a * b + c rounded once, spelled out rather than left to the compiler's contraction.
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline v8 fma(v8 a, v8 b, v8 c) {
#if defined(__FMA__)
  return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}
#if defined(__AVX512F__)
inline v16 fma(v16 a, v16 b, v16 c) {
  return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
}
#endif

// u[r, c : c + lanes] = x[r] @ A[:, c : c + lanes] for r < RT (A [K, R] row stride R; u
// row stride R), K split into U interleaved streams summed at the end.
template <class V, int RT, int U, class W>
void shrink_tile(const float* const* xr, int64_t K, const W* A, int64_t R, int64_t c,
                 float* u) {
  V acc[RT][U];
  for (int r = 0; r < RT; ++r) {
    for (int s = 0; s < U; ++s) acc[r][s] = V{};
  }
  int64_t k = 0;
  for (; k + U <= K; k += U) {
    for (int s = 0; s < U; ++s) {
      V w;
      load(w, A + (k + s) * R + c);
      for (int r = 0; r < RT; ++r) acc[r][s] = fma(splat<V>(xr[r][k + s]), w, acc[r][s]);
    }
  }
  for (; k < K; ++k) {
    V w;
    load(w, A + k * R + c);
    for (int r = 0; r < RT; ++r) acc[r][0] = fma(splat<V>(xr[r][k]), w, acc[r][0]);
  }
  for (int r = 0; r < RT; ++r) {
    V sum = acc[r][0];
    for (int s = 1; s < U; ++s) sum += acc[r][s];
    store(u + r * R + c, sum);
  }
}

// shrink_tile for 1 <= rows <= RT, with more K streams the fewer the rows.
template <class V, int RT, class W>
void shrink_rows(int rows, const float* const* xr, int64_t K, const W* A, int64_t R, int64_t c,
                 float* u) {
  if constexpr (RT > 1) {
    if (rows < RT) return shrink_rows<V, RT - 1, W>(rows, xr, K, A, R, c, u);
  }
  constexpr int U = RT >= kShrinkStreams ? 1 : kShrinkStreams / RT;
  shrink_tile<V, RT, U, W>(xr, K, A, R, c, u);
}

// u[rows, 0:R] = x[rows] @ A for rows <= kShrinkRows: R in native vectors, then 8-lane
// ones (R = 8 with AVX-512), then one column at a time.
template <class W>
void shrink(int rows, const float* const* xr, int64_t K, const W* A, int64_t R, float* u) {
  int64_t c = 0;
  for (; c + lanes<vw>() <= R; c += lanes<vw>()) {
    shrink_rows<vw, kShrinkRows, W>(rows, xr, K, A, R, c, u);
  }
  if constexpr (lanes<vw>() > 8) {
    for (; c + 8 <= R; c += 8) shrink_rows<v8, kShrinkRows, W>(rows, xr, K, A, R, c, u);
  }
  for (; c < R; ++c) shrink_rows<float, kShrinkRows, W>(rows, xr, K, A, R, c, u);
}

// y[t, c : c + NV lanes] = u[t] @ B[:, c : ...] for t < RT (u row stride R; B [R, N] row
// stride N; y rows by pointer).
template <class V, int RT, int NV, class W>
void expand_tile(const float* u, int64_t R, const W* B, int64_t N, int64_t c,
                 float* const* yr) {
  constexpr int L = lanes<V>();
  V acc[RT][NV];
  for (int t = 0; t < RT; ++t) {
    for (int j = 0; j < NV; ++j) acc[t][j] = V{};
  }
  for (int64_t r = 0; r < R; ++r) {
    V w[NV];
    for (int j = 0; j < NV; ++j) load(w[j], B + r * N + c + j * L);
    for (int t = 0; t < RT; ++t) {
      const V a = splat<V>(u[t * R + r]);
      for (int j = 0; j < NV; ++j) acc[t][j] = fma(a, w[j], acc[t][j]);
    }
  }
  for (int t = 0; t < RT; ++t) {
    for (int j = 0; j < NV; ++j) store(yr[t] + c + j * L, acc[t][j]);
  }
}

template <class V, int RT, int NV, class W>
void expand_rows(int rows, const float* u, int64_t R, const W* B, int64_t N, int64_t c,
                 float* const* yr) {
  if constexpr (RT > 1) {
    if (rows < RT) return expand_rows<V, RT - 1, NV, W>(rows, u, R, B, N, c, yr);
  }
  expand_tile<V, RT, NV, W>(u, R, B, N, c, yr);
}

// y[rows, c0:c1] = u[rows] @ B[:, c0:c1] for rows <= kExpandRows: whole tiles of
// kExpandVecs vectors, then single vectors, then single columns.
template <class W>
void expand(int rows, const float* u, int64_t R, const W* B, int64_t N, int64_t c0, int64_t c1,
            float* const* yr) {
  constexpr int64_t L = lanes<vw>(), wide = L * kExpandVecs;
  int64_t c = c0;
  for (; c + wide <= c1; c += wide) {
    expand_rows<vw, kExpandRows, kExpandVecs, W>(rows, u, R, B, N, c, yr);
  }
  for (; c + L <= c1; c += L) expand_rows<vw, kExpandRows, 1, W>(rows, u, R, B, N, c, yr);
  for (; c < c1; ++c) expand_rows<float, kExpandRows, 1, W>(rows, u, R, B, N, c, yr);
}

using jaxserve_cpu::run_items;  // pool_items.h

struct Job {  // sorted rows [i0, i1) of slot s
  int64_t s, i0, i1;
};

template <ffi::DataType D>
ffi::Error LoraDelta(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<D> a,
                     ffi::Buffer<D> b, ffi::Buffer<ffi::S32> slots,
                     ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  using W = ffi::NativeType<D>;
  auto xd = x.dimensions(), ad = a.dimensions(), bd = b.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || ad.size() != 4 || bd.size() != 4 || yd.size() != 2 ||
      slots.dimensions().size() != 1) {
    return ffi::Error::InvalidArgument(
        "lora_delta: x must be [T, K], a [L, S, K, R], b [L, S, R, N], slots [T], y [T, N]");
  }
  const int64_t T = xd[0], K = xd[1], L = ad[0], S = ad[1], R = ad[3], N = bd[3];
  if (ad[2] != K || bd[0] != L || bd[1] != S || bd[2] != R || yd[0] != T || yd[1] != N ||
      slots.dimensions()[0] != T) {
    return ffi::Error::InvalidArgument("lora_delta: x / a / b / slots / y shapes disagree");
  }
  if (layer.element_count() != 1) {
    return ffi::Error::InvalidArgument("lora_delta: layer must be one s32");
  }
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("lora_delta: layer out of range");
  const float* xs = x.typed_data();
  const int32_t* sl = slots.typed_data();
  float* ys = y->typed_data();

  // Counting sort of the adapter rows by slot; the others are zeroed here, nothing read.
  std::vector<int64_t> start(S + 1, 0);
  for (int64_t t = 0; t < T; ++t) {
    if (sl[t] > 0 && sl[t] < S) {
      ++start[sl[t] + 1];
    } else {
      std::memset(ys + t * N, 0, sizeof(float) * N);
    }
  }
  for (int64_t s = 1; s <= S; ++s) start[s] += start[s - 1];
  const int64_t active = start[S];
  if (active == 0 || N == 0) return ffi::Error::Success();
  std::vector<const float*> xrow(active);
  std::vector<float*> yrow(active);
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t t = 0; t < T; ++t) {
      if (sl[t] > 0 && sl[t] < S) {
        const int64_t i = fill[sl[t]]++;
        xrow[i] = xs + t * K;
        yrow[i] = ys + t * N;
      }
    }
  }
  std::vector<Job> jobs;
  for (int64_t s = 1; s < S; ++s) {
    for (int64_t i = start[s]; i < start[s + 1]; i += kJobRows) {
      jobs.push_back({s, i, std::min(start[s + 1], i + kJobRows)});
    }
  }
  const int64_t a_slot = K * R, b_slot = R * N;
  const W* abase = a.typed_data() + l * S * a_slot;
  const W* bbase = b.typed_data() + l * S * b_slot;
  std::unique_ptr<float[]> ubuf(new float[active * std::max<int64_t>(R, 1)]);
  float* u = ubuf.get();
  const Job* jb = jobs.data();
  const float* const* xr = xrow.data();
  float* const* yr = yrow.data();
  const bool parallel = active * R * (K + N) >= kParallelWork;

  // Phase 1: u[rows] = x[rows] @ A[slot], one job per item.
  run_items(pool, static_cast<int64_t>(jobs.size()), parallel, [=](int64_t i) {
    const Job& j = jb[i];
    const W* A = abase + j.s * a_slot;
    for (int64_t r = j.i0; r < j.i1; r += kShrinkRows) {
      const int n = static_cast<int>(std::min<int64_t>(kShrinkRows, j.i1 - r));
      shrink<W>(n, xr + r, K, A, R, u + r * R);
    }
  });

  // Phase 2: y[rows, block] = u[rows] @ B[slot][:, block].
  const int64_t blocks = (N + kColBlock - 1) / kColBlock;
  run_items(pool, static_cast<int64_t>(jobs.size()) * blocks, parallel, [=](int64_t i) {
    const Job& j = jb[i / blocks];
    const int64_t c0 = (i % blocks) * kColBlock, c1 = std::min(N, c0 + kColBlock);
    const W* B = bbase + j.s * b_slot;
    for (int64_t r = j.i0; r < j.i1; r += kExpandRows) {
      const int n = static_cast<int>(std::min<int64_t>(kExpandRows, j.i1 - r));
      expand<W>(n, u + r * R, R, B, N, c0, c1, yr + r);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

#define JAXSERVE_LORA_DELTA(NAME, T)                                           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, LoraDelta<T>,                            \
                                ffi::Ffi::Bind()                               \
                                    .Ctx<ffi::ThreadPool>()                    \
                                    .Arg<ffi::Buffer<ffi::F32>>() /* x */      \
                                    .Arg<ffi::Buffer<T>>()        /* a */      \
                                    .Arg<ffi::Buffer<T>>()        /* b */      \
                                    .Arg<ffi::Buffer<ffi::S32>>() /* slots */  \
                                    .Arg<ffi::Buffer<ffi::S32>>() /* layer */  \
                                    .Ret<ffi::Buffer<ffi::F32>>() /* y */);

JAXSERVE_LORA_DELTA(JaxserveLoraDeltaF32Cpu, ffi::F32)
JAXSERVE_LORA_DELTA(JaxserveLoraDeltaBf16Cpu, ffi::BF16)

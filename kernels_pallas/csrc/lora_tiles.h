// The multi-LoRA CPU kernel's register tiles (lora_cpu.cc runs them per job): the shrink
// u = x @ A and the expand y = u @ B over float32 or bfloat16 weights, the vector loads and
// broadcasts they use, and `Ahead`, the lines a job fetches while it computes.
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
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace jaxserve_lora {

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
constexpr int64_t kPrefetchBytes = 4096;   // A ahead in the shrink: ~1 us of DRAM latency
constexpr int kShrinkStreams = 8;      // FMA latency x ports: ~8 chains keep the units busy

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
#if defined(__AVX512F__)
  // One widening load and a shift: the generic convert below goes through two ymm halves.
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  v = (v16)_mm512_slli_epi32(w, 16);
#else
  h16 h;
  std::memcpy(&h, p, sizeof h);
  v = (v16)(__builtin_convertvector(h, u16v) << 16);
#endif
}
template <class V>
inline void store(float* p, const V& v) { std::memcpy(p, &v, sizeof v); }
// A broadcast. Generic vectors spell it V{} + s, which compilers emit as an add to zero
// before the broadcast: x86 gets the broadcast itself (a memory operand folds into the FMA).
template <class V>
inline V splat(float s) { return V{} + s; }
template <>
inline float splat<float>(float s) { return s; }
#if defined(__AVX__)
template <>
inline v8 splat<v8>(float s) { return (v8)_mm256_set1_ps(s); }
#endif
#if defined(__AVX512F__)
template <>
inline v16 splat<v16>(float s) { return (v16)_mm512_set1_ps(s); }
#endif


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

// Memory to fetch while a job computes, a few lines per inner-loop step: the job's own B
// (when nothing fetched it before) and the next job's A and B, so that a worker streams the
// stacks from DRAM while it multiplies instead of stalling at each new adapter's first
// lines (a job reads short runs: A is K rows of R, B R rows of N columns, which the hardware
// prefetcher picks up late and a small N never).
struct Ahead {
  struct Run {
    const char* p;
    int64_t lines;
  };
  Run runs[3] = {};
  int count = 0;
  int64_t per = 0;  // lines a step
  template <class W>
  void add(const W* p, int64_t elems) {
    runs[count++] = {reinterpret_cast<const char*>(p),
                     (elems * static_cast<int64_t>(sizeof(W)) + 63) / 64};
  }
  int64_t lines() const {
    int64_t n = 0;
    for (int i = 0; i < count; ++i) n += runs[i].lines;
    return n;
  }
  __attribute__((always_inline)) void step() {
    if (per == 0) return;
    int64_t left = per;
    for (int i = 0; i < count && left > 0; ++i) {
      for (; left > 0 && runs[i].lines > 0; --left, --runs[i].lines, runs[i].p += 64) {
        __builtin_prefetch(runs[i].p, 0, 2);  // to L2: its miss queue is deeper than L1's
      }
    }
  }
};

// u[r, c : c + lanes] = x[r] @ A[:, c : c + lanes] for r < RT (A [K, R] row stride R; u
// row stride R), K split into U interleaved streams summed at the end.
template <class V, int RT, int U, class W>
void shrink_tile(const float* const* xr, int64_t K, const W* A, int64_t R, int64_t c,
                 float* u, Ahead& next) {
  V acc[RT][U];
  for (int r = 0; r < RT; ++r) {
    for (int s = 0; s < U; ++s) acc[r][s] = V{};
  }
  int64_t k = 0;
  constexpr int64_t ahead = kPrefetchBytes / sizeof(W);  // elements of A ahead
  Ahead fetch = next;  // a local copy the compiler can keep in registers beside acc
  for (; k + U <= K; k += U) {
    fetch.step();
    for (int s = 0; s < U; ++s) {
      __builtin_prefetch(A + (k + s) * R + c + ahead);
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
  next = fetch;
  for (int r = 0; r < RT; ++r) {
    V sum = acc[r][0];
    for (int s = 1; s < U; ++s) sum += acc[r][s];
    store(u + r * R + c, sum);
  }
}

// shrink_tile for 1 <= rows <= RT, with more K streams the fewer the rows.
template <class V, int RT, class W>
void shrink_rows(int rows, const float* const* xr, int64_t K, const W* A, int64_t R, int64_t c,
                 float* u, Ahead& next) {
  if constexpr (RT > 1) {
    if (rows < RT) return shrink_rows<V, RT - 1, W>(rows, xr, K, A, R, c, u, next);
  }
  constexpr int U = RT >= kShrinkStreams ? 1 : kShrinkStreams / RT;
  shrink_tile<V, RT, U, W>(xr, K, A, R, c, u, next);
}

// u[rows, 0:R] = x[rows] @ A for rows <= kShrinkRows: R in native vectors, then 8-lane
// ones (R = 8 with AVX-512), then one column at a time.
template <class W>
void shrink(int rows, const float* const* xr, int64_t K, const W* A, int64_t R, float* u,
            Ahead& next) {
  int64_t c = 0;
  for (; c + lanes<vw>() <= R; c += lanes<vw>()) {
    shrink_rows<vw, kShrinkRows, W>(rows, xr, K, A, R, c, u, next);
  }
  if constexpr (lanes<vw>() > 8) {
    for (; c + 8 <= R; c += 8) shrink_rows<v8, kShrinkRows, W>(rows, xr, K, A, R, c, u, next);
  }
  for (; c < R; ++c) shrink_rows<float, kShrinkRows, W>(rows, xr, K, A, R, c, u, next);
}

// y[t, c : c + NV lanes] = u[t] @ B[:, c : ...] for t < RT (u row stride R; B [R, N] row
// stride N; y rows by pointer).
template <class V, int RT, int NV, class W>
void expand_tile(const float* u, int64_t R, const W* B, int64_t N, int64_t c,
                 float* const* yr, Ahead& next) {
  constexpr int L = lanes<V>();
  V acc[RT][NV];
  for (int t = 0; t < RT; ++t) {
    for (int j = 0; j < NV; ++j) acc[t][j] = V{};
  }
  Ahead fetch = next;  // a local copy the compiler can keep in registers beside acc
  for (int64_t r = 0; r < R; ++r) {
    V w[NV];
    fetch.step();
    for (int j = 0; j < NV; ++j) load(w[j], B + r * N + c + j * L);
    for (int t = 0; t < RT; ++t) {
      const V a = splat<V>(u[t * R + r]);
      for (int j = 0; j < NV; ++j) acc[t][j] = fma(a, w[j], acc[t][j]);
    }
  }
  next = fetch;
  for (int t = 0; t < RT; ++t) {
    for (int j = 0; j < NV; ++j) store(yr[t] + c + j * L, acc[t][j]);
  }
}

template <class V, int RT, int NV, class W>
void expand_rows(int rows, const float* u, int64_t R, const W* B, int64_t N, int64_t c,
                 float* const* yr, Ahead& next) {
  if constexpr (RT > 1) {
    if (rows < RT) return expand_rows<V, RT - 1, NV, W>(rows, u, R, B, N, c, yr, next);
  }
  expand_tile<V, RT, NV, W>(u, R, B, N, c, yr, next);
}

// y[rows, c0:c1] = u[rows] @ B[:, c0:c1] for rows <= kExpandRows: whole tiles of
// kExpandVecs vectors, then single vectors, then single columns.
template <class W>
void expand(int rows, const float* u, int64_t R, const W* B, int64_t N, int64_t c0, int64_t c1,
            float* const* yr, Ahead& next) {
  constexpr int64_t L = lanes<vw>(), wide = L * kExpandVecs;
  int64_t c = c0;
  for (; c + wide <= c1; c += wide) {
    expand_rows<vw, kExpandRows, kExpandVecs, W>(rows, u, R, B, N, c, yr, next);
  }
  for (; c + L <= c1; c += L) expand_rows<vw, kExpandRows, 1, W>(rows, u, R, B, N, c, yr, next);
  for (; c < c1; ++c) expand_rows<float, kExpandRows, 1, W>(rows, u, R, B, N, c, yr, next);
}

}  // namespace jaxserve_lora

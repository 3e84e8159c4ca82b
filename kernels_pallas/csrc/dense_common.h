// Shared by the CPU dense kernels (dense_cpu.cc, dense_quant_cpu.cc): the float register tile
// over a group of 16-column panels, and the work split over XLA's intra-op thread pool.
//
// The file is compiled once per instruction set (cpu_build.py builds one library per ISA):
// - AVX-512 (__AVX512F__): a group is kGroup = 2 panels (32 columns); a tile is up to 12 rows
//   x 32 columns, 24 zmm accumulators, two panel loads and 12 broadcasts per k for 24 FMAs, so
//   the FMA ports, not the loads, set the pace;
// - otherwise (AVX2): a group is 1 panel; a tile is up to 6 rows x 16 columns (12 ymm).
// Every k row of a panel is one 64-byte line, read in order, so the panels stream from L2 at
// a fraction of its bandwidth and the hardware prefetcher (plus one software prefetch per line)
// runs ahead; x's tile rows stay in L1/L2 across the group.
//
// Work items are (group, row chunk of kRowChunk rows), group fastest. Within an item K goes in
// blocks of kKBlock (chunk below): the block's panel slice stays in L1 while every tile of the
// chunk sweeps it, the chunk's x columns of the block (256 x 192 x 4 B = 192 KB) in L2. A
// chunk of 256 rows reads each weight from memory once per 256 rows (a 256-token prefill: once);
// against 96-row chunks, interleaved on a shared 2-vCPU Zen 5 (AVX-512, float32): 256 rows
// 198-219 vs 190-207 GFLOP/s, the LM head (576 x 49152) 197 vs 165, 2048 rows within the noise
// (benchmarks/results/dense_cpu_2026-12-04, chunk_96_vs_256.json). helpers and the calling thread take items from one atomic
// counter, and the caller waits until every item is done (the FFI call must not return before).
// A small product is done before a helper would wake up: the calling thread alone runs it.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace jaxserve_dense {

constexpr int64_t kPanel = 16;     // columns per panel (two 8-float vectors)
constexpr int64_t kRowChunk = 256;  // rows per work item

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  // unaligned access

constexpr int kRows = 6;           // rows per AVX2 register block (and the quantized direct path)
constexpr int64_t kPrefetch = 32;  // panel rows ahead (2 KB): the stream stays ahead of the FMAs
// k per block of a multi-tile chunk: the group's panel slice (2 x 192 x 64 B = 24 KB with
// AVX-512) and a tile's x rows (12 x 192 x 4 B = 9 KB) stay in L1 while every tile of the
// chunk sweeps them (576 and 1536 are multiples).
constexpr int64_t kKBlock = 192;

inline v8 load8(const float* p) { return *reinterpret_cast<const v8u*>(p); }
inline v8 splat(float s) { return v8{s, s, s, s, s, s, s, s}; }
// a * b + c rounded once where the ISA has FMA: spelled out rather than left to the
// compiler's contraction, so every path that must round alike (dense_quant_cpu.cc's few-row
// path and the float tile) does, whatever the compiler decides elsewhere.
inline v8 fma8(v8 a, v8 b, v8 c) {
#if defined(__FMA__)
  return reinterpret_cast<v8>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a),
                                              reinterpret_cast<__m256>(b),
                                              reinterpret_cast<__m256>(c)));
#else
  return a * b + c;
#endif
}

// out[r, 0:16] (+)= sum_{k0 <= k < k1} x[r, k] * panel[k, 0:16] for r < R (x stride K, out
// stride ldo); `add`: accumulate onto out (a later k block) rather than overwrite it.
template <int R>
void block(const float* x, int64_t K, int64_t k0, int64_t k1, const float* panel, float* out,
           int64_t ldo, bool add) {
  v8 acc[R][2];
  for (int r = 0; r < R; ++r) {
    acc[r][0] = add ? load8(out + r * ldo) : splat(0.0f);
    acc[r][1] = add ? load8(out + r * ldo + 8) : splat(0.0f);
  }
  for (int64_t k = k0; k < k1; ++k) {
    const float* pk = panel + k * kPanel;
    if (k + kPrefetch < k1) __builtin_prefetch(pk + kPrefetch * kPanel);
    const v8 w0 = load8(pk), w1 = load8(pk + 8);
    for (int r = 0; r < R; ++r) {
      const v8 a = splat(x[r * K + k]);
      acc[r][0] = fma8(a, w0, acc[r][0]);
      acc[r][1] = fma8(a, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(out + r * ldo, acc[r], sizeof(float) * kPanel);
}

// The whole K range, out stride 16 (the quantized kernel's float fallback uses this too).
inline void rows_block(int rows, const float* x, int64_t K, const float* panel, float* out) {
  switch (rows) {
    case 1: block<1>(x, K, 0, K, panel, out, kPanel, false); break;
    case 2: block<2>(x, K, 0, K, panel, out, kPanel, false); break;
    case 3: block<3>(x, K, 0, K, panel, out, kPanel, false); break;
    case 4: block<4>(x, K, 0, K, panel, out, kPanel, false); break;
    case 5: block<5>(x, K, 0, K, panel, out, kPanel, false); break;
    default: block<6>(x, K, 0, K, panel, out, kPanel, false); break;
  }
}

#if defined(__AVX512F__)
constexpr int64_t kGroup = 2;  // panels per work item and tile
constexpr int kTileRows = 12;  // rows per register tile
constexpr const char* kIsa = "avx512";

// out[r, 16 p + c] (+)= sum_{k0 <= k < k1} x[r, k] * panel p [k, c] for r < R, p < NP (x
// stride K; panel p at panel + p * stride; out stride 32; `add` as block's).
template <int R, int NP>
void tile512(const float* x, int64_t K, int64_t k0, int64_t k1, const float* panel,
             int64_t stride, float* out, bool add) {
  constexpr int64_t ldo = kGroup * kPanel;
  __m512 acc[R][NP];
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < NP; ++p) {
      acc[r][p] = add ? _mm512_loadu_ps(out + r * ldo + p * kPanel) : _mm512_setzero_ps();
    }
  }
  for (int64_t k = k0; k < k1; ++k) {
    __m512 w[NP];
    for (int p = 0; p < NP; ++p) {
      const float* pk = panel + p * stride + k * kPanel;
      if (k + kPrefetch < k1) __builtin_prefetch(pk + kPrefetch * kPanel);
      w[p] = _mm512_loadu_ps(pk);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * K + k]);
      for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_fmadd_ps(a, w[p], acc[r][p]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < NP; ++p) _mm512_storeu_ps(out + r * ldo + p * kPanel, acc[r][p]);
  }
}

template <int NP>
void tile512_rows(int rows, const float* x, int64_t K, int64_t k0, int64_t k1,
                  const float* panel, int64_t stride, float* out, bool add) {
  switch (rows) {
#define JAXSERVE_TILE_CASE(R) \
    case R: tile512<R, NP>(x, K, k0, k1, panel, stride, out, add); break;
    JAXSERVE_TILE_CASE(1) JAXSERVE_TILE_CASE(2) JAXSERVE_TILE_CASE(3) JAXSERVE_TILE_CASE(4)
    JAXSERVE_TILE_CASE(5) JAXSERVE_TILE_CASE(6) JAXSERVE_TILE_CASE(7) JAXSERVE_TILE_CASE(8)
    JAXSERVE_TILE_CASE(9) JAXSERVE_TILE_CASE(10) JAXSERVE_TILE_CASE(11)
#undef JAXSERVE_TILE_CASE
    default: tile512<12, NP>(x, K, k0, k1, panel, stride, out, add); break;
  }
}

// out[r, 0:16 np] (+)= x[r, k0:k1] @ rows k0:k1 of the np (1 or 2) panels from `panel`
// (panel stride `stride`), for r < rows <= kTileRows; out stride kGroup * 16.
inline void tile(int rows, int np, const float* x, int64_t K, int64_t k0, int64_t k1,
                 const float* panel, int64_t stride, float* out, bool add) {
  if (np == 2) {
    tile512_rows<2>(rows, x, K, k0, k1, panel, stride, out, add);
  } else {
    tile512_rows<1>(rows, x, K, k0, k1, panel, stride, out, add);
  }
}
#else
constexpr int64_t kGroup = 1;
constexpr int kTileRows = kRows;
#if defined(__AVX2__)
constexpr const char* kIsa = "avx2";
#else
constexpr const char* kIsa = "native";
#endif

inline void tile(int rows, int /*np = 1*/, const float* x, int64_t K, int64_t k0, int64_t k1,
                 const float* panel, int64_t /*stride*/, float* out, bool add) {
  switch (rows) {
    case 1: block<1>(x, K, k0, k1, panel, out, kPanel, add); break;
    case 2: block<2>(x, K, k0, k1, panel, out, kPanel, add); break;
    case 3: block<3>(x, K, k0, k1, panel, out, kPanel, add); break;
    case 4: block<4>(x, K, k0, k1, panel, out, kPanel, add); break;
    case 5: block<5>(x, K, k0, k1, panel, out, kPanel, add); break;
    default: block<6>(x, K, k0, k1, panel, out, kPanel, add); break;
  }
}
#endif

// out[r, 0:16 np] = x[r, :] @ the group's np panels for r < rows <= kRowChunk (out stride
// kGroup * 16). One tile: the whole K range at once (a decode step's few rows). More rows: K
// in blocks of kKBlock, every tile of the chunk over one block before the next, so the
// block's panel slice is read from memory once and from L1 by the other tiles.
inline void chunk(int64_t rows, int np, const float* x, int64_t K, const float* panel,
                  int64_t stride, float* out) {
  constexpr int64_t ldo = kGroup * kPanel;
  if (rows <= kTileRows) {
    tile(static_cast<int>(rows), np, x, K, 0, K, panel, stride, out, false);
    return;
  }
  for (int64_t k0 = 0; k0 < K; k0 += kKBlock) {
    const int64_t k1 = std::min(K, k0 + kKBlock);
    for (int64_t r = 0; r < rows; r += kTileRows) {
      const int n = static_cast<int>(std::min<int64_t>(kTileRows, rows - r));
      tile(n, np, x + r * K, K, k0, k1, panel, stride, out + r * ldo, k0 > 0);
    }
  }
}

// Calls item(group j, first row, end row) for every item, on the pool; returns when all ran.
template <class Item>
void run_panels(xla::ffi::ThreadPool& pool, int64_t M, int64_t P, int64_t work, Item item) {
  struct State {
    Item item;
    int64_t M, P, chunks;
    std::atomic<int64_t> next{0}, done{0};
    State(Item it, int64_t m, int64_t p)
        : item(std::move(it)), M(m), P(p), chunks((m + kRowChunk - 1) / kRowChunk) {}
    void drain() {
      for (int64_t i; (i = next.fetch_add(1)) < P * chunks;) {
        const int64_t j = i % P, ch = i / P;
        item(j, ch * kRowChunk, std::min(M, (ch + 1) * kRowChunk));
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto state = std::make_shared<State>(std::move(item), M, P);
  const int64_t items = P * state->chunks;
  const bool small = work < (int64_t{1} << 17);
  const int64_t helpers = small ? 0 : std::min<int64_t>(pool.num_threads(), items) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([state] { state->drain(); });
  state->drain();
  while (state->done.load(std::memory_order_acquire) < items) std::this_thread::yield();
}

}  // namespace jaxserve_dense

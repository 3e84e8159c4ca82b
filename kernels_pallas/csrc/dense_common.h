// Shared by the CPU dense kernels (dense_cpu.cc, dense_quant_cpu.cc): the float register
// block over one 16-column panel, and the work split over XLA's intra-op thread pool.
//
// Work items are (panel, row chunk of kRowChunk rows), panel fastest, so a row chunk of x stays
// in L2 while the panels stream past; helpers and the calling thread take items from one atomic
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

namespace jaxserve_dense {

constexpr int64_t kPanel = 16;     // columns per panel (two 8-float vectors)
constexpr int64_t kRowChunk = 96;  // rows per work item

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  // unaligned access

constexpr int kRows = 6;           // rows per register block
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

inline void rows_block(int rows, const float* x, int64_t K, const float* panel, float* out) {
  switch (rows) {
    case 1: block<1>(x, K, panel, out); break;
    case 2: block<2>(x, K, panel, out); break;
    case 3: block<3>(x, K, panel, out); break;
    case 4: block<4>(x, K, panel, out); break;
    case 5: block<5>(x, K, panel, out); break;
    default: block<6>(x, K, panel, out); break;
  }
}

// Calls item(panel j, first row, end row) for every item, on the pool; returns when all ran.
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

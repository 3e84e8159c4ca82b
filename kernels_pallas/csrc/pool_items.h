// Independent work items on XLA's intra-op thread pool (the FFI ThreadPool of a CPU custom
// call), shared by the kernels that split a call into items (moe_grouped_cpu.cc, lora_cpu.cc).
//
// run_items(pool, n, parallel, item) runs item(i) for every i < n, on up to num_threads - 1
// pool threads and the calling thread, which takes items too (so a busy pool never stalls the
// call); it returns once every item ran. parallel = false runs them all on the calling thread
// (a small call: waking threads would cost more than the work).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxserve_cpu {

template <class Item>
void run_items(xla::ffi::ThreadPool& pool, int64_t n, bool parallel, Item item) {
  struct State {
    Item item;
    int64_t n;
    std::atomic<int64_t> next{0}, done{0};
    State(Item it, int64_t count) : item(std::move(it)), n(count) {}
    void drain() {
      for (int64_t i; (i = next.fetch_add(1)) < n;) {
        item(i);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto state = std::make_shared<State>(std::move(item), n);
  const int64_t helpers = parallel ? std::min<int64_t>(pool.num_threads(), n) - 1 : 0;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([state] { state->drain(); });
  state->drain();
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

}  // namespace jaxserve_cpu

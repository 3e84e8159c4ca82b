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

// State::drain() on `helpers` pool threads and the calling thread; returns once state->done
// reaches state->n.
template <class State>
void run_workers(xla::ffi::ThreadPool& pool, int64_t helpers, std::shared_ptr<State> state) {
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([state] { state->drain(); });
  state->drain();
  while (state->done.load(std::memory_order_acquire) < state->n) std::this_thread::yield();
}

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
  const int64_t helpers = parallel ? std::min<int64_t>(pool.num_threads(), n) - 1 : 0;
  run_workers(pool, helpers, std::make_shared<State>(std::move(item), n));
}

// run_items (parallel) with one item of lookahead: a worker claims its next item before it
// runs the current one and calls item(i, following, first) (following: the item it runs
// next, -1 if none; first: i is this worker's first), so an item can fetch the next one's
// memory while it computes. Balance stays dynamic, to within the one item a worker holds;
// with under two items a worker, none is claimed ahead (following is -1).
template <class Item>
void run_items_ahead(xla::ffi::ThreadPool& pool, int64_t n, Item item) {
  struct State {
    Item item;
    int64_t n;
    std::atomic<int64_t> next{0}, done{0};
    State(Item it, int64_t count) : item(std::move(it)), n(count) {}
    bool lookahead = false;
    void drain() {
      bool first = true;
      for (int64_t i = next.fetch_add(1); i < n; first = false) {
        const int64_t following = lookahead ? next.fetch_add(1) : n;
        item(i, following < n ? following : -1, first);
        done.fetch_add(1, std::memory_order_release);
        i = lookahead ? following : next.fetch_add(1);
      }
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  auto state = std::make_shared<State>(std::move(item), n);
  // Claiming ahead with fewer than two items a worker would leave a worker without one.
  state->lookahead = n >= 2 * (helpers + 1);
  run_workers(pool, helpers, std::move(state));
}

}  // namespace jaxserve_cpu

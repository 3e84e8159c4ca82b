// The dense kernels' float tile alone, for bench_dense_cpu.py: one thread, hot weights (no XLA,
// no thread pool), the same chunk loop as csrc/dense_cpu.cc's work items, compiled with the
// ISA flags of one variant. Prints one JSON line: the best of 20 sweeps.
//   g++ -O3 -march=native -std=c++17 -mavx512f -mavx512bw -mavx512dq -mavx512vl \
//       -I<jax ffi include> -I kernels_pallas/csrc dense_tile_bench.cc && ./a.out M K N
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "dense_common.h"

using namespace jaxserve_dense;

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s M K N (N a multiple of 16)\n", argv[0]);
    return 2;
  }
  const int64_t M = std::atoll(argv[1]), K = std::atoll(argv[2]), N = std::atoll(argv[3]);
  const int64_t P = N / kPanel;
  std::vector<float> x(M * K, 0.5f), w(P * K * kPanel, 0.25f), y(M * N);
  static float out[kRowChunk][kGroup * kPanel];
  double best = 1e30;
  for (int rep = 0; rep < 20; ++rep) {
    const auto t = std::chrono::steady_clock::now();
    for (int64_t r0 = 0; r0 < M; r0 += kRowChunk) {
      const int64_t r1 = std::min(M, r0 + kRowChunk);
      for (int64_t j0 = 0; j0 < P; j0 += kGroup) {
        const int np = static_cast<int>(std::min(kGroup, P - j0));
        chunk(r1 - r0, np, x.data() + r0 * K, K, w.data() + j0 * K * kPanel, K * kPanel,
              &out[0][0]);
        for (int64_t r = r0; r < r1; ++r) {
          std::memcpy(y.data() + r * N + j0 * kPanel, out[r - r0], 4 * np * kPanel);
        }
      }
    }
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count());
  }
  std::printf("{\"isa\": \"%s\", \"m\": %lld, \"k\": %lld, \"n\": %lld, \"gflops\": %.1f}\n",
              kIsa, static_cast<long long>(M), static_cast<long long>(K),
              static_cast<long long>(N), 2.0 * M * K * N / best / 1e9);
  return 0;
}

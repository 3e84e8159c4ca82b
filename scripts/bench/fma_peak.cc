// The host's FMA peak, for bench_dense_cpu.py: per thread, 12 independent chains of
// vfmadd231ps (enough to cover the FMA latency on two ports), ymm (AVX2) and zmm (AVX-512),
// on 1 and on all hardware threads. Prints one JSON line per case.
//   g++ -O2 -mavx512f -mfma -pthread fma_peak.cc -o fma_peak && ./fma_peak
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#define CHAIN12(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7) OP(8) OP(9) OP(10) OP(11)
#define CLOBBER12 "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", \
                  "xmm9", "xmm10", "xmm11"

__attribute__((noinline)) void ymm(long iters) {
  for (long it = 0; it < iters; ++it) {
#define F(i) "vfmadd231ps %%ymm12, %%ymm13, %%ymm" #i "\n\t"
    asm volatile(CHAIN12(F) ::: CLOBBER12);
#undef F
  }
}

__attribute__((noinline)) void zmm(long iters) {
  for (long it = 0; it < iters; ++it) {
#define F(i) "vfmadd231ps %%zmm12, %%zmm13, %%zmm" #i "\n\t"
    asm volatile(CHAIN12(F) ::: CLOBBER12);
#undef F
  }
}

int main(int argc, char** argv) {
  const bool avx512 = argc < 2 || argv[1][0] != '0';  // "0": the host has no AVX-512
  const long iters = 40000000;
  const int hw = static_cast<int>(std::thread::hardware_concurrency());
  for (int threads : {1, hw}) {
    for (int width : {8, 16}) {
      if (width == 16 && !avx512) continue;
      double best = 0;
      for (int rep = 0; rep < 3; ++rep) {
        const auto t = std::chrono::steady_clock::now();
        std::vector<std::thread> pool;
        for (int i = 0; i < threads; ++i) {
          pool.emplace_back([&] { width == 8 ? ymm(iters) : zmm(iters); });
        }
        for (auto& th : pool) th.join();
        const double s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
        best = std::max(best, threads * iters * 12.0 * width * 2 / s / 1e9);
      }
      std::printf("{\"isa\": \"%s\", \"threads\": %d, \"gflops\": %.1f}\n",
                  width == 8 ? "avx2" : "avx512", threads, best);
    }
  }
  return 0;
}

// Which instruction sets this CPU runs, for cpu_build.py's choice of the dense kernels'
// variant at load (cpuid through __builtin_cpu_supports, which also checks that the OS saves
// the wider registers). isa: "avx512_vnni" (avx512 and VNNI's integer dots), "avx512" (F, BW,
// DQ, VL), "avx2" (AVX2, FMA, F16C) or "native"
// (the variant built with -march=native where the machine is not x86-64).
#include <cstring>

extern "C" __attribute__((visibility("default"))) int JaxserveCpuSupports(const char* isa) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (std::strcmp(isa, "avx512_vnni") == 0) {
    return JaxserveCpuSupports("avx512") && __builtin_cpu_supports("avx512vnni");
  }
  if (std::strcmp(isa, "avx512") == 0) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }
  if (std::strcmp(isa, "avx2") == 0) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }
  return 0;
#else
  return std::strcmp(isa, "native") == 0;
#endif
}

// The multi-LoRA delta's products for bfloat16 stacks as bfloat16 dot products (AVX512_BF16
// vdpbf16ps: per float32 lane, acc += a0 * b0 + a1 * b1 over a pair of bfloat16 values), for
// lora_cpu.cc: half the instructions of widening every weight to float32 and an FMA each.
//
// A decode step of the bundled model with 8 adapters makes ~10 M float32 FMA instructions of
// LoRA (16 lanes each) next to the int8 base's ~1.7 M 64-lane dots a row: compute, not only
// memory, sets the delta's cost, and this halves it.
//
// The rows' operands are rounded to bfloat16 first: x (the shrink's) and u = x @ A (the
// expand's), to nearest even, so each product carries a relative rounding of up to 2^-8 of
// its activation beside the weights' own (the stacks are bfloat16 already); sums stay float32
// (vdpbf16ps rounds each lane's pair sum and treats denormals as zero). The caller picks this
// path for bfloat16 stacks on a CPU with AVX512_BF16, in the avx512_vnni build only (the
// avx512 build keeps the widening path, so both run on the same host in tests).
//
// Pairs run along the contraction: the shrink's k (A rows 2p and 2p + 1, R apart, are
// interleaved word by word with one two-source permute), the expand's r (B rows r and r + 1,
// N apart, interleaved within 128-bit lanes by unpacklo / unpackhi: the lo half holds columns
// {0-3, 8-11, 16-19, 24-27} of 32 and the hi half the rest, put back in order at the store).
#pragma once

#if defined(__AVX512VNNI__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#define JAXSERVE_BF16_DOT 1
#define JAXSERVE_BF16_TARGET __attribute__((target("avx512bf16,avx512bw,avx512f")))

namespace jaxserve_lora_bf16 {

inline bool cpu_has_bf16_dot() { return __builtin_cpu_supports("avx512bf16"); }

// dst[p] = bfloat16 pair (src[2p], src[2p + 1]) (the odd tail's partner zero), p < ceil(n / 2).
JAXSERVE_BF16_TARGET inline void to_pairs(const float* src, int64_t n, uint32_t* dst) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 lo = _mm512_loadu_ps(src + i), hi = _mm512_loadu_ps(src + i + 16);
    _mm512_storeu_si512(dst + i / 2, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
  float tail[32] = {};
  if (i < n) {
    std::memcpy(tail, src + i, sizeof(float) * (n - i));
    const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(tail + 16),
                                                    _mm512_loadu_ps(tail));
    uint32_t out[16];
    _mm512_storeu_si512(out, v);
    std::memcpy(dst + i / 2, out, sizeof(uint32_t) * ((n - i + 1) / 2));
  }
}

// u[t, c:c+16] = xp[t] . A[:, c:c+16] for t < RT (R % 16 == 0): xp[t] the row's bfloat16
// pairs (ceil(K / 2) of them), A [K, R] bfloat16 (row stride R), u row stride R. `next`: the
// lines to fetch meanwhile (lora_cpu.cc's Ahead), a step a pair.
template <int RT, class Fetch>
JAXSERVE_BF16_TARGET void shrink_tile(const uint32_t* const* xp, int64_t K, const uint16_t* A,
                                      int64_t R, int64_t c, float* u, Fetch& next) {
  Fetch fetch = next;  // a local copy the compiler can keep in registers
  // word 2i <- row 2p's column i, word 2i + 1 <- row 2p + 1's (the second source's words
  // are indexed from 32).
  alignas(64) static constexpr uint16_t kIdx[32] = {
      0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i idx = _mm512_load_si512(kIdx);
  constexpr int S = RT >= 8 ? 1 : 8 / RT;  // independent sums a row (the dot's latency)
  __m512 acc[RT][S];
  for (int t = 0; t < RT; ++t) {
    for (int s = 0; s < S; ++s) acc[t][s] = _mm512_setzero_ps();
  }
  const int64_t pairs = K / 2;
  int64_t p = 0;
  for (; p + S <= pairs; p += S) {
    fetch.step();
    for (int s = 0; s < S; ++s) {
      const uint16_t* a0 = A + (2 * (p + s)) * R + c;
      const __m512i w = _mm512_permutex2var_epi16(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a0))),
          idx,
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a0 + R))));
      for (int t = 0; t < RT; ++t) {
        const __m512i xv = _mm512_set1_epi32(static_cast<int>(xp[t][p + s]));
        acc[t][s] = _mm512_dpbf16_ps(acc[t][s], (__m512bh)w, (__m512bh)xv);
      }
    }
  }
  for (; p < pairs; ++p) {
    const uint16_t* a0 = A + (2 * p) * R + c;
    const __m512i w = _mm512_permutex2var_epi16(
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a0))), idx,
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a0 + R))));
    for (int t = 0; t < RT; ++t) {
      const __m512i xv = _mm512_set1_epi32(static_cast<int>(xp[t][p]));
      acc[t][0] = _mm512_dpbf16_ps(acc[t][0], (__m512bh)w, (__m512bh)xv);
    }
  }
  if (K % 2) {  // the last row of A pairs with zero (x's tail pair is (x[K-1], 0))
    const uint16_t* a0 = A + (K - 1) * R + c;
    const __m512i w = _mm512_permutex2var_epi16(
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a0))), idx,
        _mm512_setzero_si512());
    for (int t = 0; t < RT; ++t) {
      const __m512i xv = _mm512_set1_epi32(static_cast<int>(xp[t][pairs]));
      acc[t][0] = _mm512_dpbf16_ps(acc[t][0], (__m512bh)w, (__m512bh)xv);
    }
  }
  next = fetch;
  for (int t = 0; t < RT; ++t) {
    __m512 sum = acc[t][0];
    for (int s = 1; s < S; ++s) sum = _mm512_add_ps(sum, acc[t][s]);
    _mm512_storeu_ps(u + t * R + c, sum);
  }
}

template <int RT, class Fetch>
JAXSERVE_BF16_TARGET void shrink_rows(int rows, const uint32_t* const* xp, int64_t K,
                                      const uint16_t* A, int64_t R, float* u, Fetch& next) {
  if constexpr (RT > 1) {
    if (rows < RT) return shrink_rows<RT - 1>(rows, xp, K, A, R, u, next);
  }
  for (int64_t c = 0; c < R; c += 16) shrink_tile<RT>(xp, K, A, R, c, u, next);
}

// y[t, c:c+32] = up[t] . B[:, c:c+32] for t < RT, NV such 32-column groups from c: up[t] the
// row's u as bfloat16 pairs (R / 2, R even), B [R, N] bfloat16 (row stride N).
template <int RT, int NV, class Fetch>
JAXSERVE_BF16_TARGET void expand_tile(const uint32_t* const* up, int64_t R, const uint16_t* B,
                                      int64_t N, int64_t c, float* const* yr, Fetch& next) {
  Fetch fetch = next;
  __m512 lo[RT][NV], hi[RT][NV];
  for (int t = 0; t < RT; ++t) {
    for (int j = 0; j < NV; ++j) lo[t][j] = hi[t][j] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < R / 2; ++p) {
    fetch.step();
    const uint16_t* b0 = B + (2 * p) * N + c;
    __m512i wl[NV], wh[NV];
    for (int j = 0; j < NV; ++j) {
      const __m512i r0 = _mm512_loadu_si512(b0 + 32 * j);
      const __m512i r1 = _mm512_loadu_si512(b0 + N + 32 * j);
      wl[j] = _mm512_unpacklo_epi16(r0, r1);
      wh[j] = _mm512_unpackhi_epi16(r0, r1);
    }
    for (int t = 0; t < RT; ++t) {
      const __m512i uv = _mm512_set1_epi32(static_cast<int>(up[t][p]));
      for (int j = 0; j < NV; ++j) {
        lo[t][j] = _mm512_dpbf16_ps(lo[t][j], (__m512bh)wl[j], (__m512bh)uv);
        hi[t][j] = _mm512_dpbf16_ps(hi[t][j], (__m512bh)wh[j], (__m512bh)uv);
      }
    }
  }
  // lo lanes 4q..4q+3 are columns 8q..8q+3, hi's are 8q+4..8q+7 (q: the 128-bit lane).
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  next = fetch;
  for (int t = 0; t < RT; ++t) {
    for (int j = 0; j < NV; ++j) {
      _mm512_storeu_ps(yr[t] + c + 32 * j, _mm512_permutex2var_ps(lo[t][j], first, hi[t][j]));
      _mm512_storeu_ps(yr[t] + c + 32 * j + 16,
                       _mm512_permutex2var_ps(lo[t][j], second, hi[t][j]));
    }
  }
}

template <int RT, int NV, class Fetch>
JAXSERVE_BF16_TARGET void expand_rows(int rows, const uint32_t* const* up, int64_t R,
                                      const uint16_t* B, int64_t N, int64_t c,
                                      float* const* yr, Fetch& next) {
  if constexpr (RT > 1) {
    if (rows < RT) return expand_rows<RT - 1, NV>(rows, up, R, B, N, c, yr, next);
  }
  expand_tile<RT, NV>(up, R, B, N, c, yr, next);
}

// y[rows, 0:N32] for rows <= 4, N32 = N rounded down to 32 (the caller does the tail): 64
// columns a tile (4 rows x 2 x 2 halves = 16 accumulators), then 32.
template <class Fetch>
JAXSERVE_BF16_TARGET int64_t expand(int rows, const uint32_t* const* up, int64_t R,
                                    const uint16_t* B, int64_t N, float* const* yr,
                                    Fetch& next) {
  int64_t c = 0;
  for (; c + 64 <= N; c += 64) expand_rows<4, 2>(rows, up, R, B, N, c, yr, next);
  for (; c + 32 <= N; c += 32) expand_rows<4, 1>(rows, up, R, B, N, c, yr, next);
  return c;
}

}  // namespace jaxserve_lora_bf16

#endif  // __AVX512VNNI__

// The vector type of the prefill tile micro-kernels (tile_math.h): one struct, `Simd`, with
// the handful of float-vector operations they use, picked at compile time from what the
// library is built for -- AVX-512F (16 lanes, 32 registers), AVX2 + FMA (8 lanes, 16
// registers) or one float (portable). The attention library is built once with
// -march=native, so an AVX2-only host gets the AVX2 struct, never an AVX-512 instruction;
// cpu_build can also build it with the AVX2 flags on an AVX-512 host (tests, figures).
// Lanes are query rows of a tile; masks say which rows a key is visible to.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "block_math.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace jaxserve_cpu_attention {

// exp(x) for x <= 0, as exp_nonpos (block_math.h): the same reduction and polynomial.
#define JAXSERVE_EXP_POLY(FMA, MUL, ADD, SET1, r)                  \
  V p = SET1(1.9875691500e-4f);                                    \
  p = FMA(p, r, SET1(1.3981999507e-3f));                           \
  p = FMA(p, r, SET1(8.3334519073e-3f));                           \
  p = FMA(p, r, SET1(4.1665795894e-2f));                           \
  p = FMA(p, r, SET1(1.6666665459e-1f));                           \
  p = FMA(p, r, SET1(5.0000001201e-1f));                           \
  p = FMA(MUL(p, r), r, ADD(r, SET1(1.0f)));

#if defined(__AVX512F__)
struct Simd {
  static constexpr int W = 16;        // lanes
  // Register block of the micro-kernels: kRowVecs row vectors x kCols keys (QK) or head dims
  // (PV) of accumulators, plus kRowVecs operand registers and one broadcast.
  static constexpr int kRowVecs = 4;
  static constexpr int kCols = 6;
  // QK keeps two accumulators per (key, row vector) (block_math.h's a and b chains).
  static constexpr int kQkCols = 3;
  using V = __m512;
  using M = __mmask16;
  // Keeps v in a register: without it the compiler folds the load into every FMA using v,
  // which re-reads it once per key (or head dim) and makes the micro-kernels load-bound.
  static void pin(V& v) { asm("" : "+v"(v)); }
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V abs(V a) { return _mm512_abs_ps(a); }
  static V copysign(V mag, V sgn) {  // |mag| with sgn's sign bit
    const __m512i s = _mm512_set1_epi32(0x80000000);
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_andnot_si512(s, _mm512_castps_si512(mag)),
                                               _mm512_and_si512(s, _mm512_castps_si512(sgn))));
  }
  // Lanes i with lo[i] <= k <= hi[i].
  static M holds(const int32_t* lo, const int32_t* hi, int32_t k) {
    const __m512i kv = _mm512_set1_epi32(k);
    return _mm512_cmple_epi32_mask(_mm512_loadu_si512(lo), kv) &
           _mm512_cmple_epi32_mask(kv, _mm512_loadu_si512(hi));
  }
  static M less(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  static M is_neginf(V a) { return _mm512_cmp_ps_mask(a, set1(kNegInf), _CMP_EQ_OQ); }
  static V select(M m, V a, V b) { return _mm512_mask_blend_ps(m, b, a); }  // m ? a : b
  static V exp(V x) {
    x = _mm512_min_ps(_mm512_max_ps(x, set1(-87.0f)), zero());
    const V n = _mm512_roundscale_ps(_mm512_mul_ps(x, set1(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V r = _mm512_fnmadd_ps(n, set1(0.693359375f), x);
    r = _mm512_fmadd_ps(n, set1(2.12194440e-4f), r);
    JAXSERVE_EXP_POLY(_mm512_fmadd_ps, _mm512_mul_ps, _mm512_add_ps, set1, r)
    // p * 2^n as exp_nonpos8 forms it (the short tiles' exp): the same bits in every lane.
    const __m512i e =
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Simd {
  static constexpr int W = 8;
  static constexpr int kRowVecs = 2;  // 2 x kCols accumulators of the 16 ymm registers
  static constexpr int kCols = 6;
  static constexpr int kQkCols = 3;  // 2 x 2 x 3 QK accumulators
  using V = __m256;
  using M = __m256;  // all-ones / all-zeros lanes
  static void pin(V& v) { asm("" : "+v"(v)); }  // as the AVX-512 one
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V abs(V a) { return _mm256_andnot_ps(set1(-0.0f), a); }
  static V copysign(V mag, V sgn) {
    return _mm256_or_ps(abs(mag), _mm256_and_ps(set1(-0.0f), sgn));
  }
  static M holds(const int32_t* lo, const int32_t* hi, int32_t k) {
    const __m256i kv = _mm256_set1_epi32(k);
    const __m256i out = _mm256_or_si256(
        _mm256_cmpgt_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo)), kv),
        _mm256_cmpgt_epi32(kv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi))));
    return _mm256_castsi256_ps(_mm256_xor_si256(out, _mm256_set1_epi32(-1)));
  }
  static M less(V a, V b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
  static M is_neginf(V a) { return _mm256_cmp_ps(a, set1(kNegInf), _CMP_EQ_OQ); }
  static V select(M m, V a, V b) { return _mm256_blendv_ps(b, a, m); }
  static V exp(V x) { return exp_nonpos8(x); }
};
#else
struct Simd {
  static constexpr int W = 1;
  static constexpr int kRowVecs = 4;
  static constexpr int kCols = 4;
  static constexpr int kQkCols = 4;
  using V = float;
  using M = bool;
  static void pin(V&) {}
  static V zero() { return 0.0f; }
  static V set1(float x) { return x; }
  static V load(const float* p) { return *p; }
  static void store(float* p, V v) { *p = v; }
  static V fma(V a, V b, V c) { return std::fma(a, b, c); }
  static V mul(V a, V b) { return a * b; }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V div(V a, V b) { return a / b; }
  static V max(V a, V b) { return std::max(a, b); }
  static V abs(V a) { return a < 0.0f ? -a : a; }
  static V copysign(V mag, V sgn) { return std::signbit(sgn) ? -abs(mag) : abs(mag); }
  static M holds(const int32_t* lo, const int32_t* hi, int32_t k) { return *lo <= k && k <= *hi; }
  static M less(V a, V b) { return a < b; }
  static M is_neginf(V a) { return a == kNegInf; }
  static V select(M m, V a, V b) { return m ? a : b; }
  static V exp(V x) { return exp_nonpos(x); }
};
#endif
#undef JAXSERVE_EXP_POLY

}  // namespace jaxserve_cpu_attention

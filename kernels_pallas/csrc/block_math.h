// Arithmetic of one key block of the CPU paged attention's short tiles (paged_attention_cpu.cc:
// up to kDirectRows rows, decode; taller tiles use tile_math.h): scores of query rows against
// the block's keys, the online-softmax step, the weighted sum of V.
// With AVX2 + FMA these are written with intrinsics (8 score / 8 accumulator registers in
// flight); elsewhere portable loops compute the same thing. Page values load as f32 from
// f32, bf16, f16, int8 or float8_e4m3fn (kv_quant.h); quantized pages' scales are applied by
// the caller (scores x K scale, weights x V scale).
//
// Batch invariance: a query row's result must not depend on the tile it is in (a decode's
// one-token tile here, a speculative verification's or a prefill chunk's tall tile in
// tile_math.h), or greedy decoding would change with speculation, padding or the batch.
// So both paths round exactly alike, per (row, key) and per row: the score q . k is the sum
// of 16 strided chains (lane i of `a`: d = i, 16 + i, ...; of `b`: d = 8 + i, 24 + i, ...;
// each an FMA chain in d order), added a + b then summed as hsum8's tree, then the d past
// the last 8 by FMA; the block's weight sum is 8 chains (keys j = i, i + 8, ...) in hsum8's
// tree; l = fma(l, corr, sum); exp is exp_nonpos8's arithmetic (Simd::exp repeats it); PV
// is acc * corr then one FMA per key in key order. tile_math.h computes those same
// roundings with the rows as lanes (test_paged_attention_cpu's batch-invariance cases).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kv_quant.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace jaxserve_cpu_attention {

constexpr int kBlockKeys = 32;  // keys per inner block (scratch stays in L1)
constexpr int kDirectRows = 8;  // tiles up to this many rows use these; taller: tile_math.h
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float bf16_to_f32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24
    float f = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -f : f;
  }
  bits = exp == 31 ? (sign | 0x7f800000u | (mant << 13))
                    : (sign | ((exp + 112) << 23) | (mant << 13));
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float load(const float* p, int64_t i) { return p[i]; }

struct Bf16 { uint16_t v; };
struct F16 { uint16_t v; };
inline float load(const Bf16* p, int64_t i) { return bf16_to_f32(p[i].v); }
inline float load(const F16* p, int64_t i) { return f16_to_f32(p[i].v); }

// exp(x) for x <= 0 (softmax arguments), branch-free so the loops vectorise: Cody-Waite range
// reduction to r in [-ln2/2, ln2/2] and the Cephes degree-6 polynomial (~1 ulp); arguments
// below -87 give ~1e-38 instead of a subnormal, which no softmax weight can notice.
inline float exp_nonpos(float x) {
  x = std::min(std::max(x, -87.0f), 0.0f);
  float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln2)
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, 4);
  return p * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 exp_nonpos8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_setzero_ps());
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float hmax8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

template <typename KV>
inline __m256 load8(const KV* p) {
  if constexpr (std::is_same<KV, float>::value) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same<KV, I8>::value) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  } else if constexpr (std::is_same<KV, F8>::value) {
#if defined(__F16C__)
    // e4m3fn bits -> f16 bits (sign to bit 15, exponent and mantissa shifted into place):
    // the f16 is the value x 2^-8 (bias 15 vs 7), subnormals included; x 256 is exact.
    const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8),
                                   _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7f)), 7));
    return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
#else
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_i32gather_ps(e4m3fn_table(), _mm256_cvtepu8_epi32(b), 4);
#endif
  } else if constexpr (std::is_same<KV, Bf16>::value) {
    const __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  } else {
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
    return _mm256_setr_ps(load(p, 0), load(p, 1), load(p, 2), load(p, 3), load(p, 4),
                          load(p, 5), load(p, 6), load(p, 7));
#endif
  }
}

// dst[0:n] = src[0:n] as f32, 8 at a time (V rows of non-f32 pages into the block scratch).
template <typename KV>
inline void convert_row(const KV* src, int64_t n, float* dst) {
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) _mm256_storeu_ps(dst + d, load8(src + d));
  for (; d < n; ++d) dst[d] = load(src, d);
}

// sc[r][j] = q_r . K[j] for the block's nk keys, K rows read where they lie (short tiles).
template <typename KV>
inline void qk_direct(const KV* const* krow, int64_t nk, const float* q, int64_t R, int64_t Dq,
                      float* sc) {
  for (int64_t j = 0; j < nk; ++j) {
    const KV* k = krow[j];
    for (int64_t r = 0; r < R; ++r) {
      const float* qr = q + r * Dq;
      __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
      int64_t d = 0;
      for (; d + 16 <= Dq; d += 16) {
        a = _mm256_fmadd_ps(_mm256_loadu_ps(qr + d), load8(k + d), a);
        b = _mm256_fmadd_ps(_mm256_loadu_ps(qr + d + 8), load8(k + d + 8), b);
      }
      if (d + 8 <= Dq) {
        a = _mm256_fmadd_ps(_mm256_loadu_ps(qr + d), load8(k + d), a);
        d += 8;
      }
      float s = hsum8(_mm256_add_ps(a, b));
      for (; d < Dq; ++d) s = std::fma(qr[d], load(k, d), s);
      sc[r * kBlockKeys + j] = s;
    }
  }
}

// Online-softmax step over keys [jlo, jhi) of the block: s becomes the weights (0 outside),
// m and l are updated; returns the factor the row's accumulator must be scaled by.
inline float softmax_block(float* s, int jlo, int jhi, float* m, float* l) {
  const __m256i lo = _mm256_set1_epi32(jlo - 1), hi = _mm256_set1_epi32(jhi);
  __m256 in[kBlockKeys / 8], mv = _mm256_set1_ps(*m);
  for (int b = 0; b < kBlockKeys / 8; ++b) {
    const __m256i j =
        _mm256_add_epi32(_mm256_set1_epi32(8 * b), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    in[b] = _mm256_castsi256_ps(
        _mm256_and_si256(_mm256_cmpgt_epi32(j, lo), _mm256_cmpgt_epi32(hi, j)));
    mv = _mm256_max_ps(
        mv, _mm256_blendv_ps(_mm256_set1_ps(kNegInf), _mm256_loadu_ps(s + 8 * b), in[b]));
  }
  const float mx = hmax8(mv);
  const __m256 mxv = _mm256_set1_ps(mx);
  __m256 sum = _mm256_setzero_ps();
  for (int b = 0; b < kBlockKeys / 8; ++b) {
    const __m256 p =
        _mm256_and_ps(exp_nonpos8(_mm256_sub_ps(_mm256_loadu_ps(s + 8 * b), mxv)), in[b]);
    _mm256_storeu_ps(s + 8 * b, p);
    sum = _mm256_add_ps(sum, p);
  }
  // exp_nonpos8's rounding (the tall tiles' Simd::exp), not the scalar exp_nonpos's.
  const float corr =
      *m == kNegInf ? 0.0f : _mm256_cvtss_f32(exp_nonpos8(_mm256_set1_ps(*m - mx)));
  *m = mx;
  *l = std::fma(*l, corr, hsum8(sum));
  return corr;
}

// acc[0:Dq] = acc * corr + sum_j p[j] * V[j], 64 (then 8) columns at a time in registers.
inline void pv_row(float* acc, const float* p, const float* const* vrow, int64_t jlo,
                   int64_t jhi, int64_t Dq, float corr) {
  const __m256 c = _mm256_set1_ps(corr);
  int64_t d0 = 0;
  for (; d0 + 64 <= Dq; d0 += 64) {
    __m256 a[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + d0 + 8 * i), c);
    for (int64_t j = jlo; j < jhi; ++j) {
      const __m256 w = _mm256_broadcast_ss(p + j);
      const float* v = vrow[j] + d0;
      for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * i), a[i]);
    }
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(acc + d0 + 8 * i, a[i]);
  }
  for (; d0 + 8 <= Dq; d0 += 8) {
    __m256 a = _mm256_mul_ps(_mm256_loadu_ps(acc + d0), c);
    for (int64_t j = jlo; j < jhi; ++j) {
      a = _mm256_fmadd_ps(_mm256_broadcast_ss(p + j), _mm256_loadu_ps(vrow[j] + d0), a);
    }
    _mm256_storeu_ps(acc + d0, a);
  }
  for (; d0 < Dq; ++d0) {
    float a = acc[d0] * corr;
    for (int64_t j = jlo; j < jhi; ++j) a = std::fma(p[j], vrow[j][d0], a);
    acc[d0] = a;
  }
}
#else
template <typename KV>
inline void convert_row(const KV* src, int64_t n, float* dst) {
  for (int64_t d = 0; d < n; ++d) dst[d] = load(src, d);
}

// hsum8's tree over 8 partial sums.
inline float tree8(const float* v) {
  return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

// The AVX2 path's roundings (see the header), one lane at a time.
template <typename KV>
inline void qk_direct(const KV* const* krow, int64_t nk, const float* q, int64_t R, int64_t Dq,
                      float* sc) {
  const int64_t d16 = Dq / 16 * 16, d8 = Dq / 8 * 8;
  for (int64_t j = 0; j < nk; ++j) {
    for (int64_t r = 0; r < R; ++r) {
      const float* qr = q + r * Dq;
      float part[8];
      for (int i = 0; i < 8; ++i) {
        float a = 0.0f, b = 0.0f;
        for (int64_t d = 0; d < d16; d += 16) {
          a = std::fma(qr[d + i], load(krow[j], d + i), a);
          b = std::fma(qr[d + 8 + i], load(krow[j], d + 8 + i), b);
        }
        if (d8 > d16) a = std::fma(qr[d16 + i], load(krow[j], d16 + i), a);
        part[i] = a + b;
      }
      float s = tree8(part);
      for (int64_t d = d8; d < Dq; ++d) s = std::fma(qr[d], load(krow[j], d), s);
      sc[r * kBlockKeys + j] = s;
    }
  }
}

inline float softmax_block(float* s, int jlo, int jhi, float* m, float* l) {
  float mx = *m, part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int j = jlo; j < jhi; ++j) mx = std::max(mx, s[j]);
  for (int j = 0; j < kBlockKeys; ++j) {
    s[j] = j >= jlo && j < jhi ? exp_nonpos(s[j] - mx) : 0.0f;
    part[j % 8] += s[j];
  }
  const float corr = *m == kNegInf ? 0.0f : exp_nonpos(*m - mx);
  *m = mx;
  *l = std::fma(*l, corr, tree8(part));
  return corr;
}

inline void pv_row(float* acc, const float* p, const float* const* vrow, int64_t jlo,
                   int64_t jhi, int64_t Dq, float corr) {
  for (int64_t d = 0; d < Dq; ++d) acc[d] *= corr;
  for (int64_t j = jlo; j < jhi; ++j) {
    for (int64_t d = 0; d < Dq; ++d) acc[d] = std::fma(p[j], vrow[j][d], acc[d]);
  }
}
#endif

}  // namespace jaxserve_cpu_attention

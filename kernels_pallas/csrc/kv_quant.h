// Quantized KV pages on CPU (kernels_pallas/common.py `quantize_rows` is the contract): int8
// and float8_e4m3fn values, one f32 scale per (token, KV head, K-or-V) row. Readers load the
// stored values as floats (the scale is applied to the scores and softmax weights by the
// attention); the write quantizes a row exactly as the jnp write does -- amax, reciprocal
// qmax / amax, one multiply, clip, round half to even (int8) or round to the nearest e4m3fn
// -- so both writes store the same bits.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace jaxserve_cpu_attention {

struct I8 { int8_t v; };   // int8 page values
struct F8 { uint8_t v; };  // float8_e4m3fn page values (bits)

// e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, 0x7f / 0xff are NaN,
// largest finite 448; subnormals m * 2^-9.
inline float e4m3fn_to_f32(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  float a;
  if (e == 15 && m == 7) {
    a = std::numeric_limits<float>::quiet_NaN();
  } else if (e == 0) {
    a = std::ldexp(static_cast<float>(m), -9);
  } else {
    a = std::ldexp(1.0f + m / 8.0f, e - 7);
  }
  return (b & 0x80) ? -a : a;
}

// All 256 codes decoded once: loads are one table lookup (a gather with AVX2).
inline const float* e4m3fn_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = e4m3fn_to_f32(static_cast<uint8_t>(i));
    return t;
  }();
  return table.data();
}

// Nearest e4m3fn, ties to even, for |x| <= 448 (callers clip first).
inline uint8_t f32_to_e4m3fn(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const float a = std::fabs(x);
  if (!(a > 0.0f)) return sign;
  int e2;
  const float m = std::frexp(a, &e2);  // a = m * 2^e2, m in [0.5, 1)
  int e = e2 - 1 + 7;                    // biased exponent of 1.mmm * 2^(e2 - 1)
  if (e < 1) {                           // subnormal: m * 2^-9 (exact scaling, then RNE)
    return sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f));  // 8 is 0x08: 2^-6
  }
  int mant = static_cast<int>(std::nearbyint((2.0f * m - 1.0f) * 8.0f));  // exact, then RNE
  if (mant == 8) { mant = 0; ++e; }
  if (e > 15 || (e == 15 && mant > 6)) { e = 15; mant = 6; }  // saturate at 448
  return sign | static_cast<uint8_t>(e << 3 | mant);
}

inline float load(const I8* p, int64_t i) { return static_cast<float>(p[i].v); }
inline float load(const F8* p, int64_t i) { return e4m3fn_table()[p[i].v]; }

template <typename T> struct QuantMax;
template <> struct QuantMax<I8> { static constexpr float value = 127.0f; };
template <> struct QuantMax<F8> { static constexpr float value = 448.0f; };

// Quantize one row x[0:n] (already f32) into dst[0:n]; dst[n:D] zero. Returns the scale.
template <typename Q>
inline float quantize_row(const float* x, int64_t n, int64_t D, Q* dst) {
  constexpr float qmax = QuantMax<Q>::value;
  float amax = 0.0f;
  for (int64_t d = 0; d < n; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float inv = amax > 0.0f ? qmax / amax : 0.0f;
  for (int64_t d = 0; d < n; ++d) {
    const float y = std::min(std::max(x[d] * inv, -qmax), qmax);
    if constexpr (std::is_same<Q, I8>::value) {
      dst[d].v = static_cast<int8_t>(std::nearbyint(y));
    } else {
      dst[d].v = f32_to_e4m3fn(y);
    }
  }
  std::memset(static_cast<void*>(dst + n), 0, D - n);
  return amax * (1.0f / qmax);  // as XLA computes the jnp write's amax / qmax
}

}  // namespace jaxserve_cpu_attention

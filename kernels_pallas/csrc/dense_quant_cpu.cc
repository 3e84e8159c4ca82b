// The model's dense projections on CPU over quantized, panel-packed weights (XLA FFI).
//
// Data flow: y f32[M, N] = x f32[M, K] @ W, W [K, N] stored quantized in 16-column panels as
// dense_cpu.cc stores float weights (kernels_pallas/dense_quant_cpu.py packs them at load):
//   int8: panels s8[(L,) P, K, 16],     W[k, j] = q * scale
//   fp8:  panels u8[(L,) P, K, 16],     the e4m3fn bytes; W[k, j] = fp8(q) * scale
//   int4: panels u8[(L,) P, K / 2, 16], row 2i in the low nibble of byte row i, 2i + 1 in the
//         high one; W[k, j] = q * scale + zero (q in 0..15)
// scales (and int4's zeros) f32[(L,) P, K / G, 16]: one per group of G consecutive k and
// column (G = K: one per column). A few rows (a decode) read the quantized bytes directly, so
// no float weight is stored: the weights stream from memory at 1 byte (int8, fp8) or half a
// byte (int4) per value, which is what a decode step of a few rows is bound by. Row
// invariant by default: each weight dequantized in registers and FMA'd into every row, as the
// many-row path rounds, so a row's result does not depend on how many rows its step has; the
// `fast` attribute (the engine's default mode; batch-invariant mode turns it off) sums
// x . q per group first and scales once per group, other roundings and fewer multiplies.
//
// fp8 e4m3fn -> f32 without a table: the byte's sign goes to bit 15 and its 7 exponent and
// mantissa bits to bits 7..13 of an IEEE half, which is then the fp8 value * 2^-8 exactly
// (normals and subnormals alike; F16C converts halves to floats in hardware, whatever the
// denormal flags); the 2^8 is folded into the group's scale.
//
// A row range longer than one register block (a prefill's chunk of up to 256 rows) first
// dequantizes its group's panels into float scratch panels (L2-sized), once, and runs
// dense_cpu.cc's float tile over them for every row of the chunk: the conversion costs K x 16
// x kGroup values per up to 256 x that many FMAs, so prefill runs at float32's speed. The work split
// over XLA's thread pool is dense_cpu.cc's (dense_common.h), as is the per-ISA build.
#include <cstdint>
#include <cstring>
#include <vector>

#include "dense_common.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

using jaxserve_dense::kGroup;
using jaxserve_dense::kPanel;
using jaxserve_dense::kRows;
using jaxserve_dense::load8;
using jaxserve_dense::splat;
using jaxserve_dense::v8;
typedef int8_t i8x8 __attribute__((vector_size(8), aligned(1)));
typedef uint8_t u8x8 __attribute__((vector_size(8), aligned(1)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));

constexpr int64_t kPrefetchBytes = 1024;
// Row ranges longer than this dequantize the panel once into a float scratch panel and run the
// float kernel over it: the conversion is then paid once per panel and row chunk, not once per
// block of 6 rows (int4 in groups of 32, 576 x 1536, 32 rows: 2.3 ms -> 0.99 ms on a 2-core
// EPYC, where float32 panels take 0.94 ms; BENCHMARKS.md, "Quantization").
constexpr int64_t kDirectRows = kRows;

// Each decoder turns the panel's stored rows into floats, kUnit weight rows (16 values each)
// per load; kBytes: bytes per stored row; kScale: the factor folded into the group scale.
// GCC turns __builtin_convertvector of 8 bytes to 8 floats into scalar code; with AVX2 the
// widening (vpmovsxbd / vpmovzxbd) and the conversion (vcvtdq2ps) are spelled out.
#if defined(__AVX2__)
inline v8 as_v8(__m256 v) { return reinterpret_cast<v8>(v); }
inline __m256i widen_s8(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i widen_u8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
#endif

struct Int8 {
  static constexpr int kUnit = 1;
  static constexpr int64_t kBytes = kPanel;
  static constexpr float kScale = 1.0f;
  static void load(const uint8_t* p, v8 (*w)[2]) {
#if defined(__AVX2__)
    w[0][0] = as_v8(_mm256_cvtepi32_ps(widen_s8(p)));
    w[0][1] = as_v8(_mm256_cvtepi32_ps(widen_s8(p + 8)));
#else
    w[0][0] = __builtin_convertvector(*reinterpret_cast<const i8x8*>(p), v8);
    w[0][1] = __builtin_convertvector(*reinterpret_cast<const i8x8*>(p + 8), v8);
#endif
  }
};

struct Int4 {
  static constexpr int kUnit = 2;
  static constexpr int64_t kBytes = kPanel;
  static constexpr float kScale = 1.0f;
  static void load(const uint8_t* p, v8 (*w)[2]) {
#if defined(__AVX2__)
    const __m256i a = widen_u8(p), b = widen_u8(p + 8), lo = _mm256_set1_epi32(15);
    w[0][0] = as_v8(_mm256_cvtepi32_ps(_mm256_and_si256(a, lo)));
    w[0][1] = as_v8(_mm256_cvtepi32_ps(_mm256_and_si256(b, lo)));
    w[1][0] = as_v8(_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)));
    w[1][1] = as_v8(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)));
#else
    const u8x8 a = *reinterpret_cast<const u8x8*>(p), b = *reinterpret_cast<const u8x8*>(p + 8);
    w[0][0] = __builtin_convertvector(a & 15, v8);
    w[0][1] = __builtin_convertvector(b & 15, v8);
    w[1][0] = __builtin_convertvector(a >> 4, v8);
    w[1][1] = __builtin_convertvector(b >> 4, v8);
#endif
  }
};

inline v8 fp8x8(const uint8_t* p) {
#if defined(__AVX2__) && defined(__F16C__)
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                 _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7));
  return as_v8(_mm256_cvtph_ps(h));
#else
  const u16x8 b = __builtin_convertvector(*reinterpret_cast<const u8x8*>(p), u16x8);
  const u16x8 h = ((b & 0x80) << 8) | ((b & 0x7F) << 7);
  v8 out;
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<float>(*reinterpret_cast<const _Float16*>(&h[i]));
  }
  return out;
#endif
}

struct Fp8 {
  static constexpr int kUnit = 1;
  static constexpr int64_t kBytes = kPanel;
  static constexpr float kScale = 256.0f;  // the half is the fp8 value * 2^-8
  static void load(const uint8_t* p, v8 (*w)[2]) {
    w[0][0] = fp8x8(p);
    w[0][1] = fp8x8(p + 8);
  }
};

// One stored weight row's 8 values as floats, as both paths form them: q * scale (+ zero,
// one rounding with the FMA).
template <bool kZeros>
inline v8 dequant8(v8 q, v8 s, v8 z) {
  return kZeros ? jaxserve_dense::fma8(q, s, z) : q * s;
}

// out[r, 0:16] = sum_k x[r, k] * W[k, panel columns] for r < R (x stride K, out stride 16).
// Row invariant (kFast false, batch-invariant mode): each weight dequantized in registers
// (dequant8) and one FMA per row in k order, the float tile's roundings over
// dequantize_panel's weights, so a row's result is the same bits whichever path its step's
// row count picks (greedy decoding must not change with the bucket or with speculation's
// verification rows). kFast (the default mode): per group, x . q accumulated in registers,
// then part * scale (+ zero * sum x) added: one multiply per weight and row fewer than
// dequantizing every weight, and other roundings than the many-row path's.
template <int R, class D, bool kZeros, bool kFast>
void block(const float* x, int64_t K, int64_t G, const uint8_t* panel, const float* scales,
           const float* zeros, float* out) {
  v8 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = splat(0.0f);
  constexpr int64_t ahead = kPrefetchBytes / D::kBytes * D::kUnit;  // weight rows ahead
  for (int64_t g0 = 0, gi = 0; g0 < K; g0 += G, ++gi) {
    const v8 s0 = load8(scales + gi * kPanel) * D::kScale;
    const v8 s1 = load8(scales + gi * kPanel + 8) * D::kScale;
    const v8 z0 = kZeros ? load8(zeros + gi * kPanel) : splat(0.0f);
    const v8 z1 = kZeros ? load8(zeros + gi * kPanel + 8) : splat(0.0f);
    v8 part[R][2];
    float xsum[R];
    if constexpr (kFast) {
      for (int r = 0; r < R; ++r) part[r][0] = part[r][1] = splat(0.0f), xsum[r] = 0.0f;
    }
    for (int64_t k = g0; k < g0 + G; k += D::kUnit) {
      const uint8_t* pk = panel + k / D::kUnit * D::kBytes;
      if (k + ahead < K) __builtin_prefetch(pk + ahead / D::kUnit * D::kBytes);
      v8 w[D::kUnit][2];
      D::load(pk, w);
      for (int u = 0; u < D::kUnit; ++u) {
        if constexpr (kFast) {
          for (int r = 0; r < R; ++r) {
            const float xv = x[r * K + k + u];
            const v8 a = splat(xv);
            part[r][0] += a * w[u][0];
            part[r][1] += a * w[u][1];
            if (kZeros) xsum[r] += xv;
          }
        } else {
          const v8 lo = dequant8<kZeros>(w[u][0], s0, z0);
          const v8 hi = dequant8<kZeros>(w[u][1], s1, z1);
          for (int r = 0; r < R; ++r) {
            const v8 a = splat(x[r * K + k + u]);
            acc[r][0] = jaxserve_dense::fma8(a, lo, acc[r][0]);
            acc[r][1] = jaxserve_dense::fma8(a, hi, acc[r][1]);
          }
        }
      }
    }
    if constexpr (kFast) {
      for (int r = 0; r < R; ++r) {
        acc[r][0] += part[r][0] * s0;
        acc[r][1] += part[r][1] * s1;
        if (kZeros) {
          acc[r][0] += splat(xsum[r]) * z0;
          acc[r][1] += splat(xsum[r]) * z1;
        }
      }
    }
  }
  std::memcpy(out, acc, sizeof(float) * R * kPanel);
}

template <class D, bool kZeros, bool kFast>
void rows_block(int rows, const float* x, int64_t K, int64_t G, const uint8_t* panel,
                const float* s, const float* z, float* out) {
  switch (rows) {
    case 1: block<1, D, kZeros, kFast>(x, K, G, panel, s, z, out); break;
    case 2: block<2, D, kZeros, kFast>(x, K, G, panel, s, z, out); break;
    case 3: block<3, D, kZeros, kFast>(x, K, G, panel, s, z, out); break;
    case 4: block<4, D, kZeros, kFast>(x, K, G, panel, s, z, out); break;
    case 5: block<5, D, kZeros, kFast>(x, K, G, panel, s, z, out); break;
    default: block<6, D, kZeros, kFast>(x, K, G, panel, s, z, out); break;
  }
}

// The panel's weights as floats [K, 16] (scales and zeros applied) into `out`, group by group
// (the group's scale and zero vectors loaded once; no division per row).
template <class D, bool kZeros>
void dequantize_panel(int64_t K, int64_t G, const uint8_t* panel, const float* scales,
                      const float* zeros, float* out) {
  for (int64_t g0 = 0, gi = 0; g0 < K; g0 += G, ++gi) {
    const v8 s0 = load8(scales + gi * kPanel) * D::kScale;
    const v8 s1 = load8(scales + gi * kPanel + 8) * D::kScale;
    const v8 z0 = kZeros ? load8(zeros + gi * kPanel) : splat(0.0f);
    const v8 z1 = kZeros ? load8(zeros + gi * kPanel + 8) : splat(0.0f);
    for (int64_t k = g0; k < g0 + G; k += D::kUnit) {
      v8 w[D::kUnit][2];
      D::load(panel + k / D::kUnit * D::kBytes, w);
      for (int u = 0; u < D::kUnit; ++u) {
        const v8 lo = dequant8<kZeros>(w[u][0], s0, z0), hi = dequant8<kZeros>(w[u][1], s1, z1);
        std::memcpy(out + (k + u) * kPanel, &lo, sizeof(lo));
        std::memcpy(out + (k + u) * kPanel + 8, &hi, sizeof(hi));
      }
    }
  }
}

template <class D, bool kZeros>
ffi::Error DenseQuant(ffi::ThreadPool pool, ffi::AnyBuffer x_buf, ffi::AnyBuffer panels,
                      ffi::AnyBuffer scales, ffi::AnyBuffer zeros, ffi::AnyBuffer layer,
                      ffi::Result<ffi::AnyBuffer> y_buf, bool fast) {
  auto xd = x_buf.dimensions(), pd = panels.dimensions(), sd = scales.dimensions();
  auto yd = y_buf->dimensions();
  const size_t nd = pd.size();
  if (xd.size() != 2 || (nd != 3 && nd != 4) || sd.size() != nd || yd.size() != 2 ||
      pd[nd - 1] != kPanel || sd[nd - 1] != kPanel) {
    return ffi::Error::InvalidArgument(
        "dense_quant: x must be [M, K], panels [(L,) P, K', 16], scales [(L,) P, K / G, 16]");
  }
  const int64_t L = nd == 4 ? pd[0] : 1, P = pd[nd - 3], K = xd[1], M = xd[0], N = yd[1];
  const int64_t groups = sd[nd - 2], G = groups > 0 ? K / groups : 0;
  if (pd[nd - 2] * D::kUnit != K || yd[0] != M || N > P * kPanel || N <= (P - 1) * kPanel ||
      sd[nd - 3] != P || (nd == 4 && sd[0] != L) || G * groups != K || G % D::kUnit) {
    return ffi::Error::InvalidArgument("dense_quant: x / panels / scales / y do not agree");
  }
  if (kZeros && zeros.element_count() != scales.element_count()) {
    return ffi::Error::InvalidArgument("dense_quant: zeros must have the scales' shape");
  }
  if (layer.element_count() != 1) return ffi::Error::InvalidArgument("dense_quant: layer");
  const int64_t l = *reinterpret_cast<const int32_t*>(layer.untyped_data());
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("dense_quant: layer out of range");
  if (M == 0) return ffi::Error::Success();
  const float* x = reinterpret_cast<const float*>(x_buf.untyped_data());
  float* y = reinterpret_cast<float*>(y_buf->untyped_data());
  const int64_t panel_bytes = K / D::kUnit * D::kBytes, scale_len = groups * kPanel;
  const uint8_t* base = reinterpret_cast<const uint8_t*>(panels.untyped_data()) +
                        l * P * panel_bytes;
  const float* sbase = reinterpret_cast<const float*>(scales.untyped_data()) + l * P * scale_len;
  const float* zbase = kZeros ? reinterpret_cast<const float*>(zeros.untyped_data()) +
                                    l * P * scale_len : nullptr;
  // Rows [r0, r1) of y's columns [16 kGroup g, 16 kGroup (g + 1)) (fewer in the last group).
  auto item = [=](int64_t g, int64_t r0, int64_t r1) {
    const int64_t j0 = g * kGroup;
    const int np = static_cast<int>(std::min(kGroup, P - j0));
    if (r1 - r0 <= kDirectRows) {  // a few rows: straight from the quantized bytes
      float out[kRows][kPanel];
      for (int p = 0; p < np; ++p) {
        const int64_t j = j0 + p, cols = std::min(kPanel, N - j * kPanel);
        const float* z = kZeros ? zbase + j * scale_len : nullptr;
        const int rows = static_cast<int>(r1 - r0);
        if (fast) {
          rows_block<D, kZeros, true>(rows, x + r0 * K, K, G, base + j * panel_bytes,
                                      sbase + j * scale_len, z, &out[0][0]);
        } else {
          rows_block<D, kZeros, false>(rows, x + r0 * K, K, G, base + j * panel_bytes,
                                       sbase + j * scale_len, z, &out[0][0]);
        }
        for (int i = 0; i < rows; ++i) {
          std::memcpy(y + (r0 + i) * N + j * kPanel, out[i], sizeof(float) * cols);
        }
      }
      return;
    }
    // More rows: the group's panels as floats once, then the float tile over every row.
    thread_local std::vector<float> scratch;
    scratch.resize(kGroup * K * kPanel);
    for (int p = 0; p < np; ++p) {
      const int64_t j = j0 + p;
      dequantize_panel<D, kZeros>(K, G, base + j * panel_bytes, sbase + j * scale_len,
                                  kZeros ? zbase + j * scale_len : nullptr,
                                  scratch.data() + p * K * kPanel);
    }
    const int64_t cols = std::min(np * kPanel, N - j0 * kPanel);
    float out[jaxserve_dense::kRowChunk][kGroup * kPanel];
    jaxserve_dense::chunk(r1 - r0, np, x + r0 * K, K, scratch.data(), K * kPanel, &out[0][0]);
    for (int64_t r = r0; r < r1; ++r) {
      std::memcpy(y + r * N + j0 * kPanel, out[r - r0], sizeof(float) * cols);
    }
  };
  jaxserve_dense::run_panels(pool, M, (P + kGroup - 1) / kGroup, M * K * N, item);
  return ffi::Error::Success();
}

ffi::Error DenseInt8(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer p, ffi::AnyBuffer s,
                     ffi::AnyBuffer layer, ffi::Result<ffi::AnyBuffer> y, bool fast) {
  return DenseQuant<Int8, false>(pool, x, p, s, s, layer, y, fast);
}
ffi::Error DenseFp8(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer p, ffi::AnyBuffer s,
                    ffi::AnyBuffer layer, ffi::Result<ffi::AnyBuffer> y, bool fast) {
  return DenseQuant<Fp8, false>(pool, x, p, s, s, layer, y, fast);
}
ffi::Error DenseInt4(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer p, ffi::AnyBuffer s,
                     ffi::AnyBuffer z, ffi::AnyBuffer layer, ffi::Result<ffi::AnyBuffer> y,
                     bool fast) {
  return DenseQuant<Int4, true>(pool, x, p, s, z, layer, y, fast);
}

}  // namespace

#define JAXSERVE_DENSE_QUANT_BIND \
  ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>() \
      .Arg<ffi::AnyBuffer>()

// x f32[M, K], panels, scales, [zeros,] layer s32[] -> y f32[M, N]; attribute `fast`: the
// few-row path's per-group sums (default mode) instead of the row-invariant FMAs.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveDenseInt8Cpu, DenseInt8,
                              JAXSERVE_DENSE_QUANT_BIND.Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Attr<bool>("fast"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveDenseFp8Cpu, DenseFp8,
                              JAXSERVE_DENSE_QUANT_BIND.Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Attr<bool>("fast"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveDenseInt4Cpu, DenseInt4,
                              JAXSERVE_DENSE_QUANT_BIND.Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("fast"));

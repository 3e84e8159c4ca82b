// The model's dense projections on CPU as integer dot products (XLA FFI): quantized weights
// times activations quantized to int8 on the fly, as llama.cpp runs its Q4 / Q8 blocks.
//
// Data flow: y f32[M, N] = x f32[M, K] @ W, W [K, N] int8 or int4 in groups of G along K
// (kernels_pallas/dense_qdot_cpu.py packs it at load):
// 1. each row of x is cut into activation groups of A consecutive k (A divides G) and each
//    group quantized symmetrically: d = max|x| / 127, xq = round(x / d) in [-127, 127] (s8),
//    with the group's sum of xq (s32) and its exact float sum (int4's zero term). Row by row,
//    so a row's result never depends on the other rows of the batch (greedy decoding gives the
//    same tokens whatever its neighbours);
// 2. W is stored in "quads", the layout of VNNI's vpdpbusd (u8 x s8, four products per 32-bit
//    lane): per 16-column panel, one 64-byte line per 4 consecutive k, column c's four bytes at
//    4c. int8 stores w + 128 as u8 ([(L,) P, K / 4, 64]); int4 stores two quads per line, k
//    rows 8i..8i+3 in the low nibbles and 8i+4..8i+7 in the high ones ([(L,) P, K / 8, 64]);
// 3. per activation group a (of weight group g), per row r and column j, the integer sum
//    I = sum_k xq[r, k] u[k, j] is exact in s32, and
//      int8:  y[r, j] += d[r, a] * s[g, j] * (I - 128 * sum_k xq[r, k])
//      int4:  y[r, j] += d[r, a] * s[g, j] * I + z[g, j] * sum_k x[r, k]
//    (int4: W = q * s + z with q in 0..15). The only error against x @ W in float is the
//    activation rounding, |x - d xq| <= d / 2 per element (dense_qdot_cpu.py's bound).
//
// Why: one vpdpbusd does 64 multiply-adds where an FMA does 16, so at 32 decode rows and in a
// prefill's chunk the projections run at several times float32's rate, where the float path
// first dequantized the weights into scratch (no faster than float32). With one row, the
// weights stream at 1 (int8) or 0.5 (int4) bytes per value, as the float direct path does.
//
// ISAs: built into every dense library (cpu_build.py). With AVX-512 VNNI a tile is up to
// kQRows rows x 2 panels of s32 accumulators, one vpdpbusd per (row, panel, quad). Without
// VNNI (AVX-512BW or AVX2) int4 runs vpmaddubsw + vpmaddwd (two products of 15 x 127 fit s16,
// so nothing saturates); int8 (u8 up to 255: 255 x 127 x 2 saturates s16) is refused there,
// and dense_qdot_cpu.py keeps such weights on the float path. The work split over XLA's
// thread pool is dense_common.h's.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
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

constexpr int64_t kQuadBytes = 64;  // one line: 16 columns x 4 k
#if defined(__AVX512F__)
// Rows per register tile: JAXSERVE_QROWS x 2 panels of s32 and of f32 accumulators.
#ifndef JAXSERVE_QROWS
#define JAXSERVE_QROWS 6
#endif
constexpr int kQRows = JAXSERVE_QROWS;
#else
constexpr int kQRows = 2;  // AVX2: 2 rows x 2 halves of one panel, s32 and f32 (8 ymm of 16)
#endif
constexpr int64_t kPrefetchLines = 16;
// d = max|x| * (1 / 127) rather than / 127: XLA rewrites a division by a constant into this
// product, so the jnp reference (dense_qdot_cpu.quantize_rows) and the kernel agree exactly.
constexpr float kInv127 = 1.0f / 127.0f;

// The activations of one call, quantized row by row (step 1 above).
struct Act {
  const int8_t* q;    // [M, K]
  const float* d;     // [M, K / A]: the group's scale
  const int32_t* qs;  // [M, K / A]: sum of the group's xq
  const float* s;     // [M, K / A]: sum of the group's x
  int64_t K, A, groups;
};

// Row `r` of x (K floats) -> its quantized groups. The integers are the same on every ISA
// (one multiply and a round to nearest even); only the float sum's order differs. Non-finite groups get a NaN
// scale, so a NaN or inf in x reaches y as it would through a float dot.
// One group's max |x| and sum (vectorised where the ISA and A allow; the sum's order, and so
// its last bits, is the ISA's: it only enters int4's zero term).
inline void group_stats(const float* x, int64_t A, float* amax_out, float* sum_out) {
#if defined(__AVX512F__)
  if (A % 16 == 0) {
    __m512 m = _mm512_setzero_ps(), t = _mm512_setzero_ps();
    for (int64_t k = 0; k < A; k += 16) {
      const __m512 v = _mm512_loadu_ps(x + k);
      m = _mm512_max_ps(m, _mm512_abs_ps(v));
      t = _mm512_add_ps(t, v);
    }
    *amax_out = _mm512_reduce_max_ps(m), *sum_out = _mm512_reduce_add_ps(t);
    return;
  }
#elif defined(__AVX2__)
  if (A % 8 == 0) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps(), t = _mm256_setzero_ps();
    for (int64_t k = 0; k < A; k += 8) {
      const __m256 v = _mm256_loadu_ps(x + k);
      m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v));
      t = _mm256_add_ps(t, v);
    }
    alignas(32) float mm[8], tt[8];
    _mm256_store_ps(mm, m), _mm256_store_ps(tt, t);
    float amax = 0.0f, sum = 0.0f;
    for (int i = 0; i < 8; ++i) amax = std::max(amax, mm[i]), sum += tt[i];
    *amax_out = amax, *sum_out = sum;
    return;
  }
#endif
  float amax = 0.0f, sum = 0.0f;
  for (int64_t k = 0; k < A; ++k) {
    amax = std::max(amax, std::fabs(x[k]));
    sum += x[k];
  }
  *amax_out = amax, *sum_out = sum;
}

// xq = round(x * inv) (half to even) for one group; returns the sum of xq.
inline int32_t quantize_group(const float* x, int64_t A, float inv, int8_t* q) {
#if defined(__AVX512F__)
  if (A % 16 == 0) {
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    __m512i t = _mm512_setzero_si512();
    for (int64_t k = 0; k < A; k += 16) {
      // cvtps rounds by MXCSR: to nearest even, as nearbyint below
      __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k), vinv));
      v = _mm512_min_epi32(_mm512_max_epi32(v, lo), hi);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(v));
      t = _mm512_add_epi32(t, v);
    }
    return _mm512_reduce_add_epi32(t);
  }
#endif
  int32_t total = 0;
  for (int64_t k = 0; k < A; ++k) {
    // nearbyint: round half to even under the default rounding mode (jnp.round's rule).
    float v = std::nearbyint(x[k] * inv);
    v = std::min(127.0f, std::max(-127.0f, v));
    q[k] = static_cast<int8_t>(v);
    total += q[k];
  }
  return total;
}

void quantize_row(const float* x, int64_t K, int64_t A, int8_t* q, float* d, int32_t* qs,
                  float* s) {
  for (int64_t a0 = 0, a = 0; a0 < K; a0 += A, ++a) {
    float amax, sum;
    group_stats(x + a0, A, &amax, &sum);
    if (!std::isfinite(sum) || !(amax <= std::numeric_limits<float>::max())) {
      std::memset(q + a0, 0, A);
      d[a] = std::numeric_limits<float>::quiet_NaN();
      qs[a] = 0;
      s[a] = sum;
      continue;
    }
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    d[a] = amax * kInv127;
    qs[a] = quantize_group(x + a0, A, inv, q + a0);
    s[a] = sum;
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define JAXSERVE_QDOT 1
typedef __m512i vi;
typedef __m512 vf;
constexpr int kLanes = 16;  // s32 lanes per vector: one panel
inline vi vzero() { return _mm512_setzero_si512(); }
inline vi vload(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline vi vbcast(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
inline vi vand(vi a, vi b) { return _mm512_and_si512(a, b); }
inline vi vsrl4(vi a) { return _mm512_srli_epi16(a, 4); }
inline vi vset8(int v) { return _mm512_set1_epi8(static_cast<char>(v)); }
// A Dot policy: dot4 adds four u8 x s8 products per 32-bit lane into acc; finish turns a
// group's acc into s32 lane sums; add joins two accumulators of one group.
// - Madd (any AVX-512BW): vpmaddubsw gives s16 pair sums, added up in s16 over the whole
//   activation group, one vpmaddwd per group widens them. int4 only: a pair is at most
//   2 x 15 x 127 = 3,810, and a group of at most 32 k is 16 pairs per s16 lane after 8 quads:
//   30,480 < 32,767, so nothing saturates (s16 adds wrap modulo 2^16, exact as the sum fits).
// - Vnni: vpdpbusd sums straight into s32 (int8's u8 up to 255 needs it); the build with
//   VNNI takes it for both schemes.
struct Madd {
  static vi dot4(vi acc, vi u, vi s) { return _mm512_add_epi16(acc, _mm512_maddubs_epi16(u, s)); }
  static vi finish(vi acc) { return _mm512_madd_epi16(acc, _mm512_set1_epi16(1)); }
  static vi add(vi a, vi b) { return _mm512_add_epi16(a, b); }
};
#if defined(__AVX512VNNI__)
constexpr bool kVnni = true;
struct Vnni {
  static vi dot4(vi acc, vi u, vi s) { return _mm512_dpbusd_epi32(acc, u, s); }
  static vi finish(vi acc) { return acc; }
  static vi add(vi a, vi b) { return _mm512_add_epi32(a, b); }
};
#else
constexpr bool kVnni = false;
using Vnni = Madd;  // never chosen for int8 here (DenseQdot refuses it)
#endif
inline vf vcvt(vi a) { return _mm512_cvtepi32_ps(a); }
inline vi vsub(vi a, int32_t b) { return _mm512_sub_epi32(a, _mm512_set1_epi32(b)); }
inline vf vfload(const float* p) { return _mm512_loadu_ps(p); }
inline void vfstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vfset(float v) { return _mm512_set1_ps(v); }
#elif defined(__AVX2__)
#define JAXSERVE_QDOT 1
// A panel's 16 columns are two 8-lane halves; a "vector" here is the pair.
struct vi { __m256i lo, hi; };
struct vf { __m256 lo, hi; };
constexpr int kLanes = 16;
constexpr bool kVnni = false;
inline vi vzero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline vi vload(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline vi vbcast(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  const __m256i b = _mm256_set1_epi32(v);
  return {b, b};
}
inline vi vand(vi a, vi b) { return {_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)}; }
inline vi vsrl4(vi a) { return {_mm256_srli_epi16(a.lo, 4), _mm256_srli_epi16(a.hi, 4)}; }
inline vi vset8(int v) {
  const __m256i b = _mm256_set1_epi8(static_cast<char>(v));
  return {b, b};
}
// As the AVX-512 build's Madd: s16 pair sums over the group, widened by finish.
inline __m256i dot4h(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s));
}
struct Madd {
  static vi dot4(vi acc, vi u, vi s) {
    return {dot4h(acc.lo, u.lo, s.lo), dot4h(acc.hi, u.hi, s.hi)};
  }
  static vi finish(vi acc) {
    const __m256i one = _mm256_set1_epi16(1);
    return {_mm256_madd_epi16(acc.lo, one), _mm256_madd_epi16(acc.hi, one)};
  }
  static vi add(vi a, vi b) { return {_mm256_add_epi16(a.lo, b.lo), _mm256_add_epi16(a.hi, b.hi)}; }
};
using Vnni = Madd;
inline vf vcvt(vi a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline vi vsub(vi a, int32_t b) {
  const __m256i c = _mm256_set1_epi32(b);
  return {_mm256_sub_epi32(a.lo, c), _mm256_sub_epi32(a.hi, c)};
}
inline vf vfload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vfstore(float* p, vf v) { _mm256_storeu_ps(p, v.lo), _mm256_storeu_ps(p + 8, v.hi); }
inline vf vfma(vf a, vf b, vf c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline vf vmul(vf a, vf b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vf vfset(float v) {
  const __m256 b = _mm256_set1_ps(v);
  return {b, b};
}
#endif

#if defined(JAXSERVE_QDOT)
static_assert(kLanes == kPanel, "one vector of s32 lanes per 16-column panel");

// Weight decoders: one 64-byte line -> kQuads quads of u8 (kStep k per line).
struct Int8Q {
  static constexpr int kQuads = 1;
  static constexpr int64_t kStep = 4;
  static constexpr bool kZeros = false;
  static void load(const uint8_t* p, vi* w) { w[0] = vload(p); }
};
struct Int4Q {
  static constexpr int kQuads = 2;
  static constexpr int64_t kStep = 8;
  static constexpr bool kZeros = true;
  static void load(const uint8_t* p, vi* w) {
    const vi v = vload(p), lo = vset8(15);
    w[0] = vand(v, lo);
    w[1] = vand(vsrl4(v), lo);
  }
};

// out[r, 16 p + c] += the k range [k0, k1) (whole activation groups) of row r of x times
// panel p's columns, for r < R, p < NP. x's quantized rows from act (row stride K); panel p's
// lines at panel + p * pstride; its scales (zeros) at scales + p * sstride, 16 per group;
// out stride kGroup * 16. The float sums stay in registers over the whole range (loaded from
// and stored to out once), so a group's epilogue is a convert, a multiply and an FMA per
// accumulator (int8: a subtraction; int4: one more FMA).
template <int R, int NP, class W>
void qtile(const Act& act, int64_t row, int64_t k0, int64_t k1, int64_t G, const uint8_t* panel,
           int64_t pstride, const float* scales, const float* zeros, int64_t sstride,
           float* out) {
  constexpr int64_t ldo = kGroup * kPanel;
  const int64_t K = act.K, A = act.A;
  const int8_t* xq = act.q + row * K;
  vf f[R][NP];
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < NP; ++p) f[r][p] = vfload(out + r * ldo + p * kPanel);
  }
  // Few rows (a decode step) leave few independent accumulators, and vpdpbusd's latency (not
  // its throughput) would set the pace: there each accumulator is split into kChains that
  // take the quads in turn and are added at the group's end.
  constexpr int kChains = R == 1 ? 4 : R == 2 ? 2 : 1;
  using D = std::conditional_t<kVnni, Vnni, Madd>;
  for (int64_t a0 = k0; a0 < k1; a0 += A) {
    vi acc[R][NP][kChains];
    for (int r = 0; r < R; ++r) {
      for (int p = 0; p < NP; ++p) {
        for (int c = 0; c < kChains; ++c) acc[r][p][c] = vzero();
      }
    }
    for (int64_t k = a0, q = 0; k < a0 + A; k += W::kStep) {
      vi w[NP][W::kQuads];
      for (int p = 0; p < NP; ++p) {
        const uint8_t* line = panel + p * pstride + k / W::kStep * kQuadBytes;
        __builtin_prefetch(line + kPrefetchLines * kQuadBytes);
        W::load(line, w[p]);
      }
      for (int u = 0; u < W::kQuads; ++u, ++q) {
        const int c = static_cast<int>(q % kChains);
        for (int r = 0; r < R; ++r) {
          const vi b = vbcast(xq + r * K + k + 4 * u);
          for (int p = 0; p < NP; ++p) acc[r][p][c] = D::dot4(acc[r][p][c], w[p][u], b);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int p = 0; p < NP; ++p) {
        for (int c = 1; c < kChains; ++c) acc[r][p][0] = D::add(acc[r][p][0], acc[r][p][c]);
      }
    }
    const int64_t a = a0 / A, g = a0 / G;
    for (int p = 0; p < NP; ++p) {
      const vf s = vfload(scales + p * sstride + g * kPanel);
      for (int r = 0; r < R; ++r) {
        const int64_t i = (row + r) * act.groups + a;
        const vi sum = D::finish(acc[r][p][0]);
        const vi dot = W::kZeros ? sum : vsub(sum, 128 * act.qs[i]);
        f[r][p] = vfma(vcvt(dot), vmul(vfset(act.d[i]), s), f[r][p]);
      }
      if (W::kZeros) {
        const vf z = vfload(zeros + p * sstride + g * kPanel);
        for (int r = 0; r < R; ++r) {
          f[r][p] = vfma(vfset(act.s[(row + r) * act.groups + a]), z, f[r][p]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < NP; ++p) vfstore(out + r * ldo + p * kPanel, f[r][p]);
  }
}

// qtile for rows <= R (1 <= rows <= kQRows).
template <int R, int NP, class W>
void qtile_rows(int rows, const Act& act, int64_t row, int64_t k0, int64_t k1, int64_t G,
                const uint8_t* panel, int64_t pstride, const float* scales, const float* zeros,
                int64_t sstride, float* out) {
  if constexpr (R > 1) {
    if (rows < R) {
      return qtile_rows<R - 1, NP, W>(rows, act, row, k0, k1, G, panel, pstride, scales, zeros,
                                      sstride, out);
    }
  }
  qtile<R, NP, W>(act, row, k0, k1, G, panel, pstride, scales, zeros, sstride, out);
}
#endif  // JAXSERVE_QDOT

template <class W>
ffi::Error DenseQdot(ffi::ThreadPool pool, ffi::AnyBuffer x_buf, ffi::AnyBuffer panels,
                     ffi::AnyBuffer scales, ffi::AnyBuffer zeros, ffi::AnyBuffer layer,
                     ffi::Result<ffi::AnyBuffer> y_buf, int64_t A) {
#if !defined(JAXSERVE_QDOT)
  return ffi::Error::InvalidArgument("dense_qdot: this library was built without AVX2");
#else
  if (!W::kZeros && !kVnni) {
    return ffi::Error::InvalidArgument(
        "dense_qdot: int8 weights need AVX-512 VNNI (u8 x s8 pairs would saturate s16)");
  }
  auto xd = x_buf.dimensions(), pd = panels.dimensions(), sd = scales.dimensions();
  auto yd = y_buf->dimensions();
  const size_t nd = pd.size();
  if (xd.size() != 2 || (nd != 3 && nd != 4) || sd.size() != nd || yd.size() != 2 ||
      pd[nd - 1] != kQuadBytes || sd[nd - 1] != kPanel) {
    return ffi::Error::InvalidArgument(
        "dense_qdot: x must be [M, K], panels [(L,) P, K / step, 64], scales [(L,) P, K / G, 16]");
  }
  const int64_t L = nd == 4 ? pd[0] : 1, P = pd[nd - 3], K = xd[1], M = xd[0], N = yd[1];
  const int64_t groups = sd[nd - 2], G = groups > 0 ? K / groups : 0;
  if (pd[nd - 2] * W::kStep != K || yd[0] != M || N > P * kPanel || N <= (P - 1) * kPanel ||
      sd[nd - 3] != P || (nd == 4 && sd[0] != L) || G * groups != K) {
    return ffi::Error::InvalidArgument("dense_qdot: x / panels / scales / y do not agree");
  }
  if (!kVnni && A > 32) {  // Madd's s16 group sums would saturate
    return ffi::Error::InvalidArgument("dense_qdot: activation groups of at most 32 here");
  }
  if (A <= 0 || A % W::kStep || G % A) {
    return ffi::Error::InvalidArgument(
        "dense_qdot: the activation group must divide the weight group and be a multiple of "
        "4 (int8) or 8 (int4)");
  }
  if (W::kZeros && zeros.element_count() != scales.element_count()) {
    return ffi::Error::InvalidArgument("dense_qdot: zeros must have the scales' shape");
  }
  if (layer.element_count() != 1) return ffi::Error::InvalidArgument("dense_qdot: layer");
  const int64_t l = *reinterpret_cast<const int32_t*>(layer.untyped_data());
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("dense_qdot: layer out of range");
  if (M == 0) return ffi::Error::Success();
  const float* x = reinterpret_cast<const float*>(x_buf.untyped_data());
  float* y = reinterpret_cast<float*>(y_buf->untyped_data());

  // Step 1 (M x K values against M x K x N multiply-adds).
  const int64_t na = K / A;
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> d, s;
  thread_local std::vector<int32_t> qs;
  q.resize(M * K), d.resize(M * na), s.resize(M * na), qs.resize(M * na);
  {
    int8_t* qp = q.data();
    float *dp = d.data(), *sp = s.data();
    int32_t* qsp = qs.data();
    // On the pool too where there is enough of it (a prefill's chunk: M x K of millions).
    jaxserve_dense::run_panels(pool, M, 1, 2 * M * K, [=](int64_t, int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        quantize_row(x + r * K, K, A, qp + r * K, dp + r * na, qsp + r * na, sp + r * na);
      }
    });
  }
  const Act act{q.data(), d.data(), qs.data(), s.data(), K, A, na};

  const int64_t panel_bytes = K / W::kStep * kQuadBytes, scale_len = groups * kPanel;
  const uint8_t* base = reinterpret_cast<const uint8_t*>(panels.untyped_data()) +
                        l * P * panel_bytes;
  const float* sbase = reinterpret_cast<const float*>(scales.untyped_data()) + l * P * scale_len;
  const float* zbase = W::kZeros ? reinterpret_cast<const float*>(zeros.untyped_data()) +
                                       l * P * scale_len : nullptr;
  // k per block of a multi-tile item: whole activation groups, the block's lines of the
  // group's panels (2 x 512 / 4 x 64 B = 16 KB for int8) stay in L1 across the tiles.
  const int64_t kblock = std::max<int64_t>(A, 512 / A * A);
  auto item = [=](int64_t g, int64_t r0, int64_t r1) {
    const int64_t j0 = g * kGroup;
    const int np = static_cast<int>(std::min(kGroup, P - j0));
    const uint8_t* panel = base + j0 * panel_bytes;
    const float* sc = sbase + j0 * scale_len;
    const float* zc = W::kZeros ? zbase + j0 * scale_len : nullptr;
    constexpr int64_t ldo = kGroup * kPanel;
    float out[jaxserve_dense::kRowChunk][ldo];
    std::memset(out, 0, sizeof(float) * (r1 - r0) * ldo);
    const int64_t rows = r1 - r0;
    const int64_t kstep = rows <= kQRows ? K : kblock;
    for (int64_t k0 = 0; k0 < K; k0 += kstep) {
      const int64_t k1 = std::min(K, k0 + kstep);
      for (int64_t r = 0; r < rows; r += kQRows) {
        const int n = static_cast<int>(std::min<int64_t>(kQRows, rows - r));
        if (np == 2) {
          qtile_rows<kQRows, 2, W>(n, act, r0 + r, k0, k1, G, panel, panel_bytes, sc, zc, scale_len,
                           out[r]);
        } else {
          qtile_rows<kQRows, 1, W>(n, act, r0 + r, k0, k1, G, panel, panel_bytes, sc, zc, scale_len,
                           out[r]);
        }
      }
    }
    const int64_t cols = std::min(np * kPanel, N - j0 * kPanel);
    for (int64_t r = r0; r < r1; ++r) {
      std::memcpy(y + r * N + j0 * kPanel, out[r - r0], sizeof(float) * cols);
    }
  };
  jaxserve_dense::run_panels(pool, M, (P + kGroup - 1) / kGroup, M * K * N, item);
  return ffi::Error::Success();
#endif
}

// The quantization of step 1 alone (x f32[M, K] -> q s8[M, K], d f32[M, K / A], qs s32[M,
// K / A], s f32[M, K / A]): the tests check it against dense_qdot_cpu.py's jnp version.
ffi::Error QuantizeRows(ffi::Buffer<ffi::F32> x, ffi::Result<ffi::Buffer<ffi::S8>> q,
                        ffi::Result<ffi::Buffer<ffi::F32>> d,
                        ffi::Result<ffi::Buffer<ffi::S32>> qs,
                        ffi::Result<ffi::Buffer<ffi::F32>> s, int64_t A) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || A <= 0 || xd[1] % A || q->element_count() != x.element_count() ||
      d->element_count() != xd[0] * (xd[1] / A) || qs->element_count() != d->element_count() ||
      s->element_count() != d->element_count()) {
    return ffi::Error::InvalidArgument("dense_qdot quantize: x [M, K] with A | K");
  }
  const int64_t M = xd[0], K = xd[1], na = K / A;
  for (int64_t r = 0; r < M; ++r) {
    quantize_row(x.typed_data() + r * K, K, A, q->typed_data() + r * K, d->typed_data() + r * na,
                 qs->typed_data() + r * na, s->typed_data() + r * na);
  }
  return ffi::Error::Success();
}

ffi::Error DenseQdotInt8(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer p,
                         ffi::AnyBuffer s, ffi::AnyBuffer layer, ffi::Result<ffi::AnyBuffer> y,
                         int64_t act_group) {
#if defined(JAXSERVE_QDOT)
  return DenseQdot<Int8Q>(pool, x, p, s, s, layer, y, act_group);
#else
  return ffi::Error::InvalidArgument("dense_qdot: this library was built without AVX2");
#endif
}
ffi::Error DenseQdotInt4(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer p,
                         ffi::AnyBuffer s, ffi::AnyBuffer z, ffi::AnyBuffer layer,
                         ffi::Result<ffi::AnyBuffer> y, int64_t act_group) {
#if defined(JAXSERVE_QDOT)
  return DenseQdot<Int4Q>(pool, x, p, s, z, layer, y, act_group);
#else
  return ffi::Error::InvalidArgument("dense_qdot: this library was built without AVX2");
#endif
}

}  // namespace

#define JAXSERVE_DENSE_QDOT_BIND \
  ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>() \
      .Arg<ffi::AnyBuffer>()

// x f32[M, K], panels (quads), scales, [zeros,] layer s32[] -> y f32[M, N]; attr act_group.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveDenseQdotInt8Cpu, DenseQdotInt8,
                              JAXSERVE_DENSE_QDOT_BIND.Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Attr<int64_t>("act_group"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveDenseQdotInt4Cpu, DenseQdotInt4,
                              JAXSERVE_DENSE_QDOT_BIND.Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("act_group"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQuantizeRowsCpu, QuantizeRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("act_group"));

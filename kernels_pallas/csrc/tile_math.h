// Tall query tiles (prefill chunks) of the CPU paged attention (paged_attention_cpu.cc): the
// tile's rows (token, query head of the group) are the vector lanes, so every step is a
// small GEMM with register blocking and no horizontal reduction:
//   qt  [Dq][Rp]          q^T of the tile, pre-scaled by sm_scale (Rp: rows padded to lanes)
//   st  [kBlockKeys][Rp]  per key block: scores S^T = K q^T, then softmax weights P^T
//   acc [Dq][Rp]          the output accumulator O^T += V^T P^T
// QK: for 4 keys x kRowVecs row vectors, each K element is broadcast against the q^T row
// vectors (4 x 4 zmm accumulators with AVX-512, 4 x 2 ymm with AVX2); K rows are read where
// they lie in the pages (f32) or converted into a block scratch, so nothing is transposed.
// The online softmax runs down the keys of a block with a row vector per lane group (max,
// exp, sum all lane-parallel; masks from per-row [lo, hi] key bounds: causal end, sliding
// window start, the item's key range; masked weights exactly 0). PV: for 4 head dims x
// kRowVecs row vectors, each V element is broadcast against the weight rows. Measured on the
// 2-core AVX-512 host (loaded), one layer's call for a 2,048-token causal prefill with
// SmolLM2-135M's heads (9 / 3, dim 64), f32 pages: the previous row-major tall path (K
// transposed per block, two rows per K load, per-row PV) ran 65-82 GFLOP/s, this one 156-195
// (built for AVX2: 89), the FMA peak then ~265 (scripts/bench/fma_peak.cc); in profile_step's
// 2,048-token prefill step attention + KV write went from 2.4-2.5 s to 1.07 s. Pinning the
// operand registers (Simd::pin) alone took the one-thread kernel from ~85 to ~150 GFLOP/s.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention_plan.h"
#include "block_math.h"
#include "tile_simd.h"

namespace jaxserve_cpu_attention {

// st[jj][c*W..] = kscale[jj] * sum_d krow[jj][d] * qt[d][c*W..] for NJ keys, CR row vectors,
// summed as the short tiles sum it (block_math.h's header): per (key, row) 16 strided FMA
// chains (i = 0..7: a over d = i, 16 + i, ..., b over d = 8 + i, 24 + i, ...), a + b, hsum8's
// tree over the 8, then the d past the last 8. Chain i runs for all the block's keys and
// rows at once (2 x NJ x CR accumulators), and its a + b waits in `part` for the tree.
template <int CR, int NJ>
inline void qk_micro(const float* qt, int64_t Rp, const float* const* krow, int64_t Dq,
                     const float* kscale, float* st) {
  using S = Simd;
  const int64_t d16 = Dq / 16 * 16, d8 = Dq / 8 * 8;
  S::V part[8][NJ][CR];
  auto step = [&](S::V (*acc)[CR], int64_t d) {
    S::V q[CR];
    for (int c = 0; c < CR; ++c) {
      q[c] = S::load(qt + d * Rp + c * S::W);
      S::pin(q[c]);
    }
    for (int jj = 0; jj < NJ; ++jj) {
      const S::V b = S::set1(krow[jj][d]);
      for (int c = 0; c < CR; ++c) acc[jj][c] = S::fma(b, q[c], acc[jj][c]);
    }
  };
  for (int i = 0; i < 8; ++i) {
    S::V a[NJ][CR], b[NJ][CR];
    for (int jj = 0; jj < NJ; ++jj)
      for (int c = 0; c < CR; ++c) a[jj][c] = b[jj][c] = S::zero();
    for (int64_t d = 0; d < d16; d += 16) {
      step(a, d + i);
      step(b, d + 8 + i);
    }
    if (d8 > d16) step(a, d16 + i);
    for (int jj = 0; jj < NJ; ++jj)
      for (int c = 0; c < CR; ++c) part[i][jj][c] = S::add(a[jj][c], b[jj][c]);
  }
  for (int jj = 0; jj < NJ; ++jj) {
    for (int c = 0; c < CR; ++c) {
      const S::V(&v)[8][NJ][CR] = part;
      S::V t = S::add(S::add(S::add(v[0][jj][c], v[4][jj][c]), S::add(v[2][jj][c], v[6][jj][c])),
                      S::add(S::add(v[1][jj][c], v[5][jj][c]), S::add(v[3][jj][c], v[7][jj][c])));
      for (int64_t d = d8; d < Dq; ++d) {
        t = S::fma(S::set1(krow[jj][d]), S::load(qt + d * Rp + c * S::W), t);
      }
      if (kscale != nullptr) t = S::mul(t, S::set1(kscale[jj]));
      S::store(st + jj * Rp + c * S::W, t);
    }
  }
}

template <int CR>
inline void qk_rows(const float* qt, int64_t Rp, const float* const* krow, int64_t nk,
                    int64_t Dq, const float* kscale, float* st) {
  constexpr int N = Simd::kQkCols;
  int64_t j = 0;
  for (; j + N <= nk; j += N) {
    qk_micro<CR, N>(qt, Rp, krow + j, Dq, kscale ? kscale + j : nullptr, st + j * Rp);
  }
  for (; j < nk; ++j) {
    qk_micro<CR, 1>(qt, Rp, krow + j, Dq, kscale ? kscale + j : nullptr, st + j * Rp);
  }
}

// acc[dd][c*W..] = acc * corr + sum_j vrow[j][d0 + dd] * pt[j][c*W..] for ND dims, CR vectors.
template <int CR, int ND>
inline void pv_micro(float* acc, int64_t Rp, const float* pt, const float* const* vrow,
                     int64_t nk, int64_t d0, const float* corr) {
  using S = Simd;
  S::V a[ND][CR], cr[CR];
  for (int c = 0; c < CR; ++c) cr[c] = S::load(corr + c * S::W);
  for (int dd = 0; dd < ND; ++dd)
    for (int c = 0; c < CR; ++c) a[dd][c] = S::mul(S::load(acc + dd * Rp + c * S::W), cr[c]);
  for (int64_t j = 0; j < nk; ++j) {
    S::V p[CR];
    for (int c = 0; c < CR; ++c) {
      p[c] = S::load(pt + j * Rp + c * S::W);
      S::pin(p[c]);
    }
    const float* v = vrow[j] + d0;
    for (int dd = 0; dd < ND; ++dd) {
      const S::V b = S::set1(v[dd]);
      for (int c = 0; c < CR; ++c) a[dd][c] = S::fma(b, p[c], a[dd][c]);
    }
  }
  for (int dd = 0; dd < ND; ++dd)
    for (int c = 0; c < CR; ++c) S::store(acc + dd * Rp + c * S::W, a[dd][c]);
}

template <int CR>
inline void pv_rows(float* acc, int64_t Rp, const float* pt, const float* const* vrow,
                    int64_t nk, int64_t Dq, const float* corr) {
  constexpr int N = Simd::kCols;
  int64_t d = 0;
  for (; d + N <= Dq; d += N) pv_micro<CR, N>(acc + d * Rp, Rp, pt, vrow, nk, d, corr);
  for (; d + 4 <= Dq; d += 4) pv_micro<CR, 4>(acc + d * Rp, Rp, pt, vrow, nk, d, corr);
  for (; d < Dq; ++d) pv_micro<CR, 1>(acc + d * Rp, Rp, pt, vrow, nk, d, corr);
}

// Both products over the tile's RV row vectors, kRowVecs at a time (the last group shorter).
#define JAXSERVE_BY_ROW_GROUPS(CALL)                                           \
  for (int64_t rc = 0; rc < RV; rc += Simd::kRowVecs) {                        \
    const int64_t o = rc * Simd::W;                                            \
    switch (std::min<int64_t>(Simd::kRowVecs, RV - rc)) {                      \
      case 1: CALL(1); break;                                                  \
      case 2: CALL(2); break;                                                  \
      case 3: CALL(3); break;                                                  \
      default: CALL(4); break;                                                 \
    }                                                                          \
  }

inline void qk_tile(const float* qt, int64_t RV, const float* const* krow, int64_t nk,
                    int64_t Dq, const float* kscale, float* st) {
  const int64_t Rp = RV * Simd::W;
#define JAXSERVE_QK(N) qk_rows<N>(qt + o, Rp, krow, nk, Dq, kscale, st + o)
  JAXSERVE_BY_ROW_GROUPS(JAXSERVE_QK)
#undef JAXSERVE_QK
}

inline void pv_tile(float* acc, int64_t RV, const float* pt, const float* const* vrow,
                    int64_t nk, int64_t Dq, const float* corr) {
  const int64_t Rp = RV * Simd::W;
#define JAXSERVE_PV(N) pv_rows<N>(acc + o, Rp, pt + o, vrow, nk, Dq, corr + o)
  JAXSERVE_BY_ROW_GROUPS(JAXSERVE_PV)
#undef JAXSERVE_PV
}
#undef JAXSERVE_BY_ROW_GROUPS

// s = cap * tanh(s / cap) over n floats (n a multiple of W): tanh |u| = (1 - e) / (1 + e),
// e = exp(-2|u|), and its odd Taylor series below 1/16 where 1 - e would cancel (both within
// ~5e-7 relative).
inline void soft_cap_tile(float* s, int64_t n, float cap) {
  using S = Simd;
  const S::V capv = S::set1(cap), one = S::set1(1.0f);
  for (int64_t i = 0; i < n; i += S::W) {
    const S::V u = S::div(S::load(s + i), capv), a = S::abs(u), a2 = S::mul(a, a);
    const S::V e = S::exp(S::mul(a, S::set1(-2.0f)));
    const S::V big = S::div(S::sub(one, e), S::add(one, e));
    const S::V small = S::mul(
        a, S::fma(a2, S::fma(a2, S::set1(2.0f / 15.0f), S::set1(-1.0f / 3.0f)), one));
    S::store(s + i, S::mul(capv, S::copysign(S::select(S::less(a, S::set1(0.0625f)), small,
                                                       big), u)));
  }
}

// Online-softmax step of one key block (keys k0 + [0, nk)) for every row vector: st becomes
// the weights (times vscale[j] for quantized V; l sums the unscaled ones), exactly 0 where
// key k0 + j is outside [lo, hi] of the row; m, l updated; corr: the accumulator's factor.
inline void softmax_tile(float* st, int64_t RV, int64_t nk, int32_t k0, const int32_t* lo,
                         const int32_t* hi, float* m, float* l, float* corr,
                         const float* vscale) {
  using S = Simd;
  const int64_t Rp = RV * S::W;
  for (int64_t o = 0; o < Rp; o += S::W) {
    const S::V m_old = S::load(m + o);
    S::V mx = m_old;
    for (int64_t j = 0; j < nk; ++j) {
      const S::M in = S::holds(lo + o, hi + o, k0 + static_cast<int32_t>(j));
      mx = S::max(mx, S::select(in, S::load(st + j * Rp + o), S::set1(kNegInf)));
    }
    // The weights' sum as the short tiles add it: chain j % 8 in key order, then hsum8's tree.
    S::V part[8];
    for (int i = 0; i < 8; ++i) part[i] = S::zero();
    for (int64_t j = 0; j < nk; ++j) {
      float* s = st + j * Rp + o;
      const S::M in = S::holds(lo + o, hi + o, k0 + static_cast<int32_t>(j));
      const S::V p = S::select(in, S::exp(S::sub(S::load(s), mx)), S::zero());
      part[j % 8] = S::add(part[j % 8], p);
      S::store(s, vscale != nullptr ? S::mul(p, S::set1(vscale[j])) : p);
    }
    const S::V sum = S::add(S::add(S::add(part[0], part[4]), S::add(part[2], part[6])),
                            S::add(S::add(part[1], part[5]), S::add(part[3], part[7])));
    const S::V c = S::select(S::is_neginf(m_old), S::zero(), S::exp(S::sub(m_old, mx)));
    S::store(corr + o, c);
    S::store(l + o, S::fma(S::load(l + o), c, sum));
    S::store(m + o, mx);
  }
}

// One item of a tile taller than kDirectRows rows (see the file header). Writes the output
// rows, or for a split key range the partial state (m, l, acc row-major) for the merge.
template <typename KV>
void run_tall_item(const Problem& pb, const Item& it, float* partial_base) {
  constexpr int W = Simd::W;
  constexpr bool kF32 = std::is_same<KV, float>::value;
  const int64_t G = pb.G, Dq = pb.Dq, R = it.ntok * G, RV = (R + W - 1) / W, Rp = RV * W;
  const KV* kv = static_cast<const KV*>(pb.kv);
  const int32_t* table = pb.block_tables + it.seq * pb.max_pages;
  const int64_t row_stride = pb.ps * pb.D;  // between rows 2h / 2h+1 of a page
  std::vector<float> qt(Dq * Rp, 0.0f), acc(Dq * Rp, 0.0f), st(kBlockKeys * Rp);
  std::vector<float> kb(kF32 ? 0 : kBlockKeys * Dq), vb(kF32 ? 0 : kBlockKeys * Dq);
  alignas(64) float m[kMaxRows], l[kMaxRows], corr[kMaxRows];
  alignas(64) int32_t lo[kMaxRows], hi[kMaxRows];
  const float* krow[kBlockKeys];
  const float* vrow[kBlockKeys];
  float kscale[kBlockKeys], vscale[kBlockKeys];
  for (int64_t r = 0; r < Rp; ++r) {  // keys row r sees: [lo, hi]; padding lanes none
    m[r] = kNegInf;
    l[r] = 0.0f;
    const int64_t qpos = it.pos0 + r / G;
    const int64_t start = pb.window > 0 ? std::max(it.klo, qpos - pb.window + 1) : it.klo;
    lo[r] = r < R ? static_cast<int32_t>(start) : 1;
    hi[r] = r < R ? static_cast<int32_t>(std::min(it.khi - 1, qpos)) : 0;
  }
  for (int64_t r = 0; r < R; ++r) {
    const float* src = pb.q + ((it.tok0 + r / G) * pb.Hq + it.head * G + r % G) * Dq;
    for (int64_t d = 0; d < Dq; ++d) qt[d * Rp + r] = src[d] * pb.sm_scale;
  }

  // Blocks at multiples of kBlockKeys, wherever the item's keys start (a sliding window's
  // first key depends on the tile's first token): the online softmax then splits a row's
  // keys the same way in every tile (keys before klo are masked).
  for (int64_t k0 = it.klo / kBlockKeys * kBlockKeys; k0 < it.khi; k0 += kBlockKeys) {
    const int64_t nk = std::min<int64_t>(kBlockKeys, it.khi - k0);
    for (int64_t j = 0; j < nk; ++j) {  // the block's K / V rows through the block table
      const int64_t k = k0 + j;
      const int64_t base =
          ((int64_t{table[k / pb.ps]} * 2 * pb.Hkv + 2 * it.head) * pb.ps + k % pb.ps) * pb.D;
      if (pb.scales != nullptr) {
        kscale[j] = pb.scales[base / pb.D];
        vscale[j] = pb.scales[base / pb.D + pb.ps];
      }
      if (k + kBlockKeys < it.khi) {  // the next block's rows: pages defeat the prefetcher
        const int64_t kn = k + kBlockKeys;
        const int64_t next = ((int64_t{table[kn / pb.ps]} * 2 * pb.Hkv + 2 * it.head) * pb.ps +
                              kn % pb.ps) * pb.D;
        for (int64_t off = 0; off < Dq * int64_t{sizeof(KV)}; off += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(kv + next) + off);
          __builtin_prefetch(reinterpret_cast<const char*>(kv + next + row_stride) + off);
        }
      }
      if constexpr (kF32) {
        krow[j] = kv + base;
        vrow[j] = kv + base + row_stride;
      } else {
        convert_row(kv + base, Dq, kb.data() + j * Dq);
        convert_row(kv + base + row_stride, Dq, vb.data() + j * Dq);
        krow[j] = kb.data() + j * Dq;
        vrow[j] = vb.data() + j * Dq;
      }
    }
    const bool quant = pb.scales != nullptr;
    qk_tile(qt.data(), RV, krow, nk, Dq, quant ? kscale : nullptr, st.data());
    if (pb.soft_cap > 0.0f) soft_cap_tile(st.data(), nk * Rp, pb.soft_cap);
    softmax_tile(st.data(), RV, nk, static_cast<int32_t>(k0), lo, hi, m, l, corr,
                 quant ? vscale : nullptr);
    pv_tile(acc.data(), RV, st.data(), vrow, nk, Dq, corr);
  }

  if (it.partial >= 0) {  // split key range: (m, l, acc) row-major for merge_partials
    const PartialState st = partial_state(pb, it, partial_base);
    std::memcpy(st.m, m, R * sizeof(float));
    std::memcpy(st.l, l, R * sizeof(float));
    for (int64_t r = 0; r < R; ++r)
      for (int64_t d = 0; d < Dq; ++d) st.acc[r * Dq + d] = acc[d * Rp + r];
    return;
  }
  for (int64_t r = 0; r < R; ++r) {
    float* dst = pb.out + ((it.tok0 + r / G) * pb.Hq + it.head * G + r % G) * Dq;
    const float inv = inv_denominator(pb, it.head * G + r % G, m[r], l[r]);
    for (int64_t d = 0; d < Dq; ++d) dst[d] = acc[d * Rp + r] * inv;
  }
}

}  // namespace jaxserve_cpu_attention

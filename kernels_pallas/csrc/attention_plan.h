// The work plan of the CPU paged attention (paged_attention_cpu.cc): one call's sizes and
// pointers (Problem), its items -- (sequence, kv head, query tile[, key range]) -- planned
// from the metadata, and the merge of the partial softmax states of a tile whose key range
// was split over threads.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "block_math.h"

namespace jaxserve_cpu_attention {

constexpr int kMaxRows = 64;          // query rows per tile (tokens x heads of a group)
// An item's key range is cut at every multiple of kSplitKeys it crosses: the parts run on
// their own threads (a few long sequences still fill the pool) and their softmax states are
// merged. The cut depends on the keys alone, never on the thread count or the batch, so a
// query row is split, and rounded, alike in every call (batch invariance, block_math.h).
constexpr int64_t kSplitKeys = 1024;


// Static sizes and raw pointers of one call.
struct Problem {
  const float* q;       // [T, Hq, Dq]
  const void* kv;       // [P, 2*Hkv, ps, D]
  const float* scales;  // [P, 2*Hkv, ps] for int8 / fp8 pages, else nullptr
  const int32_t* block_tables;  // [S, max_pages]
  float* out;           // [T, Hq, Dq]
  int64_t T, Hq, Dq, P, Hkv, ps, D, S, max_pages, G;
  float sm_scale, soft_cap;  // soft_cap 0: none
  int64_t window;            // 0: none
  const float* sinks;        // [Hq] attention-sink logits (gpt-oss), nullptr: none
};

// 1 / the softmax denominator of a finished row of query head `q_head` (running max m, sum l
// relative to it), with the head's attention sink folded in: a sink joins the denominator
// as e^(sink - m) and brings no value. 0 for a row that saw nothing (and has no sink: with
// one, l + e^(sink + inf) is inf, 1 / inf also 0).
inline float inv_denominator(const Problem& pb, int64_t q_head, float m, float l) {
  if (pb.sinks != nullptr) l += std::exp(pb.sinks[q_head] - m);
  return l > 0.0f ? 1.0f / l : 0.0f;
}

// One unit of work: query tokens [tok0, tok0 + ntok) of sequence `seq` at positions
// pos0.., kv head `head`, keys [klo, khi). partial < 0: write out; else the offset (floats)
// of its partial state: m [R], l [R], acc [R][Dq] for its R = ntok * G rows.
struct Item {
  int64_t seq, head, tok0, ntok, pos0, klo, khi, cost;
  int64_t partial;
};

// Where a split part's rows' state goes: m at [0, R), l at [R, 2R), acc rows from 2R.
struct PartialState {
  float *m, *l, *acc;
};
inline PartialState partial_state(const Problem& pb, const Item& it, float* base) {
  const int64_t R = it.ntok * pb.G;
  float* p = base + it.partial;
  return {p, p + R, p + 2 * R};
}

// Merge the partial states of items [first, first + n) (same tile, disjoint key ranges).
void merge_partials(const Problem& pb, const std::vector<Item>& items, size_t first, size_t n,
                    float* partial_base) {
  const Item& it = items[first];
  const int64_t G = pb.G, Dq = pb.Dq, R = it.ntok * G;
  for (int64_t r = 0; r < R; ++r) {
    float mx = kNegInf;
    for (size_t i = 0; i < n; ++i) {
      mx = std::max(mx, partial_state(pb, items[first + i], partial_base).m[r]);
    }
    const int64_t t = r / G, g = r % G;
    float* dst = pb.out + ((it.tok0 + t) * pb.Hq + it.head * G + g) * Dq;
    std::fill(dst, dst + Dq, 0.0f);
    float l = 0.0f;
    for (size_t i = 0; i < n; ++i) {
      const PartialState st = partial_state(pb, items[first + i], partial_base);
      if (st.m[r] == kNegInf) continue;  // this part saw no key of row r
      // One live part: w = exp(0) = 1 exactly, so the row equals its unsplit result.
      const float w = exp_nonpos(st.m[r] - mx);
      l += w * st.l[r];
      const float* a = st.acc + r * Dq;
      for (int64_t d = 0; d < Dq; ++d) dst[d] += w * a[d];
    }
    const float inv = inv_denominator(pb, it.head * G + g, mx, l);
    for (int64_t d = 0; d < Dq; ++d) dst[d] *= inv;
  }
}

// Plan the call's items: tiles of every live sequence and kv head, each cut at the multiples
// of kSplitKeys its key range crosses. Returns the floats of partial state the parts need.
int64_t plan_items(const Problem& pb, const int32_t* kv_lens, const int32_t* cu, int64_t live,
                   std::vector<Item>* items) {
  const int64_t tile_tokens = std::max<int64_t>(1, kMaxRows / pb.G);
  const int64_t key_cap = pb.max_pages * pb.ps;
  int64_t floats = 0;
  for (int64_t s = 0; s < live; ++s) {
    const int64_t start = std::clamp<int64_t>(cu[s], 0, pb.T);
    const int64_t end = std::clamp<int64_t>(cu[s + 1], start, pb.T);
    const int64_t kv_len = std::min<int64_t>(kv_lens[s], key_cap);
    const int64_t q_len = end - start;
    if (q_len <= 0 || kv_len <= 0) continue;
    for (int64_t t0 = 0; t0 < q_len; t0 += tile_tokens) {
      const int64_t ntok = std::min(tile_tokens, q_len - t0);
      const int64_t pos0 = std::max<int64_t>(0, kv_len - q_len + t0);
      const int64_t khi = std::min(pos0 + ntok, kv_len);
      const int64_t klo = pb.window > 0 ? std::max<int64_t>(0, pos0 - pb.window + 1) : 0;
      if (khi <= klo) continue;
      const bool split = klo / kSplitKeys != (khi - 1) / kSplitKeys;
      for (int64_t h = 0; h < pb.Hkv; ++h) {
        if (!split) {
          items->push_back({s, h, start + t0, ntok, pos0, klo, khi, (khi - klo) * ntok, -1});
          continue;
        }
        for (int64_t lo = klo; lo < khi;) {
          const int64_t hi = std::min(khi, (lo / kSplitKeys + 1) * kSplitKeys);
          items->push_back({s, h, start + t0, ntok, pos0, lo, hi, (hi - lo) * ntok, floats});
          floats += ntok * pb.G * (pb.Dq + 2);
          lo = hi;
        }
      }
    }
  }
  return floats;
}

}  // namespace jaxserve_cpu_attention

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
constexpr int64_t kMinSplitKeys = 512;  // a split key range is at least this long


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
// pos0.., kv head `head`, keys [klo, khi). partial < 0: write out; else partial-state slot.
struct Item {
  int64_t seq, head, tok0, ntok, pos0, klo, khi, cost;
  int64_t partial;
};

// Merge the partial states of items [first, first + n) (same tile, disjoint key ranges).
void merge_partials(const Problem& pb, const std::vector<Item>& items, size_t first, size_t n,
                    const float* partial_base) {
  const Item& it = items[first];
  const int64_t G = pb.G, Dq = pb.Dq, R = it.ntok * G, stride = kMaxRows * (Dq + 2);
  for (int64_t r = 0; r < R; ++r) {
    float mx = kNegInf;
    for (size_t i = 0; i < n; ++i) {
      mx = std::max(mx, partial_base[items[first + i].partial * stride + r]);
    }
    const int64_t t = r / G, g = r % G;
    float* dst = pb.out + ((it.tok0 + t) * pb.Hq + it.head * G + g) * Dq;
    std::fill(dst, dst + Dq, 0.0f);
    float l = 0.0f;
    for (size_t i = 0; i < n; ++i) {
      const float* st = partial_base + items[first + i].partial * stride;
      if (st[r] == kNegInf) continue;  // this part saw no key of row r
      const float w = exp_nonpos(st[r] - mx);
      l += w * st[kMaxRows + r];
      const float* a = st + 2 * kMaxRows + r * Dq;
      for (int64_t d = 0; d < Dq; ++d) dst[d] += w * a[d];
    }
    const float inv = inv_denominator(pb, it.head * G + g, mx, l);
    for (int64_t d = 0; d < Dq; ++d) dst[d] *= inv;
  }
}

// Plan the call's items: tiles of every live sequence and kv head, split by key range when
// there are fewer tiles than 2 per thread. Returns the number of partial-state slots used.
int64_t plan_items(const Problem& pb, const int32_t* kv_lens, const int32_t* cu, int64_t live,
                   int64_t threads, std::vector<Item>* items) {
  const int64_t tile_tokens = std::max<int64_t>(1, kMaxRows / pb.G);
  const int64_t key_cap = pb.max_pages * pb.ps;
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
      for (int64_t h = 0; h < pb.Hkv; ++h) {
        items->push_back({s, h, start + t0, ntok, pos0, klo, khi, (khi - klo) * ntok, -1});
      }
    }
  }
  const int64_t want = 2 * threads, n = static_cast<int64_t>(items->size());
  int64_t slots = 0;
  if (n == 0 || n >= want) return 0;
  std::vector<Item> split;
  for (const Item& it : *items) {
    const int64_t keys = it.khi - it.klo;
    const int64_t parts = std::clamp<int64_t>(keys / kMinSplitKeys, 1, (want + n - 1) / n);
    if (parts == 1) { split.push_back(it); continue; }
    const int64_t step = (keys + parts - 1) / parts;
    for (int64_t lo = it.klo; lo < it.khi; lo += step) {
      Item part = it;
      part.klo = lo;
      part.khi = std::min(it.khi, lo + step);
      part.cost = (part.khi - part.klo) * it.ntok;
      part.partial = slots++;
      split.push_back(part);
    }
  }
  items->swap(split);
  return slots;
}

}  // namespace jaxserve_cpu_attention

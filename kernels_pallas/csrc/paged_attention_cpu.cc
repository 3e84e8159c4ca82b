// Ragged paged attention on CPU, registered with XLA as an FFI custom call.
//
// Data flow (one call = one layer of one engine step; kernels_pallas/common.py is the
// contract): q f32[T, Hq, Dq] and the pages kv[P, 2*Hkv, page_size, D] (f32/bf16/f16, or
// int8/float8_e4m3fn with f32 scales[P, 2*Hkv, page_size] beside them; K of kv head h on row
// 2h, V on 2h+1) -> out f32[T, Hq, Dq]. The work is cut into items of
// (sequence, kv head, query tile[, key range]); a query tile holds up to kMaxRows rows, each
// row one (token, query head of the group), so a tile reads each K/V row of its key range
// once for all query heads of the group. Per item, keys are visited in blocks of kBlockKeys
// straight from the pages through the block table: tiles of up to 8 rows (decode) score the
// K rows where they lie, row by row (block_math.h); taller tiles (prefill chunks) run
// register-blocked micro-kernels with the tile's rows as vector lanes, AVX-512 or AVX2 as the
// library is built (tile_math.h, tile_simd.h: ~4x the earlier tall path's GFLOP/s). V rows are
// read where they lie (f32) or converted into a block-sized scratch (other dtypes); nothing of
// the cache is copied beyond one block. Quantized pages: the block's scores are multiplied by
// their keys' K scales and, after the softmax step, the weights by the V scales (the
// denominator keeps the unscaled weights). QK, an f32 online softmax and PV are fused per
// block. Items run on XLA's intra-op thread pool, largest first; key ranges are cut at every
// multiple of kSplitKeys (attention_plan.h: fixed boundaries, so a row rounds alike in any
// batch; few long sequences still fill the pool) and the parts' softmax states merged at
// the end. Short and tall tiles round alike (block_math.h's header): a query row's output
// is the same bits in a decode, a verification, a prefill chunk or beside any other rows.
// Tokens outside every live sequence get zeros. The write
// (kv_write.h) stores the step's K/V rows first, quantizing them for int8 / fp8 pages
// (kv_quant.h).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "attention_plan.h"
#include "block_math.h"
#include "tile_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#include "kv_write.h"  // NOLINT: after the ffi alias it uses

namespace {

using namespace jaxserve_cpu_attention;  // NOLINT: the block arithmetic of this kernel

template <typename KV>
void run_item(const Problem& pb, const Item& it, float* partial_base) {
  const int64_t G = pb.G, Dq = pb.Dq, R = it.ntok * G;
  if (R > kDirectRows) return run_tall_item<KV>(pb, it, partial_base);  // tile_math.h
  const KV* kv = static_cast<const KV*>(pb.kv);
  const int32_t* table = pb.block_tables + it.seq * pb.max_pages;
  const int64_t row_stride = pb.ps * pb.D;  // between rows 2h / 2h+1 of a page
  // Scratch: q tile (pre-scaled), V block (non-f32 pages), scores [R][kBlockKeys].
  std::vector<float> qt(R * Dq), vb;
  std::vector<float> sc(R * kBlockKeys);
  std::vector<float> acc(R * Dq, 0.0f);
  float m[kMaxRows], l[kMaxRows];
  const float* vrow[kBlockKeys];
  float kscale[kBlockKeys], vscale[kBlockKeys];  // quantized pages: the block's row scales
  constexpr bool kF32 = std::is_same<KV, float>::value;
  if (!kF32) vb.resize(kBlockKeys * Dq);
  for (int64_t t = 0; t < it.ntok; ++t) {
    const float* src = pb.q + ((it.tok0 + t) * pb.Hq + it.head * G) * Dq;
    for (int64_t i = 0; i < G * Dq; ++i) qt[t * G * Dq + i] = src[i] * pb.sm_scale;
  }
  for (int64_t r = 0; r < R; ++r) { m[r] = kNegInf; l[r] = 0.0f; }

  // Blocks at multiples of kBlockKeys, wherever the item's keys start (a sliding window's
  // first key depends on the tile's first token): the online softmax then splits a row's
  // keys the same way in every tile (keys before klo are masked).
  for (int64_t k0 = it.klo / kBlockKeys * kBlockKeys; k0 < it.khi; k0 += kBlockKeys) {
    const int64_t nk = std::min<int64_t>(kBlockKeys, it.khi - k0);
    // Rows of the block's keys, page by page through the block table: the scores come
    // straight from the K rows in the pages; V is read in place (f32) or converted into a
    // block-sized scratch.
    const KV* krow[kBlockKeys];
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t k = k0 + j;
      const int64_t page = table[k / pb.ps];
      const int64_t base = ((page * 2 * pb.Hkv + 2 * it.head) * pb.ps + k % pb.ps) * pb.D;
      krow[j] = kv + base;
      if (pb.scales != nullptr) {  // row scales sit at the rows' index in the pages / D
        kscale[j] = pb.scales[base / pb.D];
        vscale[j] = pb.scales[base / pb.D + pb.ps];
      }
      // Pages are scattered, so the hardware prefetcher stops at each one: ask for the next
      // block's K and V rows while this block computes.
      if (k + kBlockKeys < it.khi) {
        const int64_t kn = k + kBlockKeys;
        const int64_t next = ((int64_t{table[kn / pb.ps]} * 2 * pb.Hkv + 2 * it.head) * pb.ps +
                              kn % pb.ps) * pb.D;
        for (int64_t off = 0; off < Dq * int64_t{sizeof(KV)}; off += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(kv + next) + off);
          __builtin_prefetch(reinterpret_cast<const char*>(kv + next + row_stride) + off);
        }
      }
      if constexpr (kF32) {
        vrow[j] = reinterpret_cast<const float*>(kv) + base + row_stride;
      } else {
        float* dst = vb.data() + j * Dq;
        convert_row(kv + base + row_stride, Dq, dst);
        vrow[j] = dst;
      }
    }
    qk_direct(krow, nk, qt.data(), R, Dq, sc.data());
    if (pb.scales != nullptr) {  // scores of quantized keys: (q . k_q) * k_scale
      for (int64_t r = 0; r < R; ++r) {
        float* s = sc.data() + r * kBlockKeys;
        for (int64_t j = 0; j < nk; ++j) s[j] *= kscale[j];
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      // Keys row r may see: causal end qpos, sliding-window start, this item's range.
      const int64_t qpos = it.pos0 + r / G;
      int64_t lo = std::max(k0, it.klo), hi = std::min(k0 + nk, qpos + 1);
      if (pb.window > 0) lo = std::max(lo, qpos - pb.window + 1);
      if (lo >= hi) continue;
      float* s = sc.data() + r * kBlockKeys;
      // tile_math.h's soft cap (not std::tanh): the tall tiles' rounding (block_math.h).
      if (pb.soft_cap > 0.0f) soft_cap_tile(s, kBlockKeys, pb.soft_cap);
      const float corr = softmax_block(s, static_cast<int>(lo - k0), static_cast<int>(hi - k0),
                                       &m[r], &l[r]);
      if (pb.scales != nullptr) {  // l has the unscaled weights; p @ v_q takes p * v_scale
        for (int64_t j = lo - k0; j < hi - k0; ++j) s[j] *= vscale[j];
      }
      pv_row(acc.data() + r * Dq, s, vrow, lo - k0, hi - k0, Dq, corr);
    }
  }

  if (it.partial >= 0) {  // split key range: keep (m, l, acc) for the merge
    const PartialState st = partial_state(pb, it, partial_base);
    std::memcpy(st.m, m, R * sizeof(float));
    std::memcpy(st.l, l, R * sizeof(float));
    std::memcpy(st.acc, acc.data(), R * Dq * sizeof(float));
    return;
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = r / G, g = r % G;
    float* dst = pb.out + ((it.tok0 + t) * pb.Hq + it.head * G + g) * Dq;
    const float inv = inv_denominator(pb, it.head * G + g, m[r], l[r]);
    for (int64_t d = 0; d < Dq; ++d) dst[d] = acc[r * Dq + d] * inv;
  }
}

// Shared by the caller and the helper tasks; a helper that starts after all items were
// claimed touches nothing but this (kept alive by its shared_ptr).
struct Work {
  Problem pb;
  std::vector<Item> items;
  std::vector<size_t> order;  // items by decreasing cost
  std::unique_ptr<float[]> partials;  // split parts' states, written before they are read
  ffi::DataType dtype;
  std::atomic<size_t> next{0}, done{0};

  void drain() {
    for (size_t i; (i = next.fetch_add(1)) < order.size();) {
      const Item& it = items[order[i]];
      switch (dtype) {
        case ffi::DataType::F32: run_item<float>(pb, it, partials.get()); break;
        case ffi::DataType::BF16: run_item<Bf16>(pb, it, partials.get()); break;
        case ffi::DataType::S8: run_item<I8>(pb, it, partials.get()); break;
        case ffi::DataType::F8E4M3FN: run_item<F8>(pb, it, partials.get()); break;
        default: run_item<F16>(pb, it, partials.get()); break;
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// scales: the f32 [P, 2*Hkv, ps] row scales of int8 / fp8 pages, nullptr for float pages.
ffi::Error attend(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kv,
                  const float* scales, ffi::Buffer<ffi::S32> block_tables,
                  ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> cu_q_lens,
                  ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::F32> sinks,
                  ffi::Result<ffi::Buffer<ffi::F32>> out, float sm_scale,
                  int64_t sliding_window, float soft_cap) {
  auto qd = q.dimensions(), kd = kv.dimensions(), bd = block_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || bd.size() != 2 || kd[1] % 2 || qd[1] % (kd[1] / 2) ||
      qd[2] > kd[3]) {
    return ffi::Error::InvalidArgument(
        "paged attention: inconsistent q / kv_pages / block_tables shapes");
  }
  const ffi::DataType dt = kv.element_type();
  const bool quantized = dt == ffi::DataType::S8 || dt == ffi::DataType::F8E4M3FN;
  if (quantized != (scales != nullptr) ||
      (!quantized && dt != ffi::DataType::F32 && dt != ffi::DataType::BF16 &&
       dt != ffi::DataType::F16)) {
    return ffi::Error::InvalidArgument(
        "paged attention: kv_pages must be f32, bf16 or f16, or int8 / f8e4m3fn with scales");
  }
  // Sinks: an empty buffer is "none" (the call stays one handler whatever the model).
  if (sinks.element_count() != 0 && sinks.element_count() != static_cast<size_t>(qd[1])) {
    return ffi::Error::InvalidArgument("paged attention: sinks must hold one value per q head");
  }
  auto work = std::make_shared<Work>();
  Problem& pb = work->pb;
  pb = {q.typed_data(), kv.untyped_data(), scales, block_tables.typed_data(), out->typed_data(),
        qd[0], qd[1], qd[2], kd[0], kd[1] / 2, kd[2], kd[3], bd[0], bd[1], qd[1] / (kd[1] / 2),
        sm_scale, soft_cap, sliding_window,
        sinks.element_count() ? sinks.typed_data() : nullptr};
  if (pb.G > kMaxRows) {
    return ffi::Error::InvalidArgument("paged attention: more than 64 query heads per kv head");
  }
  std::fill(pb.out, pb.out + pb.T * pb.Hq * pb.Dq, 0.0f);  // padding tokens stay zero
  const int64_t live = std::clamp<int64_t>(num_seqs.typed_data()[0], 0, pb.S);
  const int64_t pool_threads = pool.num_threads();
  const int64_t floats = plan_items(pb, kv_lens.typed_data(), cu_q_lens.typed_data(), live,
                                    &work->items);
  // A page id outside the array would read out of bounds: refuse the call instead.
  for (const Item& it : work->items) {
    const int32_t* row = pb.block_tables + it.seq * pb.max_pages;
    for (int64_t p = it.klo / pb.ps; p <= (it.khi - 1) / pb.ps; ++p) {
      if (row[p] < 0 || row[p] >= pb.P) {
        return ffi::Error::InvalidArgument(
            "paged attention: block table holds a page id out of range");
      }
    }
  }
  work->dtype = dt;
  if (floats > 0) work->partials.reset(new float[floats]);
  work->order.resize(work->items.size());
  for (size_t i = 0; i < work->order.size(); ++i) work->order[i] = i;
  std::stable_sort(work->order.begin(), work->order.end(),
                   [&](size_t a, size_t b) { return work->items[a].cost > work->items[b].cost; });
  const int64_t helpers =
      std::min<int64_t>(pool_threads, static_cast<int64_t>(work->items.size())) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->drain(); });
  work->drain();
  while (work->done.load(std::memory_order_acquire) < work->items.size()) std::this_thread::yield();
  // Merge split tiles: their parts are consecutive in `items`, all with partial >= 0.
  const auto& items = work->items;
  for (size_t i = 0; i < items.size();) {
    if (items[i].partial < 0) { ++i; continue; }
    size_t n = 1;
    while (i + n < items.size() && items[i + n].partial >= 0 && items[i + n].seq == items[i].seq &&
           items[i + n].head == items[i].head && items[i + n].tok0 == items[i].tok0) ++n;
    merge_partials(pb, items, i, n, work->partials.get());
    i += n;
  }
  return ffi::Error::Success();
}


ffi::Error Attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kv,
                     ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> kv_lens,
                     ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs,
                     ffi::Buffer<ffi::F32> sinks, ffi::Result<ffi::Buffer<ffi::F32>> out,
                     float sm_scale, int64_t sliding_window, float soft_cap) {
  return attend(pool, q, kv, nullptr, block_tables, kv_lens, cu_q_lens, num_seqs, sinks, out,
                sm_scale, sliding_window, soft_cap);
}

ffi::Error AttentionQ(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kv,
                      ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::S32> block_tables,
                      ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> cu_q_lens,
                      ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::F32> sinks,
                      ffi::Result<ffi::Buffer<ffi::F32>> out, float sm_scale,
                      int64_t sliding_window, float soft_cap) {
  if (scales.element_count() * kv.dimensions()[3] != kv.element_count()) {
    return ffi::Error::InvalidArgument("paged attention: scales do not fit kv_pages");
  }
  return attend(pool, q, kv, scales.typed_data(), block_tables, kv_lens, cu_q_lens, num_seqs,
                sinks, out, sm_scale, sliding_window, soft_cap);
}

ffi::Error WriteAndAttend(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_new,
                          ffi::AnyBuffer v_new, ffi::AnyBuffer kv, ffi::Buffer<ffi::S32> slots,
                          ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> kv_lens,
                          ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs,
                          ffi::Buffer<ffi::F32> sinks, ffi::Result<ffi::Buffer<ffi::F32>> out,
                          ffi::Result<ffi::AnyBuffer> kv_out, float sm_scale,
                          int64_t sliding_window, float soft_cap) {
  ffi::Error err = WriteKv(k_new, v_new, slots, kv, *kv_out, nullptr, nullptr);
  if (err.failure()) return err;
  return attend(pool, q, *kv_out, nullptr, block_tables, kv_lens, cu_q_lens, num_seqs, sinks,
                out, sm_scale, sliding_window, soft_cap);
}

ffi::Error WriteAndAttendQ(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_new,
                           ffi::AnyBuffer v_new, ffi::AnyBuffer kv, ffi::Buffer<ffi::F32> scales,
                           ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> block_tables,
                           ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> cu_q_lens,
                           ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::F32> sinks,
                           ffi::Result<ffi::Buffer<ffi::F32>> out,
                           ffi::Result<ffi::AnyBuffer> kv_out,
                           ffi::Result<ffi::Buffer<ffi::F32>> scales_out, float sm_scale,
                           int64_t sliding_window, float soft_cap) {
  if (scales.element_count() * kv.dimensions()[3] != kv.element_count() ||
      scales_out->element_count() != scales.element_count()) {
    return ffi::Error::InvalidArgument("paged attention: scales do not fit kv_pages");
  }
  ffi::Error err = WriteKv(k_new, v_new, slots, kv, *kv_out, &scales, &*scales_out);
  if (err.failure()) return err;
  return attend(pool, q, *kv_out, scales_out->typed_data(), block_tables, kv_lens, cu_q_lens,
                num_seqs, sinks, out, sm_scale, sliding_window, soft_cap);
}

}  // namespace

// Arguments of every handler: q, [k_new, v_new,] kv_pages, [scales,] [slot_mapping,]
// block_tables, kv_lens, cu_q_lens, num_seqs, sinks (f32[Hq] or f32[0]: none); results:
// out[, kv_pages[, scales]] (aliased).
#define JAXSERVE_ATTENTION_ATTRS                                        \
  .Attr<float>("sm_scale").Attr<int64_t>("sliding_window").Attr<float>("soft_cap")
#define JAXSERVE_METADATA_ARGS                                          \
  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()            \
      .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()        \
      .Arg<ffi::Buffer<ffi::F32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxservePagedAttentionCpu, Attention,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::AnyBuffer>()
        JAXSERVE_METADATA_ARGS.Ret<ffi::Buffer<ffi::F32>>() JAXSERVE_ATTENTION_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxservePagedAttentionQuantCpu, AttentionQ,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::AnyBuffer>()
        .Arg<ffi::Buffer<ffi::F32>>()
        JAXSERVE_METADATA_ARGS.Ret<ffi::Buffer<ffi::F32>>() JAXSERVE_ATTENTION_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxservePagedAttentionWriteCpu, WriteAndAttend,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>()
        .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
        .Arg<ffi::Buffer<ffi::S32>>() JAXSERVE_METADATA_ARGS
        .Ret<ffi::Buffer<ffi::F32>>().Ret<ffi::AnyBuffer>() JAXSERVE_ATTENTION_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxservePagedAttentionWriteQuantCpu, WriteAndAttendQ,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>()
        .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
        .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::S32>>() JAXSERVE_METADATA_ARGS
        .Ret<ffi::Buffer<ffi::F32>>().Ret<ffi::AnyBuffer>().Ret<ffi::Buffer<ffi::F32>>()
            JAXSERVE_ATTENTION_ATTRS);

// Top-k / top-p cut-offs of the sampler on CPU, registered with XLA as an FFI custom call.
//
// Data flow (one call per sampled step; kernels_pallas/nucleus_cpu.py is the contract): the
// tempered logits x f32[S, V], k s32[S] (in [1, V]; V = off) and top_p f32[S] (>= 1 = off) ->
// out f32[S]: keep x >= out[r] in row r. out is the larger of the two cut-offs: the k-th
// largest value of the row, and the largest value t of the row whose mass above it,
// sum(exp(x - max) for x >= t), reaches top_p * sum(exp(x - max)) (the smallest value of the
// shortest descending prefix reaching top_p); -inf for a cut-off that is off. Exact: the
// answer is a value present in the row, ties at it are kept.
//
// Why a kernel. XLA:CPU has no cheap way to the top-p cut-off of a wide nucleus: a sort of
// f32[32, 49152] costs ~250 ms, a bounded TopK grows with its width (2.4 ms at 64, 13 ms at
// 1,024), and the exact bisection over the float order (jaxserve/device/nucleus.py, the jnp
// path TPU and GPU keep) makes ~13 passes over the row, ~10 ms at 32 flat rows. Here each row
// is a select over its own value range: one pass finds the maximum, one writes the
// probabilities exp(x - max) (a branch-free exp the compiler vectorises), one puts every entry
// in one of 4096 buckets of [max - 32, max] (lower values, -inf included, in the last),
// histograms count (top-k) and mass (top-p, in double), and walks the histogram from the top
// to the bucket where the running total reaches the need; the entries of that bucket alone
// (collected in one more pass) are bucketed again over their own [min, max], and so on until
// at most 128 are left, which are sorted and walked. A bucket of 1/128 of a logit holds tens
// of entries of a real row, so one refinement usually ends it: ~30 us a row of 49k. Rows are
// spread over XLA's intra-op thread pool.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "block_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// exp(d) for d <= 0 by the attention kernel's vectorisable exp (block_math.h); d below -87
// (e.g. -inf: a masked token) gives exactly 0, so masked entries carry no mass.
inline float exp_nonpositive(float d) {
  const float e = jaxserve_cpu_attention::exp_nonpos(d);
  return d < -87.0f ? 0.0f : e;
}

// The row's maximum over 16 independent lanes: a single running max is a loop-carried
// dependence the compiler will not vectorise without -ffast-math.
inline float row_max(const float* x, int64_t V) {
  constexpr int kLanes = 16;
  float lane[kLanes];
  for (int j = 0; j < kLanes; ++j) lane[j] = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  for (; i + kLanes <= V; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) lane[j] = x[i + j] > lane[j] ? x[i + j] : lane[j];
  }
  float m = -std::numeric_limits<float>::infinity();
  for (int j = 0; j < kLanes; ++j) m = lane[j] > m ? lane[j] : m;
  for (; i < V; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

constexpr int kBuckets = 4096;
constexpr float kSpan = 32.0f;  // level 1 spans [max - 32, max]; lower values: the last bucket
constexpr size_t kSortAt = 128;  // a set of entries this small is sorted and walked
constexpr int kMaxDepth = 8;     // levels before a set is sorted whatever its size

struct Entry {
  float value;
  float weight;
};

// Bucket of value v below hi at `scale` buckets per unit: floor((hi - v) * scale), clamped
// to the last bucket (v = -inf included). Monotone in v, so buckets hold runs of the order.
inline int bucket_of(float v, float hi, float scale) {
  float t = (hi - v) * scale;
  t = t < static_cast<float>(kBuckets - 1) ? t : static_cast<float>(kBuckets - 1);
  return static_cast<int>(t);
}

// The bucket of hist (walked from bucket 0, the highest values, with `*above` already
// counted) in which the running total first reaches `need`; *above becomes the total before
// it. Buckets of no weight are skipped, so the answer holds an entry of positive weight;
// where rounding leaves `need` above the whole total, the last bucket of positive weight.
int find_bucket(const double* hist, double need, double* above) {
  int last = -1;
  double acc = *above, before_last = acc;
  for (int b = 0; b < kBuckets; ++b) {
    if (hist[b] <= 0) continue;
    if (acc + hist[b] >= need) {
      *above = acc;
      return b;
    }
    before_last = acc;
    acc += hist[b];
    last = b;
  }
  *above = before_last;
  return last;
}

// Sorted descending and walked: the first value whose running weight reaches need (rounding
// aside, the last of positive weight).
float walk_sorted(std::vector<Entry>& set, double need, double above) {
  std::sort(set.begin(), set.end(),
            [](const Entry& a, const Entry& b) { return a.value > b.value; });
  float last = set.empty() ? -std::numeric_limits<float>::infinity() : set.front().value;
  for (const Entry& e : set) {
    if (e.weight <= 0) continue;
    above += e.weight;
    last = e.value;
    if (above >= need) return e.value;
  }
  return last;
}

// The largest value t of `set` with above + sum(weight of entries >= t) >= need: histogram
// the set's value range into kBuckets, keep the bucket where the total crosses, repeat.
// Each level keeps a strict subset (the range is the set's own [min, max], so its max and
// its min fall in different buckets), and ties end it (an empty range).
float select_set(std::vector<Entry>& set, double need, double above, int depth) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  float hi = -kInf, lo = kInf;
  for (const Entry& e : set) {
    hi = std::max(hi, e.value);
    if (e.value > -kInf) lo = std::min(lo, e.value);
  }
  if (hi == -kInf) return -kInf;  // only masked entries are left
  const float scale = static_cast<float>(kBuckets) / (hi - lo);
  if (set.size() <= kSortAt || depth >= kMaxDepth || !(hi > lo) || !std::isfinite(scale)) {
    return walk_sorted(set, need, above);
  }
  std::vector<double> hist(kBuckets);
  for (const Entry& e : set) hist[bucket_of(e.value, hi, scale)] += e.weight;
  const int b = find_bucket(hist.data(), need, &above);
  if (b < 0) return hi;
  std::vector<Entry> next;
  for (const Entry& e : set) {
    if (bucket_of(e.value, hi, scale) == b) next.push_back(e);
  }
  return select_set(next, need, above, depth + 1);
}

struct Scratch {
  std::vector<float> p;          // f32[V] exp(x - max)
  std::vector<uint16_t> bucket;  // u16[V] each entry's level-1 bucket
};

// One row: the cut-off (keep x >= it) of top-k k and top-p top_p.
float row_cutoff(const float* x, int64_t V, int64_t k, float top_p, Scratch& s) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const bool want_k = k >= 1 && k < V, want_p = top_p < 1.0f;
  if (!want_k && !want_p) return -kInf;
  const float m = row_max(x, V);
  if (m == -kInf) return -kInf;
  const float scale = kBuckets / kSpan;
  s.bucket.resize(V);
  uint16_t* bucket = s.bucket.data();
  for (int64_t i = 0; i < V; ++i) bucket[i] = static_cast<uint16_t>(bucket_of(x[i], m, scale));
  std::vector<double> mass(want_p ? kBuckets : 0), count(want_k ? kBuckets : 0);
  double need_p = 0.0, above_p = 0.0, above_k = 0.0;
  int bp = -1, bk = -1;
  if (want_p) {
    s.p.resize(V);
    float* p = s.p.data();
    for (int64_t i = 0; i < V; ++i) p[i] = exp_nonpositive(x[i] - m);
    for (int64_t i = 0; i < V; ++i) mass[bucket[i]] += p[i];
    double total = 0.0;
    for (int b = 0; b < kBuckets; ++b) total += mass[b];
    need_p = static_cast<double>(top_p) * total;
    if (need_p <= 0.0) return m;  // top_p <= 0: only the maximum (and its ties)
    bp = find_bucket(mass.data(), need_p, &above_p);
  }
  if (want_k) {
    for (int64_t i = 0; i < V; ++i) count[bucket[i]] += 1.0;
    bk = find_bucket(count.data(), static_cast<double>(k), &above_k);
  }
  std::vector<Entry> in_p, in_k;
  for (int64_t i = 0; i < V; ++i) {
    if (bucket[i] == bp) in_p.push_back({x[i], s.p[i]});
    if (bucket[i] == bk) in_k.push_back({x[i], 1.0f});
  }
  float cut = -kInf;
  if (bp >= 0) cut = select_set(in_p, need_p, above_p, 1);
  if (bk >= 0) cut = std::max(cut, select_set(in_k, static_cast<double>(k), above_k, 1));
  return cut;
}

ffi::Error NucleusCutoffs(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                          ffi::Buffer<ffi::S32> k, ffi::Buffer<ffi::F32> top_p,
                          ffi::ResultBuffer<ffi::F32> out) {
  const auto dims = x.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("x must be f32[S, V]");
  const int64_t S = dims[0], V = dims[1];
  if (k.element_count() != S || top_p.element_count() != S || out->element_count() != S) {
    return ffi::Error::InvalidArgument("k, top_p and the output must hold one value per row");
  }
  struct Work {
    const float* x;
    const int32_t* k;
    const float* top_p;
    float* out;
    int64_t S, V;
    std::atomic<int64_t> next{0}, done{0};
    void drain() {
      thread_local Scratch scratch;
      for (int64_t r; (r = next.fetch_add(1)) < S;) {
        out[r] = row_cutoff(x + r * V, V, k[r], top_p[r], scratch);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto work = std::make_shared<Work>();
  work->x = x.typed_data();
  work->k = k.typed_data();
  work->top_p = top_p.typed_data();
  work->out = out->typed_data();
  work->S = S;
  work->V = V;
  // A single row runs on the calling thread: waking a helper costs more than it saves.
  const int64_t helpers = S * V < (int64_t{1} << 16)
                              ? 0 : std::min<int64_t>(pool.num_threads(), S) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->drain(); });
  work->drain();
  while (work->done.load(std::memory_order_acquire) < S) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxserveNucleusCutoffsCpu, NucleusCutoffs,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>()
        .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());

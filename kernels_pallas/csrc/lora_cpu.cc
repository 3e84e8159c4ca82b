// The multi-LoRA delta of one projection on CPU, one XLA FFI custom call
// (kernels_pallas/lora_cpu.py; the contract is kernels_pallas/lora.py's).
//
// Data flow: x f32[T, K], the whole stacks a W[L, S, K, R] and b W[L, S, R, N] (W float32 or
// bfloat16, read in place at layer `layer`, an s32 scalar), slots s32[T] -> y f32[T, N]:
//   y[t] = (x[t] @ a[layer, s]) @ b[layer, s]  with s = slots[t] in [1, S)
//   y[t] = 0                                   otherwise (slot 0: no adapter; and a slot
//                                              outside [0, S), as the masked XLA path does)
// accumulated in float32. A slot-0 row is a memset: no weight is read for it.
//
// Grouping (Punica's SGMV on a CPU): the rows are counting-sorted by slot, and each slot's
// rows are cut into jobs of up to kJobRows rows, so an adapter's A and B are read once per
// job (a decode step of 32 rows on 8 adapters: once per step) instead of once per row.
// A job is a shrink, u[rows, R] = x[rows] @ A (A [K, R]: row k is R contiguous values, so a
// k step is one R-wide vector per row: R = 16 is one zmm), then an expand, y[rows, cols] =
// u[rows] @ B[:, cols] (B [R, N]: row r is contiguous over the columns, the vectors).
//
// Memory, not FMAs, sets a decode step's pace: 4 rows an adapter make 4 FMAs per weight, and
// the 8 adapters' stacks of a bundled-model step (156 MB float32, 78 MB bfloat16; the L3 is
// 32 MB) come from DRAM every step. A job therefore fetches ahead (`Ahead`): the shrink
// prefetches A kPrefetchBytes ahead, and each job spreads over its inner loops the fetch of
// its own B (when nothing fetched it) and of the A and B of the job its worker runs next.
// Measured on 32 decode rows x 8 adapters, the bundled model's 7 projections x 30 layers
// (scripts/bench/bench_lora_step.py, interleaved in one process): 8.4 -> 6.7 ms a step with
// float32 stacks, 6.3 -> 4.2 ms with bfloat16, against shrink / expand as two barrier-
// separated phases without fetching ahead (this kernel before).
//
// bfloat16 stacks on a CPU with AVX512_BF16 (this file's avx512_vnni build) go through
// lora_bf16_dot.h: bfloat16 dot products, half the instructions (x and u rounded to bfloat16
// first). The job structure, its fetching and the column tail (N % 32) stay this file's.
//
// Threads (XLA's intra-op pool, the calling thread working too; pool_items.h):
//   - a call whose work (active rows x R x (K + N) FMAs) is under kParallelWork runs its
//     jobs on the calling thread, in order (each fetching the next; waking a helper costs
//     microseconds);
//   - jobs that share evenly (a multiple of the threads, or at least 4 a thread): one item a
//     job (run_items_ahead: a worker claims its next job before running the current one, so
//     it knows what to fetch);
//   - else (few, uneven jobs): the shrinks a job an item, then the expands split by blocks
//     of kColBlock columns, so one adapter's 20 rows still use both threads.
//
// Register tiles, vector loads and the fetching ahead: lora_tiles.h.
// Compiled once per instruction set with the dense kernels (cpu_build.py).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "pool_items.h"
#include "lora_tiles.h"
#include "lora_bf16_dot.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxserve_lora;  // lora_tiles.h

constexpr int64_t kJobRows = 16;       // rows per job: A / B read once per 16 rows of a slot
constexpr int64_t kColBlock = 256;     // columns of y per phase-2 item
constexpr int64_t kParallelWork = int64_t{1} << 18;

using jaxserve_cpu::run_items;  // pool_items.h
using jaxserve_cpu::run_items_ahead;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

struct Job {  // sorted rows [i0, i1) of slot s
  int64_t s, i0, i1;
};

template <ffi::DataType D>
ffi::Error LoraDelta(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<D> a,
                     ffi::Buffer<D> b, ffi::Buffer<ffi::S32> slots,
                     ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  using W = ffi::NativeType<D>;
  auto xd = x.dimensions(), ad = a.dimensions(), bd = b.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || ad.size() != 4 || bd.size() != 4 || yd.size() != 2 ||
      slots.dimensions().size() != 1) {
    return ffi::Error::InvalidArgument(
        "lora_delta: x must be [T, K], a [L, S, K, R], b [L, S, R, N], slots [T], y [T, N]");
  }
  const int64_t T = xd[0], K = xd[1], L = ad[0], S = ad[1], R = ad[3], N = bd[3];
  if (ad[2] != K || bd[0] != L || bd[1] != S || bd[2] != R || yd[0] != T || yd[1] != N ||
      slots.dimensions()[0] != T) {
    return ffi::Error::InvalidArgument("lora_delta: x / a / b / slots / y shapes disagree");
  }
  if (layer.element_count() != 1) {
    return ffi::Error::InvalidArgument("lora_delta: layer must be one s32");
  }
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("lora_delta: layer out of range");
  const float* xs = x.typed_data();
  const int32_t* sl = slots.typed_data();
  float* ys = y->typed_data();

  // Counting sort of the adapter rows by slot; the others are zeroed here, nothing read.
  std::vector<int64_t> start(S + 1, 0);
  for (int64_t t = 0; t < T; ++t) {
    if (sl[t] > 0 && sl[t] < S) {
      ++start[sl[t] + 1];
    } else {
      std::memset(ys + t * N, 0, sizeof(float) * N);
    }
  }
  for (int64_t s = 1; s <= S; ++s) start[s] += start[s - 1];
  const int64_t active = start[S];
  if (active == 0 || N == 0) return ffi::Error::Success();
  std::vector<const float*> xrow(active);
  std::vector<float*> yrow(active);
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t t = 0; t < T; ++t) {
      if (sl[t] > 0 && sl[t] < S) {
        const int64_t i = fill[sl[t]]++;
        xrow[i] = xs + t * K;
        yrow[i] = ys + t * N;
      }
    }
  }
  std::vector<Job> jobs;
  for (int64_t s = 1; s < S; ++s) {
    for (int64_t i = start[s]; i < start[s + 1]; i += kJobRows) {
      jobs.push_back({s, i, std::min(start[s + 1], i + kJobRows)});
    }
  }
  const int64_t a_slot = K * R, b_slot = R * N;
  const W* abase = a.typed_data() + l * S * a_slot;
  const W* bbase = b.typed_data() + l * S * b_slot;
  std::unique_ptr<float[]> ubuf(new float[active * std::max<int64_t>(R, 1)]);
  float* u = ubuf.get();
  const Job* jb = jobs.data();
  const float* const* xr = xrow.data();
  float* const* yr = yrow.data();
  const bool parallel = active * R * (K + N) >= kParallelWork;

#if defined(JAXSERVE_BF16_DOT)
  // bfloat16 stacks as bfloat16 dot products where the CPU has them (lora_bf16_dot.h).
  const bool dot = std::is_same_v<W, uint16_t> && R % 16 == 0 &&
                   jaxserve_lora_bf16::cpu_has_bf16_dot();
  auto dot_job = [=](const Job& j, const W* A, const W* B, Ahead& next) {
    namespace bd = jaxserve_lora_bf16;
    const int64_t rows = j.i1 - j.i0, kp = (K + 1) / 2, rp = R / 2;
    std::unique_ptr<uint32_t[]> pairs(new uint32_t[rows * (kp + rp)]);
    const uint32_t* xp[kJobRows];
    const uint32_t* up[kJobRows];
    for (int64_t t = 0; t < rows; ++t) {
      uint32_t* xt = pairs.get() + t * kp;
      bd::to_pairs(xr[j.i0 + t], K, xt);
      xp[t] = xt;
    }
    const uint16_t* a16 = reinterpret_cast<const uint16_t*>(A);
    const uint16_t* b16 = reinterpret_cast<const uint16_t*>(B);
    for (int64_t t = 0; t < rows; t += kShrinkRows) {
      const int n = static_cast<int>(std::min<int64_t>(kShrinkRows, rows - t));
      bd::shrink_rows<kShrinkRows>(n, xp + t, K, a16, R, u + (j.i0 + t) * R, next);
    }
    for (int64_t t = 0; t < rows; ++t) {
      uint32_t* ut = pairs.get() + rows * kp + t * rp;
      bd::to_pairs(u + (j.i0 + t) * R, R, ut);
      up[t] = ut;
    }
    for (int64_t t = 0; t < rows; t += 4) {
      const int n = static_cast<int>(std::min<int64_t>(4, rows - t));
      const int64_t done = bd::expand(n, up + t, R, b16, N, yr + j.i0 + t, next);
      if (done < N) expand<W>(n, u + (j.i0 + t) * R, R, B, N, done, N, yr + j.i0 + t, next);
    }
  };
#endif
  // One job whole: shrink then expand, fetching (Ahead) the job's B when nothing fetched it
  // (`first`) and the `following` job's A and B (-1: none) while it computes.
  auto run_job = [=](int64_t i, int64_t following, bool first) {
    const Job& j = jb[i];
    const W* A = abase + j.s * a_slot;
    const W* B = bbase + j.s * b_slot;
    const int64_t rows = j.i1 - j.i0;
    Ahead next;
    if (first) {  // A's first lines now (the shrink fetches the rest ahead itself)
      const char* a0 = reinterpret_cast<const char*>(A);
      const int64_t bytes = std::min<int64_t>(kPrefetchBytes, a_slot * sizeof(W));
      for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(a0 + o);
      next.add(B, b_slot);
    }
    if (following >= 0) {
      next.add(abase + jb[following].s * a_slot, a_slot);
      next.add(bbase + jb[following].s * b_slot, b_slot);
    }
    // The job's inner-loop steps (shrink: K / streams a tile; expand: R a tile), over
    // which the lines are spread.
    const int64_t streams = std::max<int64_t>(1, kShrinkStreams / std::min<int64_t>(rows, kShrinkRows));
    const int64_t vecs = lanes<vw>() * kExpandVecs;
    const int64_t steps = ceil_div(rows, kShrinkRows) * ceil_div(R, lanes<vw>()) *
                              (K / streams + 1) +
                          ceil_div(rows, kExpandRows) * ceil_div(N, vecs) * R;
    next.per = ceil_div(next.lines(), std::max<int64_t>(steps, 1));
#if defined(JAXSERVE_BF16_DOT)
    if constexpr (std::is_same_v<W, uint16_t>) {
      if (dot) {  // its steps: shrink pairs of k, expand pairs of r (lora_bf16_dot.h)
        const int64_t dot_steps = ceil_div(rows, kShrinkRows) * (R / 16) * (K / 2 / streams + 1) +
                                  ceil_div(rows, 4) * ceil_div(N, 64) * (R / 2);
        next.per = ceil_div(next.lines(), std::max<int64_t>(dot_steps, 1));
        return dot_job(j, A, B, next);
      }
    }
#endif
    for (int64_t r = j.i0; r < j.i1; r += kShrinkRows) {
      const int n = static_cast<int>(std::min<int64_t>(kShrinkRows, j.i1 - r));
      shrink<W>(n, xr + r, K, A, R, u + r * R, next);
    }
    for (int64_t r = j.i0; r < j.i1; r += kExpandRows) {
      const int n = static_cast<int>(std::min<int64_t>(kExpandRows, j.i1 - r));
      expand<W>(n, u + r * R, R, B, N, 0, N, yr + r, next);
    }
  };
  const int64_t njobs = static_cast<int64_t>(jobs.size());
  if (!parallel) {
    for (int64_t i = 0; i < njobs; ++i) run_job(i, i + 1 < njobs ? i + 1 : -1, i == 0);
    return ffi::Error::Success();
  }
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  if (njobs % threads == 0 || njobs >= 4 * threads) {
    // Jobs enough to share evenly (a decode step's: one per adapter on 2 threads): one item
    // a job, no barrier between shrink and expand.
    run_items_ahead(pool, njobs, run_job);
    return ffi::Error::Success();
  }

  // Few jobs, unevenly many (one adapter's 20 rows: 2 jobs of 16 and 4 on 2 threads): the
  // shrink a job an item, then the expand split by columns as well.
  // Phase 1: u[rows] = x[rows] @ A[slot], one job per item.
  run_items(pool, njobs, true, [=](int64_t i) {
    const Job& j = jb[i];
    const W* A = abase + j.s * a_slot;
    for (int64_t r = j.i0; r < j.i1; r += kShrinkRows) {
      const int n = static_cast<int>(std::min<int64_t>(kShrinkRows, j.i1 - r));
      Ahead none;
      shrink<W>(n, xr + r, K, A, R, u + r * R, none);
    }
  });

  // Phase 2: y[rows, block] = u[rows] @ B[slot][:, block].
  const int64_t blocks = (N + kColBlock - 1) / kColBlock;
  run_items(pool, njobs * blocks, true, [=](int64_t i) {
    const Job& j = jb[i / blocks];
    const int64_t c0 = (i % blocks) * kColBlock, c1 = std::min(N, c0 + kColBlock);
    const W* B = bbase + j.s * b_slot;
    for (int64_t r = j.i0; r < j.i1; r += kExpandRows) {
      const int n = static_cast<int>(std::min<int64_t>(kExpandRows, j.i1 - r));
      Ahead none;
      expand<W>(n, u + r * R, R, B, N, c0, c1, yr + r, none);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

#define JAXSERVE_LORA_DELTA(NAME, T)                                           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, LoraDelta<T>,                            \
                                ffi::Ffi::Bind()                               \
                                    .Ctx<ffi::ThreadPool>()                    \
                                    .Arg<ffi::Buffer<ffi::F32>>() /* x */      \
                                    .Arg<ffi::Buffer<T>>()        /* a */      \
                                    .Arg<ffi::Buffer<T>>()        /* b */      \
                                    .Arg<ffi::Buffer<ffi::S32>>() /* slots */  \
                                    .Arg<ffi::Buffer<ffi::S32>>() /* layer */  \
                                    .Ret<ffi::Buffer<ffi::F32>>() /* y */);

JAXSERVE_LORA_DELTA(JaxserveLoraDeltaF32Cpu, ffi::F32)
JAXSERVE_LORA_DELTA(JaxserveLoraDeltaBf16Cpu, ffi::BF16)

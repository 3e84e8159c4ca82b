// write_kv's contract in place (kernels_pallas/common.py), for paged_attention_cpu.cc: each
// token's K/V row [Hkv, Dk] goes to its slot (rows 2h / 2h + 1 of the page), zero-padded to
// the pages' head dim; negative or out-of-range slots are dropped. Float pages take the rows
// as they are (same dtype); int8 / fp8 pages take them quantized (kv_quant.h: f32 / bf16 /
// f16 rows -> values + one f32 scale per row, into the scales at the row's index / D). The
// outputs alias the inputs (input_output_aliases), so only T * Hkv rows move.
// Included by paged_attention_cpu.cc after its `ffi` namespace alias.
#pragma once

namespace jaxserve_cpu_attention {

// One source row [n] (f32 / bf16 / f16) as f32.
inline void row_to_f32(const void* src, ffi::DataType dt, int64_t n, float* dst) {
  for (int64_t d = 0; d < n; ++d) {
    switch (dt) {
      case ffi::DataType::F32: dst[d] = static_cast<const float*>(src)[d]; break;
      case ffi::DataType::BF16: dst[d] = load(static_cast<const Bf16*>(src), d); break;
      default: dst[d] = load(static_cast<const F16*>(src), d); break;
    }
  }
}

// sc_in / sc_out: the row scales of int8 / fp8 pages; nullptr for float pages.
inline ffi::Error WriteKv(ffi::AnyBuffer k_new, ffi::AnyBuffer v_new, ffi::Buffer<ffi::S32> slots,
                          ffi::AnyBuffer kv_in, ffi::AnyBuffer kv_out,
                          const ffi::Buffer<ffi::F32>* sc_in, ffi::Buffer<ffi::F32>* sc_out) {
  auto nd = k_new.dimensions(), kd = kv_out.dimensions();
  const ffi::DataType pt = kv_out.element_type(), rt = k_new.element_type();
  const bool quantized = sc_out != nullptr;
  const bool row_ok = quantized ? (rt == ffi::DataType::F32 || rt == ffi::DataType::BF16 ||
                                   rt == ffi::DataType::F16) &&
                                      (pt == ffi::DataType::S8 || pt == ffi::DataType::F8E4M3FN)
                                : rt == pt;
  if (nd.size() != 3 || kd.size() != 4 || nd[1] * 2 != kd[1] || nd[2] > kd[3] || !row_ok ||
      v_new.element_type() != rt || v_new.element_count() != k_new.element_count() ||
      slots.element_count() != static_cast<size_t>(nd[0])) {
    return ffi::Error::InvalidArgument(
        "paged attention: k_new / v_new / slot_mapping do not fit kv_pages");
  }
  if (kv_in.untyped_data() != kv_out.untyped_data()) {  // not aliased after all: keep the pages
    std::memcpy(kv_out.untyped_data(), kv_in.untyped_data(), kv_in.size_bytes());
  }
  if (quantized && sc_in->typed_data() != sc_out->typed_data()) {
    std::memcpy(sc_out->typed_data(), sc_in->typed_data(), sc_in->size_bytes());
  }
  const int64_t T = nd[0], Hkv = nd[1], Dk = nd[2], P = kd[0], ps = kd[2], D = kd[3];
  const size_t esz = ffi::ByteWidth(pt), rsz = ffi::ByteWidth(rt);
  char* pages = static_cast<char*>(kv_out.untyped_data());
  const char* src[2] = {static_cast<const char*>(k_new.untyped_data()),
                        static_cast<const char*>(v_new.untyped_data())};
  std::vector<float> row(quantized ? Dk : 0);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = slots.typed_data()[t];
    if (slot < 0 || slot / ps >= P) continue;
    for (int64_t h = 0; h < Hkv; ++h) {
      for (int kvi = 0; kvi < 2; ++kvi) {
        const int64_t r = ((slot / ps) * 2 * Hkv + 2 * h + kvi) * ps + slot % ps;  // row index
        char* dst = pages + r * D * esz;
        const char* from = src[kvi] + (t * Hkv + h) * Dk * rsz;
        if (!quantized) {
          std::memcpy(dst, from, Dk * esz);
          std::memset(dst + Dk * esz, 0, (D - Dk) * esz);
          continue;
        }
        row_to_f32(from, rt, Dk, row.data());
        sc_out->typed_data()[r] =
            pt == ffi::DataType::S8
                ? quantize_row(row.data(), Dk, D, reinterpret_cast<I8*>(dst))
                : quantize_row(row.data(), Dk, D, reinterpret_cast<F8*>(dst));
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace jaxserve_cpu_attention

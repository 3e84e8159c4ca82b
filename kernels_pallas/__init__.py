"""jaxserve.kernels_pallas: ragged paged attention kernels (Pallas) and their jnp reference.

One call serves a whole mixed engine step: T scheduled tokens of up to S sequences laid end
to end (prefill chunks and single decode tokens alike), each attending causally to its own
context through a block table of shared KV pages.

    write_kv(kv_pages, k_new, v_new, md.slot_mapping) -> kv_pages   exact scatter, in place if
                                                                     the caller donates pages
    ragged_paged_attention(q, kv_pages, md, sm_scale=...) -> out    reads the written pages
    write_kv_and_attend(q, k_new, v_new, kv_pages, md, ...)          both (one call on CPU)

Quantized KV (int8 / float8_e4m3fn pages): ``QuantizedKV(pages, scales)`` goes wherever the
float page array goes; write_kv quantizes, every implementation dequantizes on the fly.

Modules: common (metadata, page layout ``[num_pages, 2*Hkv, page_size, D]`` with K/V
interleaved on axis 1, input checks, write_kv), tiling (ragged batch -> fixed-shape query
tiles), reference (pure jnp; the oracle, and the CPU attention where no C++ compiler is
found), cpu (C++ kernel through XLA's FFI; cpu_build compiles csrc/ on first use), tpu (Mosaic
TPU kernel; tpu_plan its trace-time decisions and contract), gpu (Mosaic GPU kernel: gpu the
wrapper, gpu_kernel the body, gpu_plan its sizing and contract), selector (picks one from
platform, config and the kernels' contracts). Beside the
attention: dense_cpu, the models' projections on CPU over panel-packed weights (C++, FFI);
grouped_matmul (+ _tpu Mosaic, _gpu Triton), the MoE experts' grouped matmul: contract,
tile metadata, jnp reference (imported by models/moe_block.py directly).
This package imports nothing else from jaxserve.
"""

from .common import (MASK_VALUE, QUANT_MAX, TRASH_PAGE, AttentionMetadata, KernelGeometry,
                     KVPages, QuantizedKV, dequantize, init_kv_pages, is_quantized_dtype,
                     kv_pages_shape, padded_head_dim, quantize_rows, write_kv)
from .reference import ragged_paged_attention_reference
from .selector import (IMPLEMENTATIONS, page_head_dim, ragged_paged_attention, select_impl,
                       write_kv_and_attend)

# The kernels themselves (cpu/tpu/gpu.ragged_paged_attention_*) are
# imported lazily by the selector so a host only loads the Pallas backend it can run.
__all__ = [
    "IMPLEMENTATIONS", "KVPages", "KernelGeometry", "MASK_VALUE", "QUANT_MAX", "QuantizedKV",
    "TRASH_PAGE", "AttentionMetadata", "dequantize", "init_kv_pages", "is_quantized_dtype",
    "kv_pages_shape", "padded_head_dim", "page_head_dim", "quantize_rows", "ragged_paged_attention",
    "ragged_paged_attention_reference", "select_impl", "write_kv", "write_kv_and_attend",
]

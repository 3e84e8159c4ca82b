"""The order test modules are handed to pytest-xdist workers in: the heaviest first.

scripts/test.sh runs the suite in two workers, a whole module per worker at a time
(`--dist loadfile`), each worker taking the next module in the queue when it finishes one.
Left to itself xdist queues the modules with the most tests first (its default
`--loadscope-reorder`), and the modules that take longest hold a few tests each (an
8-device subprocess, a served two-process job, the soak, a `jaxserve serve` process): they
came last, and one worker ran the last of them while the other sat idle. Longest first
(the LPT rule) bounds that idle tail by the shortest modules instead. scripts/test.sh passes
`--no-loadscope-reorder` so that this order is the queue's.

`HEAVY_MODULES` ranks the modules that take 20 s or more of one worker's time in the
default tier, heaviest first (from a `--durations=0` run: setup + call + teardown summed per
module; the first to need a shared session asset, such as the converted bundled model,
pays for it). The ranks need not be exact: a module missing here only runs later, among the
light ones in collection order. tests/test_suite_order.py checks each named module exists.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

HEAVY_MODULES: tuple[str, ...] = (
    "tests/engine/test_engine.py",
    "tests/kernels/test_attention_cpu.py",
    "tests/models/test_moe.py",
    "tests/kernels/test_kv_quant.py",
    "tests/models/test_chat_template.py",
    "tests/cli/test_bench.py",
    "tests/kernels/test_attention_kernels.py",
    "tests/device/test_quant_engine.py",
    "tests/device/test_tensor_parallel.py",
    "tests/device/test_expert_parallel.py",
    "tests/device/test_export_accelerators.py",
    "tests/serving/test_data_parallel.py",
    "tests/device/test_multihost.py",
    "tests/serving/test_spec_draft_build.py",
    "tests/serving/test_spec_eagle3_build.py",
    "tests/kernels/test_attention_reference.py",
    "tests/device/test_sampler.py",
    "tests/models/test_gemma_gguf.py",
    "tests/models/test_gemma4_gguf.py",
    "tests/serving/test_build_quantization.py",
    "tests/models/test_compressed_tensors.py",
    "tests/models/test_bundled_model.py",
    "tests/models/test_gemma4.py",
    "tests/models/test_gemma.py",
    "tests/scripts/test_soak.py",
    "tests/device/test_kv_quant_engine.py",
    "tests/models/test_sharded_loading.py",
    "tests/server/test_server_lifecycle.py",
    "tests/kernels/test_attention_tpu_hardening.py",
    "tests/engine/test_speculation_model.py",
    "tests/server/test_speculation_server.py",
    "tests/device/test_export_spec.py",
    "tests/kernels/test_attention_gpu_hardening.py",
    "tests/serving/test_llm_api.py",
    "tests/models/test_gguf_loader.py",
    "tests/server/test_openai_tools.py",
    "tests/engine/test_structured_output.py",
    "tests/cli/test_batch_job.py",
    "tests/models/test_generate.py",
    "tests/models/test_model_parity.py",
    "tests/kernels/test_dense_cpu.py",
)


def module_path(item: pytest.Item) -> str:
    """The item's module as a path relative to the rootdir ('tests/engine/test_engine.py'),
    the form xdist's loadfile scope and HEAVY_MODULES use."""
    return item.nodeid.split("::", 1)[0]


def heaviest_first(items: Sequence[pytest.Item],
                   heavy: Sequence[str] = HEAVY_MODULES) -> list[pytest.Item]:
    """`items` with the modules of `heavy` first, in its order, then every other module in
    collection order; a module's own tests keep their order (a stable sort), and so do its
    fixtures' scopes."""
    rank = {path: i for i, path in enumerate(heavy)}
    return sorted(items, key=lambda item: rank.get(module_path(item), len(rank)))

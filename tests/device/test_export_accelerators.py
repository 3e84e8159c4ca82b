"""The accelerator paths lowered on CPU: `jax.export` for platforms that are not present.

`jax.export.export(jitted, platforms=["tpu"])` (or `["cuda"]`) traces and lowers a function
for that platform on this machine, running the Pallas -> Mosaic TPU and Pallas -> Mosaic GPU
lowering and every trace-time check, so shape, layout and API breakage in the kernels or the
engine's step shows up here without a device. Exported, for both platforms:
  - both Pallas kernels at realistic shapes (dtypes, head dims, GQA, page sizes, decode /
    prefill / mixed step shapes, sliding window, soft cap);
  - the engine's compiled step exactly as `ModelRunner` jits it (`forward_jit`: embed,
    layers, KV write, attention, LM head; `sample_jit`) for every bucket `plan_engine` makes,
    for a Llama-3-8B-shaped and a Qwen3-shaped config (abstract weights: ShapeDtypeStructs,
    nothing allocated), with `attention_impl="auto"` resolved as on that platform, and under
    tensor parallelism over an abstract 8-device mesh; the 8B shape with Gemma 3's
    interleaved sliding-window / global layers (per-layer specs: window, rope base, soft-cap);
    and the Gemma family's own step at Gemma 3 1B's and 4B's shapes (GeGLU, sandwich norms,
    qk-norm, the embedding scale, head_dim 256, the 1B's single KV head, the two rope bases),
    and Gemma 4's on TPU (local heads of 256 inside global heads of 512, K = V; the CUDA
    kernel stops at heads of 256, so there Gemma 4 is served by the reference attention);
    and Qwen3-30B-A3B's MoE step, at TP 1 and under tensor parallelism (its experts' three
    grouped matmuls the Pallas grouped matmul: Mosaic TPU / Triton, no ragged dot).
Quantized KV pages (int8 / float8_e4m3fn with f32 scales): both kernels at decode and prefill
shapes, and the whole step with an int8 cache (page_size 32, which 8-bit pages need on both),
at TP 1 and TP 8.
Each exported module must hold the platform's kernel custom call, once per layer body (the
layers of one spec run in a scan), and the jnp reference attention must never be traced (the `no_reference`
fixture makes any call to it fail the test).
The default tier exports three buckets per (model, platform) and lowers each kernel case,
model and quantization for one of the two platforms; JAXSERVE_RUN_SLOW=1 exports every bucket
for both.
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, NamedSharding

from support.tiers import grid

from jaxserve.config import EngineConfig
from jaxserve.device import model_runner as mr
from jaxserve.engine.batch import bitmask_words
from jaxserve.engine.sizing import plan_engine
from jaxserve.kernels_pallas import (AttentionMetadata, KernelGeometry, QuantizedKV,
                                     padded_head_dim, select_impl)
from jaxserve.kernels_pallas import selector
from jaxserve.kernels_pallas.selector import ragged_paged_attention
from jaxserve.models import families, placement, shapes
from jaxserve.models.config import ModelConfig, RopeScaling
from jaxserve.models.llama import LlamaParams
from jaxserve.models.packing import LINEAR_FIELDS
from jaxserve.models.quant import QuantizedWeight
from jaxserve.models.paged import kv_cache_shape

PLATFORMS = ("tpu", "cuda")
KERNEL_CALL = {"tpu": "tpu_custom_call", "cuda": "mosaic_gpu_v2"}
# The MoE grouped matmul's kernel: Mosaic TPU (the attention's custom call) or Triton (a call
# jax.export keeps no compatibility promise for, so the check is waived for it by name).
TRITON_CALL = "__gpu$xla.gpu.triton"
EXPORT_CHECKS = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
ALL_BUCKETS = os.environ.get("JAXSERVE_RUN_SLOW") == "1"
SDS = jax.ShapeDtypeStruct


def custom_calls(exported: jax.export.Exported) -> list[str]:
    return re.findall(r"custom_call @(\w+)", exported.mlir_module())


def assert_kernel_only(exported: jax.export.Exported, platform: str, count: int) -> None:
    calls = custom_calls(exported)
    assert calls.count(KERNEL_CALL[platform]) == count, calls


def vocabulary_selections(module: str, vocab: int) -> tuple[list[str], list[int], int]:
    """What an exported module does to select over a vocabulary axis of size `vocab`: the
    functions holding a `stablehlo.sort` of a ...x{vocab} operand (other than the reference
    decompositions of XLA's TopK, `chlo.top_k.impl*`, which a backend replaces by its own
    TopK), the k of each `chlo.top_k` over it, and the number of ApproxTopK calls over it."""
    sorts, ks, approx = [], [], 0
    for func in re.split(r"\n\s*func\.func ", module):
        name = re.match(r"(?:private |public )?@([\w.]+)", func)
        name = name.group(1) if name else "<module>"
        in_sort = False  # a sort's operand types follow its comparator region: "}) : (...)"
        for line in func.splitlines():
            in_sort = in_sort or "stablehlo.sort" in line
            if in_sort and re.match(r"\s*\}\) : \(", line):
                in_sort = False
                if f"x{vocab}x" in line and not name.startswith("chlo.top_k.impl"):
                    sorts.append(name)
            if f"x{vocab}x" not in line:
                continue
            if '"chlo.top_k"' in line:
                ks.append(int(re.search(r"k = (\d+)", line).group(1)))
            if "@ApproxTopK" in line:
                approx += 1
    return sorts, ks, approx


def assert_no_vocabulary_sort(exported: jax.export.Exported, platform: str, vocab: int) -> None:
    """The sampler's top-k / top-p never sorts the vocabulary: bounded top-k (the cut-off
    candidates, the logprobs) only, and on TPU no exact top-k but the logprobs' (approx_max_k
    for the candidates)."""
    from jaxserve.device.nucleus import CANDIDATES
    from jaxserve.engine.sampling_params import MAX_LOGPROBS

    sorts, ks, approx = vocabulary_selections(exported.mlir_module(), vocab)
    assert not sorts, sorts
    allowed = {MAX_LOGPROBS} if platform == "tpu" else {MAX_LOGPROBS, CANDIDATES}
    assert ks and set(ks) <= allowed, ks
    assert (approx > 0) == (platform == "tpu"), approx


@pytest.fixture(autouse=True)
def no_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The accelerator path may not fall back to the jnp reference attention."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the jnp reference attention was traced on an accelerator path")

    monkeypatch.setattr(selector, "ragged_paged_attention_reference", refuse)


# --------------------------------------------------------------------------- kernels
def metadata(num_tokens: int, num_seqs: int, max_pages: int) -> AttentionMetadata:
    i32 = jnp.int32
    return AttentionMetadata(slot_mapping=SDS((num_tokens,), i32),
                             block_tables=SDS((num_seqs, max_pages), i32),
                             kv_lens=SDS((num_seqs,), i32), cu_q_lens=SDS((num_seqs + 1,), i32),
                             num_seqs=SDS((1,), i32))


# (dtype, head_dim, q heads, kv heads, page size, tokens, seqs, window, soft cap): decode
# (tokens = seqs), prefill (few seqs, many tokens) and mixed shapes; GQA 1 / 4 / 8.
KERNEL_CASES = [
    ("bfloat16", 128, 32, 8, 16, 64, 64, None, None),      # Llama-3-8B decode, GQA 4
    ("bfloat16", 128, 32, 8, 32, 2048, 4, None, None),     # its prefill
    ("bfloat16", 128, 32, 32, 64, 512, 32, None, None),    # Llama-2 MHA, mixed, GQA 1
    ("float32", 128, 64, 8, 16, 256, 16, None, None),      # f32 pages, GQA 8
    ("bfloat16", 64, 16, 2, 16, 128, 128, None, None),     # head dim 64, GQA 8, decode
    ("bfloat16", 256, 16, 4, 32, 512, 8, None, 50.0),      # head dim 256, Gemma-style soft cap
    ("bfloat16", 128, 32, 8, 16, 384, 24, 4096, None),     # Mistral sliding window, mixed
    ("float32", 64, 8, 8, 64, 64, 8, 128, 30.0),           # window + cap together
    ("bfloat16", 80, 16, 4, 128, 256, 16, None, None),     # head dim 80 padded, 128-key pages
    ("float32", 256, 16, 8, 32, 512, 8, None, 50.0),       # issue #29: Gemma's head dim, f32
]


def alternating(cases: list[tuple], reason: str) -> list:
    """Every case x both platforms; the default tier lowers each case for one platform,
    alternating (so each platform gets half the cases), the slow tier the other half."""
    ids = ["-".join(map(str, c)) for c in cases]
    axes = [list(zip(ids, cases)), [(p, p) for p in PLATFORMS]]
    default = {f"{i}-{PLATFORMS[n % 2]}" for n, i in enumerate(ids)}
    return grid(axes, default, reason)


@pytest.mark.parametrize("case,platform", alternating(
    KERNEL_CASES, "each kernel case for the other platform too"))
def test_kernel_lowers_for_platform(platform: str, case: tuple) -> None:
    dtype, d, hq, hkv, ps, tokens, seqs, window, cap = case
    impl = select_impl("auto", platform)
    assert impl == {"tpu": "pallas_tpu", "cuda": "pallas_gpu"}[platform]
    max_pages = 4096 // ps
    num_pages = 1 + seqs * max_pages

    def attend(q, kv, md):  # noqa: ANN001, ANN202
        return ragged_paged_attention(q, kv, md, sm_scale=d ** -0.5, sliding_window=window,
                                      soft_cap=cap, impl=impl)

    exported = jax.export.export(jax.jit(attend), platforms=[platform])(
        SDS((tokens, hq, d), jnp.dtype(dtype)),
        SDS((num_pages, 2 * hkv, ps, padded_head_dim(d)), jnp.dtype(dtype)),
        metadata(tokens, seqs, max_pages))
    assert exported.platforms == (platform,)
    assert_kernel_only(exported, platform, 1)


# (page dtype, q dtype, head_dim, q heads, kv heads, page size, tokens, seqs, window)
QUANT_KERNEL_CASES = [
    ("int8", "bfloat16", 128, 32, 8, 32, 64, 64, None),           # decode, GQA 4
    ("float8_e4m3fn", "bfloat16", 128, 32, 8, 32, 512, 4, None),  # prefill
    ("int8", "float32", 64, 16, 2, 64, 128, 16, 256),              # f32 q, window
    ("float8_e4m3fn", "float16", 64, 8, 8, 32, 64, 8, None),       # MHA, f16 q
]


@pytest.mark.parametrize("case,platform", alternating(
    QUANT_KERNEL_CASES, "each quantized kernel case for the other platform too"))
def test_quantized_kernel_lowers_for_platform(platform: str, case: tuple) -> None:
    pages_dtype, dtype, d, hq, hkv, ps, tokens, seqs, window = case
    impl = select_impl("auto", platform)
    max_pages = 4096 // ps
    num_pages = 1 + seqs * max_pages

    def attend(q, kv, md):  # noqa: ANN001, ANN202
        return ragged_paged_attention(q, kv, md, sm_scale=d ** -0.5, sliding_window=window,
                                      impl=impl)

    shape = (num_pages, 2 * hkv, ps, padded_head_dim(d, 128 if platform == "tpu" else 64))
    kv = QuantizedKV(SDS(shape, jnp.dtype(pages_dtype)), SDS(shape[:3], jnp.float32))
    exported = jax.export.export(jax.jit(attend), platforms=[platform])(
        SDS((tokens, hq, d), jnp.dtype(dtype)), kv, metadata(tokens, seqs, max_pages))
    assert_kernel_only(exported, platform, 1)


# --------------------------------------------------------------------------- whole step
MODELS = {"llama3-8b": shapes.llama3_8b(), "qwen3-8b": shapes.qwen3_8b()}
ENGINE = EngineConfig(dtype="bfloat16", max_num_seqs=128, max_num_batched_tokens=1024,
                      max_model_len=4096, kv_cache_memory=8 << 30)


def exported_buckets(cfg: ModelConfig, tp: int, engine: EngineConfig = ENGINE
                     ) -> tuple[list[tuple[int, int]], object]:
    quantized = engine.kv_cache_dtype in ("int8", "fp8")
    plan = plan_engine(engine, cfg, 1 if quantized else 2, 1 << 40,
                       padded_head_dim(cfg.head_dim), 4 if quantized else 0)
    buckets = list(plan.batch_shape.buckets)
    if not ALL_BUCKETS:  # the smallest, a middle and the largest
        buckets = sorted({buckets[0], buckets[len(buckets) // 2], buckets[-1]})
    return buckets, plan


def abstract_quantized(params: LlamaParams, scheme: str, group: int | None,
                       act_fp8: bool = False) -> LlamaParams:
    """`params` with every dense layer weight an abstract QuantizedWeight of `scheme`."""
    def one(w: SDS) -> QuantizedWeight:
        *lead, k, n = w.shape
        groups = 1 if group is None else k // group
        values = {"int8": SDS((*lead, k, n), jnp.int8), "int4": SDS((*lead, k // 2, n), jnp.uint8),
                  "fp8": SDS((*lead, k, n), jnp.float8_e4m3fn)}[scheme]
        scales = SDS((*lead, groups, n), jnp.float32)
        return QuantizedWeight(values, scales, scales if scheme == "int4" else None, scheme,
                               act_fp8)

    layers = params.layers.replace(**{f: one(getattr(params.layers, f)) for f in LINEAR_FIELDS})
    return params.replace(layers=layers)


def abstract_kv(shape: tuple[int, ...], int8: bool, sharding=None):  # noqa: ANN001, ANN201
    """The KV cache's abstract value: bfloat16 pages, or int8 ones with their f32 scales."""
    if not int8:
        return SDS(shape, jnp.bfloat16, sharding=sharding)
    shardings = sharding or QuantizedKV(None, None)
    return QuantizedKV(SDS(shape, jnp.int8, sharding=shardings.pages),
                       SDS(shape[:3], jnp.float32, sharding=shardings.scales))


def export_step(cfg: ModelConfig, platform: str, tp: int, int8_kv: bool = False,
                quant: tuple[str, int | None, bool] | None = None,
                expert_parallel: bool = False) -> list[jax.export.Exported]:
    """Export `forward_jit` and `sample_jit` for the chosen buckets; asserts the kernel.
    `quant`: (scheme, group size, fp8 activations) of the dense weights, else bf16;
    `expert_parallel`: MoE experts split whole over the mesh. Returns the exported forward
    steps."""
    impl = select_impl("auto", platform)
    engine = ENGINE if not int8_kv else EngineConfig(
        dtype="bfloat16", max_num_seqs=128, max_num_batched_tokens=1024, max_model_len=4096,
        kv_cache_memory=8 << 30, kv_cache_dtype="int8", page_size=32)
    buckets, plan = exported_buckets(cfg, tp, engine)
    mesh = None
    run_cfg = cfg

    def weights(c: ModelConfig) -> families.ModelParams:
        params = families.family(c).abstract_params(c, jnp.bfloat16)
        return params if quant is None else abstract_quantized(params, *quant)

    params = weights(cfg)
    kv_shape = kv_cache_shape(cfg, plan.scheduler.num_pages, plan.scheduler.page_size,
                              padded_head_dim(cfg.head_dim))
    kv = abstract_kv(kv_shape, int8_kv)

    def replicated(a):  # noqa: ANN001, ANN202
        return SDS(a.shape, a.dtype)

    if tp > 1:
        mesh = AbstractMesh((tp,), (placement.MODEL_AXIS,))
        run_cfg = placement.tp_model_config(cfg, tp)
        run_params = weights(run_cfg)
        params = jax.tree.map(lambda a, spec: SDS(a.shape, a.dtype,
                                                  sharding=NamedSharding(mesh, spec)),
                              run_params, placement.param_specs(cfg, tp, run_params,
                                                                expert_parallel))
        kv_shape = kv_cache_shape(run_cfg, plan.scheduler.num_pages,
                                  plan.scheduler.page_size, padded_head_dim(cfg.head_dim))
        kv = abstract_kv(kv_shape, int8_kv, placement.kv_sharding(mesh, int8_kv))
        rep = placement.replicated(mesh)

        def replicated(a):  # noqa: ANN001, ANN202, F811
            return SDS(a.shape, a.dtype, sharding=rep)

    feed_len = max(s for _, s in plan.batch_shape.buckets)
    forwards = []
    for t, s in buckets:
        batch = mr.empty_batch(plan.batch_shape, t, s, penalties=False)
        inputs, sampling, _ = jax.tree.map(replicated, mr.to_step_inputs(batch))
        feed = replicated(SDS((feed_len,), jnp.int32))
        fwd = jax.export.export(mr.forward_jit, platforms=[platform],
                                disabled_checks=EXPORT_CHECKS)(
            params, kv, inputs, feed, cfg=run_cfg, attn_impl=impl, mesh=mesh,
            expert_parallel=expert_parallel)
        assert fwd.nr_devices == tp
        forwards.append(fwd)
        # One layer body per distinct layer spec, scanned over its layers: groups of equal
        # spec (Gemma 3's local runs) lower to one shared body, called once per group. On
        # TPU an MoE body also holds its grouped matmuls' Mosaic calls: two in the text
        # (gate and up, of one shape, call one lowered function; down its own).
        moe_specs = sum(1 for sp in set(cfg.layer_specs) if sp.moe is not None)
        assert_kernel_only(fwd, platform, len(set(cfg.layer_specs))
                           + (2 * moe_specs if platform == "tpu" else 0))
        out_avals = fwd.out_avals
        assert out_avals[0].shape == kv_shape
        assert out_avals[1 + int8_kv].shape == (s, cfg.vocab_size)  # after the scales
        logits = replicated(SDS((s, cfg.vocab_size), jnp.float32))
        # The grammar bitmask the runner always hands the sampler (its own when none is sent).
        sampling = sampling.with_mask(replicated(
            SDS((s, bitmask_words(cfg.vocab_size)), jnp.int32)))
        sample = jax.export.export(mr.sample_jit, platforms=[platform])(
            logits, sampling, apply_penalty=False, feed_len=feed_len)
        assert [a.shape for a in sample.out_avals][-1] == (feed_len,)
        assert_no_vocabulary_sort(sample, platform, cfg.vocab_size)
    return forwards


# Default tier: the Qwen3 step (qk-norm) for TPU and the Llama step for CUDA; the Llama step
# lowers for TPU in the tensor-parallel test below anyway.
@pytest.mark.parametrize("model,platform", grid(
    [[(m, m) for m in sorted(MODELS)], [(p, p) for p in PLATFORMS]],
    {"qwen3-8b-tpu", "llama3-8b-cuda"}, "each model's step for the other platform too"))
def test_engine_step_lowers_for_platform(model: str, platform: str) -> None:
    export_step(MODELS[model], platform, tp=1)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("penalties", [False, True])
def test_sampled_step_sorts_no_vocabulary(platform: str, penalties: bool) -> None:
    """The serving sampler (`sample_jit`, grammar bitmask and logit bias included) on the
    bundled model's vocabulary: no sort over it in the lowered step, and the check itself
    finds a vocabulary sort where one is traced (`jnp.sort`, as the sampler once did)."""
    from jaxserve.device.sampler import SamplingTensors
    from jaxserve.engine.batch_mask import TokenMaskRows
    from jaxserve.engine.batch_parts import LogitBiasRows, PenaltyRows, SamplingRows
    from jaxserve.engine.sampling_params import DEVICE_FIELDS

    S, V, P = 32, 49152, 64 if penalties else 0
    st = SamplingTensors(SamplingRows(SDS((S, len(DEVICE_FIELDS)), jnp.float32),
                                      SDS((S, 2), jnp.uint32)),
                         PenaltyRows(SDS((S, P), jnp.int32), SDS((S, P), jnp.bool_)),
                         LogitBiasRows(SDS((S, 8), jnp.int32), SDS((S, 8), jnp.float32)),
                         TokenMaskRows(SDS((S, V // 32), jnp.int32), SDS((S,), jnp.bool_)))
    logits = SDS((S, V), jnp.float32)
    sample = jax.export.export(mr.sample_jit, platforms=[platform])(
        logits, st, apply_penalty=penalties, feed_len=S)
    assert_no_vocabulary_sort(sample, platform, V)
    full = jax.export.export(jax.jit(lambda x: jnp.sort(x, axis=-1)), platforms=[platform])(
        logits)
    assert vocabulary_selections(full.mlir_module(), V)[0]


def gemma3_pattern(cfg: ModelConfig, num_layers: int = 12) -> ModelConfig:
    """`cfg` with Gemma 3's layer pattern as per-layer specs: five sliding-window layers
    (window 1024, rope base 10k) per global one (rope base 1M, linear scaling 8, and here a
    Gemma-2 style attention soft-cap so the kernels take it too)."""
    u = dataclasses.replace(cfg, num_layers=num_layers).uniform_spec()
    local = dataclasses.replace(u, sliding_window=1024, rope_theta=10000.0)
    glob = dataclasses.replace(u, rope_theta=1e6, rope_scaling=RopeScaling("linear", 8.0),
                               soft_cap=50.0)
    pattern = tuple(glob if i % 6 == 5 else local for i in range(num_layers))
    return dataclasses.replace(cfg, num_layers=num_layers, per_layer=pattern)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_mixed_layer_step_lowers_for_platform(platform: str) -> None:
    """Interleaved local / global layers (four groups of the 8B shape): one scan per group,
    each layer's window and soft-cap handed to the platform's kernel, one compiled step
    whose module holds one layer body per distinct spec (two), not per group."""
    cfg = gemma3_pattern(MODELS["llama3-8b"])
    assert len(cfg.layer_groups) == 4
    export_step(cfg, platform, tp=1)


GEMMA_MODELS = {"gemma3-1b": shapes.gemma3_1b(), "gemma3-4b": shapes.gemma3_4b()}


# Default tier: the 1B step (one KV head) for TPU and the 4B step (linear-scaled global rope)
# for CUDA; the other pairs with JAXSERVE_RUN_SLOW=1.
@pytest.mark.parametrize("model,platform", grid(
    [[(m, m) for m in sorted(GEMMA_MODELS)], [(p, p) for p in PLATFORMS]],
    {"gemma3-1b-tpu", "gemma3-4b-cuda"}, "each Gemma step for the other platform too"))
def test_gemma3_step_lowers_for_platform(model: str, platform: str) -> None:
    """The Gemma family's step (its own params pytree and layer blocks, not a Llama shape
    with Gemma's pattern) at a real Gemma 3 shape: one layer body per distinct spec (local,
    global) whatever the number of groups, the kernel's custom call in each, no vocabulary
    sort in the sampler over Gemma's 262k vocabulary."""
    cfg = GEMMA_MODELS[model]
    specs = cfg.layer_specs
    assert cfg.model_type == "gemma3_text" and cfg.head_dim == 256 and cfg.embed_scale
    assert all(s.post_norms and s.qk_norm and s.mlp_activation == "gelu_pytorch_tanh"
               for s in specs)
    window, kv_heads, factor = {"gemma3-1b": (512, 1, 1.0), "gemma3-4b": (1024, 4, 8.0)}[model]
    local, glob = specs[0], specs[5]
    assert (local.sliding_window, local.rope_theta, glob.sliding_window, glob.rope_theta) == (
        window, 1e4, None, 1e6)
    assert cfg.num_kv_heads == kv_heads and glob.rope_scaling.factor == factor
    assert local.rope_scaling.rope_type == "default"
    assert len(cfg.layer_groups) > len(set(specs)) == 2
    export_step(cfg, platform, tp=1)


# Gemma 4's text layout at a realistic width (not a released checkpoint's config): five local
# layers (heads of 256, 4 KV heads, window 1024) per global one (heads of 512, 1 KV head,
# K = V, proportional RoPE on a quarter of the pairs), the value norm and layer scalars.
GEMMA4_SHAPE = dict(architectures=["Gemma4ForCausalLM"], model_type="gemma4_text",
                    vocab_size=262144, hidden_size=2048, intermediate_size=8192,
                    num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=4,
                    head_dim=256, global_head_dim=512, num_global_key_value_heads=1,
                    attention_k_eq_v=True, sliding_window=1024, hidden_size_per_layer_input=0,
                    final_logit_softcapping=30.0)


@pytest.mark.parametrize("tp", [1, pytest.param(8, marks=pytest.mark.slow(
    reason="Gemma 4's TPU step at TP 8 too"))])
def test_gemma4_step_lowers_for_tpu(tp: int) -> None:
    """Gemma 4's step on TPU: the local layers computed at their own head size inside the
    pages' 512, the global layers' K = V and repeated KV head, one layer body per distinct
    spec."""
    cfg = families.config_from_hf(GEMMA4_SHAPE, "gemma4/config.json")
    local, glob = cfg.layer_specs[0], cfg.layer_specs[5]
    assert (cfg.head_dim, cfg.num_kv_heads, local.head_dim, glob.num_kv_heads) == (512, 4, 256, 1)
    assert glob.v_from_k and glob.rope_scaling.rope_type == "proportional"
    assert len(cfg.layer_groups) > len(set(cfg.layer_specs)) == 2
    export_step(cfg, "tpu", tp=tp)


def test_gemma4_pages_are_past_the_gpu_kernel() -> None:
    """On CUDA the Pallas kernel takes heads up to 256: Gemma 4's 512-wide pages are refused
    by its contract, so 'auto' serves them with the reference attention (with a warning;
    serving.build._attention_impl) and naming the kernel is an error that says why."""
    cfg = families.config_from_hf(GEMMA4_SHAPE, "gemma4/config.json")
    geometry = KernelGeometry(padded_head_dim(cfg.head_dim), 16, jnp.bfloat16,
                              cfg.num_heads // cfg.num_kv_heads)
    with pytest.raises(ValueError, match="head_dim"):
        select_impl("pallas_gpu", "cuda", geometry=geometry)


# Qwen3-30B-A3B's shape: 48 sparse layers of 128 experts of 768, top-8 renormalised, qk-norm.
QWEN3_MOE_SHAPE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                       vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                       head_dim=128, num_experts=128, num_experts_per_tok=8,
                       moe_intermediate_size=768, norm_topk_prob=True, rms_norm_eps=1e-6,
                       rope_theta=1e6, max_position_embeddings=40960,
                       tie_word_embeddings=False)


@pytest.mark.parametrize("platform,tp", grid(
    [[(p, p) for p in PLATFORMS], [("tp1", 1), ("tp4", 4)]],
    {"tpu-tp1", "cuda-tp1", "tpu-tp4"}, "the MoE step under TP 4 for CUDA too"))
def test_qwen3_moe_step_lowers_for_platform(platform: str, tp: int) -> None:
    """The MoE step on TPU / CUDA: the experts' three grouped matmuls are the Pallas grouped
    matmul (Mosaic TPU's `tpu_custom_call` beside the attention's, or Triton's call), in one
    layer body for the 48 sparse layers: neither XLA's ragged dot nor the CPU tile loop is
    what these platforms get (`moe.grouped_mlp` chooses where the step is lowered). Under
    tensor parallelism the kernels run per device inside a shard_map (no expert weight is
    gathered: the only all-reduces are the attention's and the experts' partial sums)."""
    cfg = families.config_from_hf(QWEN3_MOE_SHAPE, "qwen3-30b-a3b/config.json")
    assert len(cfg.layer_groups) == 1 and cfg.layer_specs[0].moe.num_experts == 128
    for fwd in export_step(cfg, platform, tp=tp):
        module = fwd.mlir_module()
        assert not re.findall(r"chlo\.ragged_dot", module), platform
        # three call sites of the kernel (gate, up, down); gate and up share one lowering
        kernel = {"tpu": "grouped_matmul_tpu", "cuda": "grouped_matmul_gpu"}[platform]
        assert len(re.findall(rf"call @{kernel}\w*\(", module)) == 3, platform
        if platform == "cuda":  # the TPU count is export_step's (attention + 2)
            assert module.count(f"custom_call @{TRITON_CALL}(") == 2
        gathers = [ln for ln in module.splitlines() if "all_gather" in ln]
        assert not [ln for ln in gathers if "128x" in ln], gathers  # no expert weight gathered


@pytest.mark.parametrize("platform", grid(
    [[(p, p) for p in PLATFORMS]], {"tpu"}, "the expert-parallel step for CUDA too"))
def test_qwen3_moe_step_lowers_under_expert_parallelism(platform: str) -> None:
    """Qwen3-30B-A3B's step with its 128 experts split whole over an abstract 8-device mesh
    (`--enable-expert-parallel`): inside the experts' shard_map each device's three calls
    of the Pallas grouped matmul take its 16 experts [16, in, out], and the step's one
    explicit collective is the experts' psum of [tokens, hidden] in the layer body (XLA adds
    attention's all-reduce when it partitions the step, after export;
    tests/device/test_expert_parallel.py counts those on CPU)."""
    cfg = families.config_from_hf(QWEN3_MOE_SHAPE, "qwen3-30b-a3b/config.json")
    kernel = {"tpu": "grouped_matmul_tpu", "cuda": "grouped_matmul_gpu"}[platform]
    for fwd in export_step(cfg, platform, tp=8, expert_parallel=True):
        module = fwd.mlir_module()
        calls = re.findall(rf"call @{kernel}\w*\(.*", module)
        assert len(calls) == 3, platform
        for shape in ("16x2048x768xbf16", "16x768x2048xbf16"):  # gate / up, down
            assert any(shape in c for c in calls), (shape, calls)
        psums = re.findall(r"stablehlo\.all_reduce.*\n?.*", module)
        assert len(re.findall(r"stablehlo\.all_reduce", module)) == 1, psums


@pytest.mark.parametrize("platform", PLATFORMS)
def test_engine_step_lowers_under_tensor_parallelism(platform: str) -> None:
    export_step(MODELS["llama3-8b"], platform, tp=8)


# Default tier: each quantization for one platform (int8 and fp8-w8a8 on CUDA, int4 and fp8
# on TPU); the other platform with JAXSERVE_RUN_SLOW=1.
@pytest.mark.parametrize("quant,platform", grid(
    [list(zip(["int8", "int4-g128", "fp8", "fp8-w8a8"],
              [("int8", None, False), ("int4", 128, False), ("fp8", None, False),
               ("fp8", None, True)])), [(p, p) for p in PLATFORMS]],
    {"int8-cuda", "int4-g128-tpu", "fp8-tpu", "fp8-w8a8-cuda"},
    "each quantized step for the other platform too"))
def test_quantized_step_lowers_for_platform(quant: tuple, platform: str) -> None:
    """Quantized dense weights (values converted and scaled inside the step; W8A8: fp8 x fp8
    dots) lower for TPU and CUDA, with the attention kernel still the only custom call."""
    export_step(MODELS[sorted(MODELS)[0]], platform, tp=1, quant=quant)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_quantized_step_lowers_under_tensor_parallelism(platform: str) -> None:
    """int4 values, scales and zeros of the 8B model split over 8 devices as the weights, with
    an int8 KV cache (pages and scales split by KV head)."""
    export_step(MODELS["llama3-8b"], platform, tp=8, int8_kv=True, quant=("int4", 128, False))


# Default tier: TP 1 on both platforms; the int8 cache at TP 8 lowers in the quantized
# tensor-parallel test above on both, and here with JAXSERVE_RUN_SLOW=1.
@pytest.mark.parametrize("platform,tp", grid(
    [[(p, p) for p in PLATFORMS], [("1", 1), ("8", 8)]], {"tpu-1", "cuda-1"},
    "the int8 cache with float weights at TP 8"))
def test_engine_step_with_int8_kv_lowers_for_platform(platform: str, tp: int) -> None:
    export_step(MODELS["llama3-8b"], platform, tp=tp, int8_kv=True)


# --------------------------------------------------------------------------- GPU selection
@pytest.mark.parametrize("cc,supported", [("9.0", True), ("8.9", False),
                                          ("8.0", False), ("10.0", False), ("12.0", False),
                                          ("", False)])
def test_gpu_kernel_only_on_hopper(cc: str, supported: bool) -> None:
    # WGMMA is Hopper-only: Blackwell (10.x, 12.x) and older GPUs get the jnp reference.
    assert selector.gpu_kernel_supported(cc) is supported


def test_gpu_kernel_pins_lane_lowering_semantics(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel is written for Lane semantics; jax 0.11 changed the default to Warpgroup,
    so the exported module must come from CompilerParams that name Lane explicitly."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    seen = []
    real = plgpu.CompilerParams

    def recording(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append(kwargs.get("lowering_semantics"))
        return real(*args, **kwargs)

    monkeypatch.setattr(plgpu, "CompilerParams", recording)
    jax.export.export(jax.jit(lambda q, kv, md: ragged_paged_attention(
        q, kv, md, sm_scale=0.1, impl="pallas_gpu")), platforms=["cuda"])(
        SDS((8, 8, 64), jnp.bfloat16), SDS((33, 4, 16, 64), jnp.bfloat16), metadata(8, 8, 4))
    assert seen == [plgpu.LoweringSemantics.Lane]

"""Quantized expert weights (`--quantization int8 / int4 / fp8` on an MoE model): the grouped
expert MLP over quantized stacks, the load-time quantizer, and the model against its oracles.

Oracles: numpy dequantization from the format's definition (W = q * s (+ z) per group of
input rows; int4 two rows per byte, the low nibble first; fp8 through ml_dtypes), the dense
all-experts reference (`moe.dense_moe_reference`) over those float weights, transformers
over the same dequantized weights, and the float model the weights were quantized from.
"""

from __future__ import annotations

import dataclasses
import pathlib
import types

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from support.numerics import gamma, logits_atol
from support.tiers import run_slow

from jaxserve.models import decoder, loading, moe
from jaxserve.models.config import MoESpec
from jaxserve.models.quant import QuantizedWeight, WeightQuant, quantize_weight, weight_bytes

SCHEMES = {"int8": None, "int4": 16, "fp8": None}  # scheme -> group size (None: per column)


def numpy_dequantize(q: QuantizedWeight) -> np.ndarray:
    v = np.asarray(q.values)
    if q.scheme == "int4":
        v = np.stack([v & 15, v >> 4], axis=-2).reshape(*v.shape[:-2], 2 * v.shape[-2],
                                                        v.shape[-1])
    w = v.astype(np.float32)
    g = w.shape[-2] // q.scales.shape[-2]
    w = w * np.repeat(np.asarray(q.scales), g, axis=-2)
    if q.zeros is not None:
        w = w + np.repeat(np.asarray(q.zeros), g, axis=-2)
    return w


def _layer(rng: np.random.Generator, scheme: str, group: int | None = None, hidden: int = 32,
           experts: int = 6, width: int = 32
           ) -> tuple[types.SimpleNamespace, types.SimpleNamespace]:
    """(quantized layer, the same layer with the stacks dequantized by numpy)."""
    f = np.float32
    stacks = {"we_gate": (experts, hidden, width), "we_up": (experts, hidden, width),
              "we_down": (experts, width, hidden)}
    q = types.SimpleNamespace(router=rng.standard_normal((hidden, experts)).astype(f))
    ref = types.SimpleNamespace(router=q.router)
    for name, shape in stacks.items():
        w = (0.3 * rng.standard_normal(shape)).astype(f)
        qw = quantize_weight(w, scheme, group)
        setattr(q, name, jax.tree.map(jnp.asarray, qw))
        setattr(ref, name, numpy_dequantize(qw))
    return q, ref


@pytest.mark.parametrize("scheme, group", [("int8", None), ("int8", 16), ("int4", 16),
                                           ("fp8", None)])
@pytest.mark.parametrize("backend", ["tiled", "ragged"])
def test_quantized_experts_equal_dense_reference(scheme: str, group: int | None,
                                                 backend: str) -> None:
    """Both grouped backends over quantized stacks equal the all-experts oracle over the
    numpy-dequantized weights. Bound: test_moe's (two orders of the same float32 sums, the
    routing identical) with three more roundings per term: the scale (and zero) applied on
    the quantized side, the numpy dequantization on the other."""
    rng = np.random.default_rng(7)
    spec = MoESpec(6, 2, 32, True)
    q, ref = _layer(rng, scheme, group)
    h = rng.standard_normal((13, 32)).astype(np.float32)
    mlp = {"tiled": moe.grouped_mlp_tiled, "ragged": moe.grouped_mlp_ragged}[backend]
    weights, experts = moe.route(spec, jnp.asarray(q.router), jnp.asarray(h))
    got = np.asarray(jax.jit(lambda h, g, u, d: moe.expert_mlp(
        h, weights, experts, g, u, d, mlp=mlp))(h, q.we_gate, q.we_up, q.we_down))
    want = np.asarray(moe.dense_moe_reference(spec, ref, h))
    mag = np.asarray(moe.dense_moe_reference(
        spec, types.SimpleNamespace(**{k: np.abs(v) for k, v in vars(ref).items()}), np.abs(h)))
    bound = 4 * gamma(32 + 32 + 2 + 4) * (mag + 1.0) * np.abs(mag).max()
    np.testing.assert_array_less(np.abs(got - want), bound + 1e-30)
    assert np.abs(want).max() > 1e-2


@pytest.mark.parametrize("scheme, group", [("int8", None), ("int4", 16)])
def test_pallas_kernel_over_quantized_stacks(scheme: str, group: int | None) -> None:
    """The TPU / CUDA path (`grouped_mlp_with` a Pallas grouped matmul; the Triton kernel
    interpreted here) over quantized stacks equals the ragged-dot path over the same stacks:
    per-column scales after the kernel's dot, grouped ones on the dequantized stack. The
    tolerance is test_grouped_matmul's for the float kernel (its tiles sum in other orders)."""
    import functools

    from jaxserve.kernels_pallas.grouped_matmul_gpu import grouped_matmul_gpu
    from jaxserve.models import moe_block

    rng = np.random.default_rng(4)
    q, _ = _layer(rng, scheme, group, hidden=64, experts=6, width=32)
    x = jnp.asarray(rng.standard_normal((12, 64)), jnp.float32)
    experts = jnp.asarray(np.argsort(-rng.standard_normal((12, 6)), axis=1)[:, :2], jnp.int32)
    weights = jnp.asarray(rng.random((12, 2)), jnp.float32)
    kernel = functools.partial(grouped_matmul_gpu, interpret=True)

    def through(mlp):  # noqa: ANN001, ANN202
        return np.asarray(moe.expert_mlp(x, weights, experts, q.we_gate, q.we_up, q.we_down,
                                         mlp))

    want = through(moe.grouped_mlp_ragged)
    got = through(functools.partial(moe_block.grouped_mlp_with, kernel))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert np.abs(want).max() > 1e-2


def test_tile_loop_converts_only_its_experts_weights() -> None:
    """The CPU tile loop never materialises a float copy of a whole quantized stack: no
    operation in its program yields a float [E, in, out] array (the ragged path, which does
    for grouped scales, is the contrast that shows the check can fail)."""
    q, _ = _layer(np.random.default_rng(1), "int4", 16)
    xs, sizes = jnp.ones((12, 32)), jnp.array([3, 0, 4, 5, 0, 0], jnp.int32)

    def float_stacks(fn) -> list:  # noqa: ANN001
        jaxpr = jax.make_jaxpr(fn)(xs, sizes, q.we_gate, q.we_up, q.we_down)
        found = []

        def walk(jx) -> None:  # noqa: ANN001
            for eqn in jx.eqns:
                found.extend(v.aval.shape for v in eqn.outvars
                             if getattr(v.aval, "shape", ()) == (6, 32, 32)
                             and jnp.issubdtype(v.aval.dtype, jnp.floating))
                for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                    walk(sub)
        walk(jaxpr.jaxpr)
        return found

    assert float_stacks(moe.grouped_mlp_tiled) == []
    assert float_stacks(moe.grouped_mlp_ragged) != []


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, object]:
    pytest.importorskip("torch")
    from support.hf_models import build_moe_model

    d = tmp_path_factory.mktemp("qwen3_moe")
    return d, build_moe_model("qwen3_moe", d)


def _logits(model: loading.LoadedModel, toks: np.ndarray) -> np.ndarray:
    lens = np.full(toks.shape[0], toks.shape[1], np.int32)
    return np.asarray(decoder.forward_jit(model.params, toks, lens, model.config))


# Largest change of one weight, relative to its column's (group's) largest magnitude:
# int8 half a step of amax / 127; int4 half a step of (max - min) / 15 <= 2 amax / 15;
# fp8 e4m3 half an ulp, 2^-4 relative.
REL_STEP = {"int8": 0.5 / 127, "int4": 1 / 15, "fp8": 2.0 ** -4}


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_quantized_model_against_oracles(qwen3_moe, scheme: str, tmp_path) -> None:  # noqa: ANN001
    """Qwen3-MoE loaded with --quantization `scheme`: the expert stacks are quantized (their
    bytes shrink by the layout's factor, measured from the arrays); the logits equal
    transformers' over the dequantized weights within the float32 bound; and stay within
    REL_STEP x 8 of the float model's range (a first-order perturbation: these 3-layer models
    amplify a relative weight change 1-4x, measured; a wrong scale or nibble moves logits by
    O(1))."""
    if not run_slow():  # the default tier runs quantized experts through test_moe_gguf's Q8_0
        pytest.skip("slow tier: quantized experts through the model (JAXSERVE_RUN_SLOW=1)")
    import torch
    import transformers

    d, _ = qwen3_moe
    f = loading.load_model(d, quant=WeightQuant("none"))
    q = loading.load_model(d, quant=WeightQuant(scheme, SCHEMES[scheme]))
    spec = next(s.moe for s in q.config.layer_specs if s.moe)
    k, n = q.config.hidden_size, spec.intermediate_size
    for field in moe.EXPERT_FIELDS:
        w = getattr(q.params.layers, field)
        assert isinstance(w, QuantizedWeight) and w.scheme == scheme and not w.act_fp8
        kk, nn = (k, n) if field != "we_down" else (n, k)
        g = SCHEMES[scheme] or kk
        per = kk * nn * (0.5 if scheme == "int4" else 1) + (kk // g) * nn * 4 * (
            2 if scheme == "int4" else 1)
        assert weight_bytes(getattr(f.params.layers, field)) / weight_bytes(w) == pytest.approx(
            4 * kk * nn / per)
    toks = np.random.default_rng(0).integers(3, 200, (2, 24)).astype(np.int32)
    got = _logits(q, toks)
    # transformers over the dequantized weights (numpy), exported as an HF checkpoint
    deq = jax.tree.map(lambda w: jnp.asarray(numpy_dequantize(w)) if isinstance(
        w, QuantizedWeight) else w, q.params, is_leaf=lambda w: isinstance(w, QuantizedWeight))
    if isinstance(q.params.embed, QuantizedWeight):  # stored transposed
        deq = dataclasses.replace(deq, embed=deq.embed.T)
    from jaxserve.models.hf_loader import save_hf_dir

    save_hf_dir(tmp_path / "deq", q.config, deq)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "deq",
                                                            dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(torch.tensor(toks, dtype=torch.long)).logits.numpy()
    assert np.max(np.abs(got - want)) <= logits_atol(q.config, deq, toks.shape[1])
    flt = _logits(f, toks)
    rel = np.max(np.abs(got - flt)) / np.max(np.abs(flt))
    print(f"{scheme}: max|quantized - float| / max|float| = {rel:.4f}")
    assert rel <= 8 * REL_STEP[scheme]


def test_llm_int8_greedy_close_to_float(qwen3_moe) -> None:  # noqa: ANN001
    """LLM(quantization="int8") on the tiny Qwen3-MoE (experts quantized, the engine's CPU
    path: dense linears packed for the C++ kernel, experts through the tile loop): greedy
    tokens agree with float32's on >= 70% of positions (3 prompts x 8 tokens), the
    test_quant_engine argument: ~97% per-token top-1 agreement measured teacher-forced
    (int8 over these weights), so a rollout diverges rarely; any real error gives ~1/vocab."""
    if not run_slow():
        pytest.skip("slow tier: two engines (JAXSERVE_RUN_SLOW=1)")
    from jaxserve import LLM, SamplingParams

    d, _ = qwen3_moe
    prompts = [[5, 6, 7, 8], [30, 31], list(range(40, 70))]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = {}
    for scheme in ("none", "int8"):
        with LLM(model=str(d), quantization=scheme, max_num_seqs=4, max_model_len=128,
                 max_num_batched_tokens=64, kv_cache_memory=1 << 20) as llm:
            outs[scheme] = [o.outputs[0].token_ids
                            for o in llm.generate(prompts, sp, use_tqdm=False)]
    same = sum(a == b for x, y in zip(outs["none"], outs["int8"]) for a, b in zip(x, y))
    assert same >= 0.7 * 24, outs


@pytest.mark.slow(reason="eager quantization of every field of a random model: ~30 s on CPU")
def test_loaded_model_requantized_and_back() -> None:
    """A model already loaded (device arrays: `serving/build.py` with another quantization)
    goes through the same quantizer: float experts -> int8 -> int4 (dequantized and
    requantized per layer) -> float again by `dequantized_params`, each within its step of
    the original (int8 then int4: the int4 half step of the int8 values, plus int8's)."""
    from jaxserve.models import families, qwen3_moe
    from jaxserve.models.quantized_params import dequantized_params, quantize_params

    cfg = families.config_from_hf(dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=64,
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32))
    params = jax.tree.map(np.asarray, qwen3_moe.init_random_params(
        cfg, jax.random.PRNGKey(0), scale=1.0))  # host arrays: no per-op dispatch here
    i8 = quantize_params(params, WeightQuant("int8"))
    i4 = quantize_params(i8, WeightQuant("int4", 16))
    back = dequantized_params(i4, jnp.float32)
    for field in moe.EXPERT_FIELDS:
        w = np.asarray(getattr(params.layers, field))
        q8, q4 = getattr(i8.layers, field), getattr(i4.layers, field)
        assert (q8.scheme, q4.scheme, q4.group_size) == ("int8", "int4", 16)
        assert q8.values.shape == w.shape and q4.values.shape[-2] * 2 == w.shape[-2]
        amax = np.abs(w).max(axis=-2, keepdims=True)
        got = np.asarray(getattr(back.layers, field))
        assert got.shape == w.shape
        assert np.all(np.abs(got - w) <= amax / 254 + 2 * amax / 30 + 1e-6)

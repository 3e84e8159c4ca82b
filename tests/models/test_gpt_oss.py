"""gpt-oss (`models/gpt_oss.py`) against transformers' GptOssForCausalLM, through jaxserve's
loader, engine and checkpoint formats.

The model: built at random by transformers (eager attention), 3 layers (sliding, full,
sliding; window 8, shorter than every prompt, so prompts span several windows), 4 experts
of 96 (gate_up [E, 64, 192]: no square stack hides a transposition), top-2, YaRN RoPE
(transformers' default for the family), swiglu_limit 1 so the clamps bite; weights scaled up,
norms, biases and sinks perturbed, routers sharpened (a near tie would let rounding, not the
code, decide the expert choice). Saved with `save_pretrained` (float32, interleaved gate_up).

Checked: the per-layer specs and the config round trip; full-sequence logits within 2e-5 of
transformers' (max |logit| ~3: float32 reorderings); each token's experts and weights equal
transformers' router on the same layer inputs; greedy decoding through `LLM(model=DIR)` (tiny
pages, chunked prefill, a prefix-cache hit) equal to transformers' greedy `generate`, with no
compile after warmup; YaRN's inverse frequencies and attention factor equal transformers';
MXFP4 experts (a checkpoint written here by the test's own encoder, bit fields decoded by
hand, not with the loader's table) dequantize at load to exactly the test's values; the Orbax
round trip and the HF export loading back in transformers; TP 2 equal to TP 1 (a subprocess
with 8 CPU devices, `moe_tp_worker.py`: slow tier).
"""

from __future__ import annotations

import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from support.hf_models import hf_greedy, save_tiny_tokenizer  # noqa: E402
from support.numerics import gamma  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.models import decoder, families, loading, moe  # noqa: E402
from jaxserve.models.blocks import rope_inv_freq  # noqa: E402
from jaxserve.models.config import ConfigError  # noqa: E402
from jaxserve.models.safetensors_io import read_safetensors, write_safetensors  # noqa: E402

PROMPTS = [[5, 17, 99, 3, 42, 8, 150, 7, 61, 33, 12, 190, 4], [9, 9, 100, 23, 77, 6],
           list(range(20, 39))]
CONFIG = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
              num_local_experts=4, num_experts_per_tok=2, sliding_window=8, swiglu_limit=1.0)


def build(out_dir: pathlib.Path, seed: int = 0):  # noqa: ANN201 - a transformers model
    config = transformers.GptOssConfig(**CONFIG)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("bias", "sinks")):
                p.add_(0.5 * torch.randn_like(p))
            elif "router.weight" in name:
                p.normal_(0.0, 0.5)
            else:
                p.mul_(5.0)
    model.save_pretrained(out_dir, safe_serialization=True)
    save_tiny_tokenizer(out_dir, CONFIG["vocab_size"])
    return model


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    d = tmp_path_factory.mktemp("gpt_oss")
    return d, build(d)


def _ours(model: loading.LoadedModel, tokens: np.ndarray) -> np.ndarray:
    return np.asarray(decoder.forward_jit(model.params, tokens,
                                          np.array([tokens.shape[1]], np.int32),
                                          cfg=model.config))


def _ref(model, tokens: np.ndarray) -> np.ndarray:  # noqa: ANN001
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def test_config_specs_and_rope(hf) -> None:  # noqa: ANN001
    d, model = hf
    cfg = loading.load_model(d).config
    specs = cfg.layer_specs
    assert cfg.model_type == "gpt_oss"
    assert [s.sliding_window for s in specs] == [8, None, 8]
    assert all(s.attention_sinks and s.attention_bias for s in specs)
    m = specs[0].moe
    assert (m.num_experts, m.top_k, m.intermediate_size, m.activation, m.swiglu_limit,
            m.router_bias, m.expert_bias) == (4, 2, 96, "swiglu_clamped", 1.0, True, True)
    assert families.config_from_hf(families.config_to_hf(cfg)) == cfg
    # YaRN: our inverse frequencies and attention factor against transformers' own.
    rot = model.model.rotary_emb
    rs = specs[0].rope_scaling
    assert rs.rope_type == "yarn" and rs.attention_factor == pytest.approx(rot.attention_scaling)
    np.testing.assert_allclose(rope_inv_freq(16, specs[0].rope_theta, rs),
                               rot.inv_freq.numpy(), rtol=1e-6)


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16.0, "beta_slow": 2.0,
     "truncate": True, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    {"rope_type": "yarn", "factor": 4.0, "truncate": False, "attention_factor": 1.5,
     "original_max_position_embeddings": 128, "rope_theta": 150000.0},
    {"rope_type": "yarn", "factor": 16.0, "mscale": 1.0, "mscale_all_dim": 0.5,
     "original_max_position_embeddings": 32, "rope_theta": 500000.0},
])
def test_yarn_equals_transformers(rope: dict) -> None:
    """YaRN's frequencies and attention factor (truncated ramp bounds or not, an explicit
    attention_factor, DeepSeek's mscale pair) equal transformers' _compute_yarn_parameters."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = transformers.GptOssConfig(**{**CONFIG, "head_dim": 32}, rope_parameters=rope)
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    d = {**hf_cfg.to_dict(), "architectures": ["GptOssForCausalLM"]}
    spec = families.config_from_hf(d).layer_specs[0]
    assert spec.rope_scaling.attention_factor == pytest.approx(factor, rel=1e-12)
    np.testing.assert_allclose(rope_inv_freq(32, spec.rope_theta, spec.rope_scaling),
                               inv.numpy(), rtol=2e-6)


def test_logits_match_transformers(hf) -> None:  # noqa: ANN001
    d, model = hf
    ours = loading.load_model(d)
    tokens = np.array([PROMPTS[2] + PROMPTS[0]], np.int32)
    want = _ref(model, tokens)
    err = float(np.max(np.abs(_ours(ours, tokens) - want)))
    assert np.abs(want).max() > 0.5 and err <= 2e-5, err


def test_router_choice_equals_transformers(hf) -> None:  # noqa: ANN001
    d, model = hf
    ours = loading.load_model(d)
    routers = [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("Router")]
    seen: dict[str, tuple] = {}

    def hook(name: str):  # noqa: ANN202
        def f(mod, args, out) -> None:  # noqa: ANN001
            seen[name] = (args[0].reshape(-1, args[0].shape[-1]).numpy(), out[1].numpy(),
                          out[2].numpy())
        return f

    handles = [m.register_forward_hook(hook(n)) for n, m in routers]
    try:
        _ref(model, np.array([PROMPTS[2]], np.int32))
    finally:
        for h in handles:
            h.remove()
    assert len(seen) == 3
    lay = ours.params.layers
    for name, (x, scores, idx) in seen.items():
        i = int(name.split(".layers.")[1].split(".")[0])
        spec = ours.config.layer_specs[i].moe
        w, e = moe.route(spec, lay.router[i], jnp.asarray(x), lay.router_bias[i])
        np.testing.assert_array_equal(np.asarray(e), idx, err_msg=name)
        np.testing.assert_allclose(np.asarray(w), scores, rtol=8 * gamma(4), atol=1e-7)


@pytest.mark.slow(reason="gpt-oss through LLM: compiles three layer groups (~1 min of CPU)")
def test_greedy_through_llm_equals_transformers_generate(hf) -> None:  # noqa: ANN001
    d, model = hf
    n = 6
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    with LLM(model=str(d), max_num_seqs=4, max_num_batched_tokens=8, page_size=4,
             max_model_len=64, kv_cache_memory=1 << 20, enable_prefix_caching=True) as llm:
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, n)
                                                          for p in PROMPTS]
        longer = PROMPTS[2] + [7, 8, 9]
        again = llm.generate([longer], sp, use_tqdm=False)[0]
        assert llm.engine.stats().compiles_after_warmup == 0
    assert again.num_cached_tokens >= 8
    assert again.outputs[0].token_ids == hf_greedy(model, longer, n)


# ------------------------------------------------------------------- the biased MoE block
@pytest.mark.parametrize("tokens", [1, 5, 16])
def test_biased_clamped_experts_equal_dense_reference(tokens: int) -> None:
    """Both backends of `moe_biased` (CPU tile loop, ragged dot) through `moe_mlp`'s sort /
    un-sort equal the dense all-experts oracle with the biases and the clamped SwiGLU
    (limit 0.5: most gates and ups clamp)."""
    import functools
    import types

    import jax

    from jaxserve.models import moe_biased
    from jaxserve.models.config import MoESpec

    rng = np.random.default_rng(tokens)
    e, hidden, width = 4, 16, 24
    spec = MoESpec(e, 2, width, True, activation="swiglu_clamped", swiglu_limit=0.5,
                   router_bias=True, expert_bias=True)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    lp = types.SimpleNamespace(router=f(hidden, e), router_bias=f(e), we_gate=f(e, hidden, width),
                               we_up=f(e, hidden, width), we_down=f(e, width, hidden),
                               be_gate=f(e, width), be_up=f(e, width), be_down=f(e, hidden))
    h = f(tokens, hidden)
    want = np.asarray(moe.dense_moe_reference(spec, lp, h))
    got_cpu = np.asarray(jax.jit(lambda h: moe.moe_mlp(spec, lp, h))(h))
    w, ex = moe.route(spec, lp.router, h, lp.router_bias)
    biases = (lp.be_gate, lp.be_up, lp.be_down)
    ragged = functools.partial(moe_biased._biased_ragged, spec)
    got_ragged = np.asarray(moe.expert_mlp(
        h, w, ex, lp.we_gate, lp.we_up, lp.we_down,
        lambda xs, sizes, g, u, d: ragged(xs, sizes, g, u, d, *biases)))
    scale = np.abs(want).max()
    assert scale > 1e-2
    for got in (got_cpu, got_ragged):
        np.testing.assert_allclose(got, want, atol=1e-5 * scale, rtol=1e-5)
    # The clamp is exercised: without it the oracle differs.
    loose = moe.dense_moe_reference(MoESpec(e, 2, width, True, activation="swiglu_clamped",
                                            swiglu_limit=1e9, router_bias=True,
                                            expert_bias=True), lp, h)
    assert np.abs(np.asarray(loose) - want).max() > 1e-2 * scale


def test_quantizing_experts_is_refused(hf) -> None:  # noqa: ANN001
    d, _ = hf
    with pytest.raises(ValueError, match=r"quantization='int8'.*layers.we_gate"):
        loading.load_model(d, quant=loading.WeightQuant("int8"))


# ---------------------------------------------------------------------------------- MXFP4
def _fp4_value(code: np.ndarray) -> np.ndarray:
    """e2m1 by its bit fields: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0."""
    sign = np.where(code & 8, -1.0, 1.0)
    e, m = (code >> 1) & 3, code & 1
    return sign * np.where(e == 0, 0.5 * m, (1 + 0.5 * m) * 2.0 ** (e - 1))


def _encode(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Float stack [E, in, out] -> (blocks u8[E, out, in/32, 16], scales u8[E, out, in/32]):
    per 32 inputs a power-of-two scale with max |x| / scale <= 6, each value's nearest code."""
    x = np.swapaxes(w, 1, 2).astype(np.float64)                     # [E, out, in]
    g = x.reshape(*x.shape[:2], -1, 32)
    amax = np.abs(g).max(-1)
    exp = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)).astype(np.int64)
    codes_all = np.arange(16)
    table = _fp4_value(codes_all)
    codes = np.abs(g[..., None] / 2.0 ** exp[..., None, None] - table).argmin(-1)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return blocks, (exp + 127).astype(np.uint8)


def _decode(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The test's own dequantization, back to the float stack [E, in, out]."""
    codes = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(*blocks.shape[:3], 32)
    vals = _fp4_value(codes) * 2.0 ** (scales.astype(np.int64) - 127)[..., None]
    return np.swapaxes(vals.reshape(*vals.shape[:2], -1), 1, 2)


def test_mxfp4_experts_dequantize_at_load(hf, tmp_path: pathlib.Path) -> None:  # noqa: ANN001
    d, _ = hf
    tensors = dict(read_safetensors(d / "model.safetensors"))
    want = {}
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        blocks, scales = _encode(np.asarray(tensors.pop(name), np.float32))
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        want[name] = _decode(blocks, scales)
    q = tmp_path / "mxfp4"
    q.mkdir()
    write_safetensors(q / "model.safetensors", tensors, {"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (q / "config.json").write_text(json.dumps(cfg))
    save_tiny_tokenizer(q, CONFIG["vocab_size"])
    got = loading.load_model(q)
    lay = got.params.layers
    for i in range(3):
        gate_up = want[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        np.testing.assert_array_equal(np.asarray(lay.we_gate[i]), gate_up[..., 0::2])
        np.testing.assert_array_equal(np.asarray(lay.we_up[i]), gate_up[..., 1::2])
        np.testing.assert_array_equal(np.asarray(lay.we_down[i]),
                                      want[f"model.layers.{i}.mlp.experts.down_proj"])
    # The encoder is a real quantization of the float experts (not, say, of zeros).
    flt = loading.load_model(d).params.layers.we_down
    err = np.abs(np.asarray(lay.we_down) - np.asarray(flt)).max()
    assert 0 < err <= 0.25 * np.abs(np.asarray(flt)).max()


# ------------------------------------------------------------------ formats, TP, refusals
@pytest.mark.slow(reason="gpt-oss Orbax round trip and HF export through transformers")
def test_orbax_round_trip_and_hf_export(hf, tmp_path: pathlib.Path) -> None:  # noqa: ANN001
    d, _ = hf
    src = loading.load_model(d)
    back = loading.load_model(loading.convert(d, tmp_path / "orbax", fmt="orbax"))
    assert back.format == "orbax" and back.config == src.config
    tokens = np.array([PROMPTS[2]], np.int32)
    np.testing.assert_array_equal(_ours(back, tokens), _ours(src, tokens))
    export = loading.convert(d, tmp_path / "hf", fmt="hf")
    assert loading.load_model(export).config == src.config
    ref = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32,
                                                            attn_implementation="eager")
    assert type(ref).__name__ == "GptOssForCausalLM"
    assert np.max(np.abs(_ours(src, tokens) - _ref(ref, tokens))) <= 2e-5


@pytest.mark.slow(reason="gpt-oss under TP 2 in an 8-device subprocess (~minutes of compiles)")
def test_tp2_equals_tp1() -> None:
    from support.engine_fixtures import run_device_worker

    rows = run_device_worker("moe_tp_worker.py", args=("gpt-oss",))
    base, got = rows
    assert (base["tp"], got["tp"]) == (1, 2) and got["compiles_after_warmup"] == 0
    for field, (device0, whole) in got["expert_bytes"].items():
        assert device0 * 2 == whole, field
    for rid, want in base["outputs"].items():
        have = got["outputs"][rid]
        assert have["tokens"] == want["tokens"], rid
        for a, b in zip(have["logprobs"], want["logprobs"]):
            assert next(iter(a)) == next(iter(b))
            assert abs(a[next(iter(a))] - b[next(iter(b))]) <= base["logprob_atol"]


@pytest.mark.parametrize("extra, match", [
    ({"layer_types": ["sliding_attention"]}, "layer_types="),
    ({"layer_types": ["sliding_attention", "chunked", "full_attention"]}, "layer_types="),
    ({"swiglu_limit": 0}, "swiglu_limit=0"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     "original_max_position_embeddings"),
])
def test_refused_configs_say_why(extra: dict, match: str) -> None:
    d = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", **CONFIG, **extra}
    with pytest.raises(ConfigError, match=match):
        families.config_from_hf(d)


def test_gguf_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="gpt-oss GGUF files are not supported yet"):
        families.family_for_gguf("gpt-oss", "model.gguf")

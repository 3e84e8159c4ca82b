"""The Gemma family (Gemma 2, Gemma 3 text) against transformers, through jaxserve's loader.

Each model is built at random by transformers (a 5-layer sliding / full pattern, a window of
4 tokens, shorter than every prompt, head_dim 32; soft-caps on for Gemma 2, a linear-scaled
global rope for Gemma 3), saved with `save_pretrained` and loaded the way
`jaxserve generate --model DIR` loads it (`loading.load_model`; the builders are
support.hf_models', shared with the engine tests). Checked: full-sequence logits (float32, and
bfloat16 weights against float32 transformers within the bound of their roundings), greedy
decoding through `LLM(model=DIR)` (paged KV, chunked prefill, tiny pages)
equal to transformers' greedy `generate`, the Orbax round trip of `jaxserve convert`, the HF
export loading back in transformers, the config forms older files use, and the names that
are refused with a reason.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from support.engine_fixtures import few_token_buckets  # noqa: E402
from support.hf_models import (GEMMA_ARCHS, GEMMA_WINDOW, build_gemma_model,  # noqa: E402
                               hf_greedy)
from support.numerics import logits_atol, params_logit_bound, unit_roundoff  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.models import decoder, families, loading  # noqa: E402
from jaxserve.models.config import ConfigError  # noqa: E402

WINDOW = GEMMA_WINDOW
PROMPTS = [[5, 17, 99, 3, 42, 8, 150, 7, 61, 33, 12, 190, 4], [9, 9, 100, 23, 77, 6],
           list(range(20, 39))]


@pytest.fixture(scope="module", params=sorted(GEMMA_ARCHS))
def hf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    d = tmp_path_factory.mktemp(request.param)
    return request.param, d, build_gemma_model(request.param, d)


def gemma_logits_atol(model: loading.LoadedModel, context: int) -> float:
    """support.numerics.logits_atol, which counts what a Gemma layer adds to a Llama-shaped
    chain (the sandwich norms, GeGLU's tanh, the soft-caps: `family_chain_extra`)."""
    return logits_atol(model.config, model.params, context)


def _ours(model: loading.LoadedModel, tokens: np.ndarray) -> np.ndarray:
    return np.asarray(decoder.forward_jit(model.params, tokens,
                                          np.array([tokens.shape[1]], np.int32),
                                          cfg=model.config))


def test_config_is_per_layer(hf) -> None:  # noqa: ANN001
    arch, d, _ = hf
    cfg = loading.load_model(d).config
    types = json.loads((d / "config.json").read_text())["layer_types"]
    assert [s.attention_type for s in cfg.layer_specs] == types
    assert {s.sliding_window for s in cfg.layer_specs} == {WINDOW, None}
    assert cfg.embed_scale == 8.0 and cfg.norm_offset == 1.0
    assert all(s.query_scale == 24 ** -0.5 and s.post_norms for s in cfg.layer_specs)
    if arch == "gemma2":
        assert cfg.final_soft_cap == 3.0 and {s.soft_cap for s in cfg.layer_specs} == {5.0}
    else:
        local, glob = cfg.layer_specs[0], cfg.layer_specs[2]
        assert (local.rope_theta, local.rope_scaling.rope_type) == (1e4, "default")
        assert (glob.rope_theta, glob.rope_scaling.factor) == (1e6, 2.0)
        assert all(s.qk_norm for s in cfg.layer_specs) and cfg.final_soft_cap is None


def test_logits_match_transformers(hf) -> None:  # noqa: ANN001
    arch, d, model = hf
    ours_model = loading.load_model(d)
    tokens = np.array([PROMPTS[0]], np.int32)  # 13 tokens: three windows
    with torch.no_grad():
        ref = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    err = float(np.max(np.abs(_ours(ours_model, tokens) - ref)))
    tol = gemma_logits_atol(ours_model, tokens.shape[1])
    print(f"{arch}: max|diff| = {err:.2e}, bound {tol:.2e}")
    assert err <= tol


def test_greedy_through_llm_equals_transformers_generate(hf) -> None:  # noqa: ANN001
    arch, d, model = hf
    n = 6

    def hf_greedy_n(p: list[int]) -> list[int]:
        return hf_greedy(model, p, n)

    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    # Tiny pages and a small step budget: windows span pages, prompts prefill in chunks;
    # one token bucket, the whole 8-token step (each bucket is a whole-model compile).
    with LLM(model=str(d), max_num_seqs=4, max_num_batched_tokens=8, page_size=4,
             max_model_len=64, kv_cache_memory=1 << 20, enable_prefix_caching=True,
             token_buckets=few_token_buckets(8)) as llm:
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy_n(p) for p in PROMPTS], arch
        # A later prompt sharing the third one's 19 tokens: its first pages come from the
        # prefix cache (the sliding layers' pages under the window of the hit's end slid out
        # but are still cached: the hit is served; tests/engine/test_window_kv_hf.py cuts one).
        longer = PROMPTS[2] + [7, 8, 9]
        again = llm.generate([longer], sp, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 16  # four full pages of the 19 shared tokens
    assert again.outputs[0].token_ids == hf_greedy_n(longer), arch


def test_orbax_round_trip_and_hf_export(hf, tmp_path: pathlib.Path) -> None:  # noqa: ANN001
    arch, d, model = hf
    src = loading.load_model(d)
    back = loading.load_model(loading.convert(d, tmp_path / "orbax", fmt="orbax"))
    assert back.format == "orbax" and back.config == src.config
    tokens = np.array([PROMPTS[2]], np.int32)
    np.testing.assert_array_equal(_ours(back, tokens), _ours(src, tokens))
    export = loading.convert(d, tmp_path / "hf", fmt="hf")
    assert loading.load_model(export).config == src.config
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    ref_model.config._attn_implementation = "eager"
    with torch.no_grad():
        ref = ref_model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    assert np.max(np.abs(_ours(src, tokens) - ref)) <= gemma_logits_atol(src, tokens.shape[1])


# Roundings to bfloat16 on one Gemma layer's path with bfloat16 weights (jaxserve keeps the
# activations in the weights' dtype; norms, rope and the softmax compute in float32 and round
# their outputs): the input norm's weight and output, q/k/v's weights and outputs, the
# qk-norms' weights and outputs, rope's output, the probabilities, the attention output,
# o_proj's weight and output, the post-attention norm's weight and output, the residual sum;
# the MLP norm's weight and output, gate/up's weights and outputs, GeGLU's output and
# product, down's weight and output, the post-MLP norm's weight and output, the residual sum.
BF16_ROUNDINGS_PER_LAYER = 24
# The embedding's weight, its scaled rows, the final norm's weight and output, the (tied) head.
BF16_ROUNDINGS_OUTSIDE = 5


def test_bfloat16_weights_against_transformers(hf) -> None:  # noqa: ANN001
    """Weights and activations in bfloat16 on CPU against transformers in float32: within the
    first-order bound of the roundings (each of u = 2^-8 relative on what follows it, times
    the logits' a priori magnitude) plus the float32 reordering bound, and the same argmax at
    most positions (a wrong norm offset or a dropped scale moves logits by O(1))."""
    arch, d, model = hf
    f32, b16 = loading.load_model(d), loading.load_model(d, dtype="bfloat16")
    assert str(b16.params.final_norm.dtype) == "bfloat16"
    tokens = np.array([PROMPTS[2]], np.int32)
    with torch.no_grad():
        ref = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()[0]
    got = _ours(b16, tokens)[0]
    assert got.dtype == np.float32
    cfg = f32.config
    tol = ((BF16_ROUNDINGS_PER_LAYER * cfg.num_layers + BF16_ROUNDINGS_OUTSIDE)
           * unit_roundoff("bfloat16") * params_logit_bound(f32.params, cfg.norm_offset)
           + logits_atol(cfg, f32.params, tokens.shape[1]))
    err = float(np.max(np.abs(got - ref)))
    print(f"{arch} bf16: max|diff| = {err:.2e}, bound {tol:.2e}, max|ref| {np.abs(ref).max():.2e}")
    assert err <= tol
    assert np.mean(np.argmax(got, -1) == np.argmax(ref, -1)) >= 0.8


def _dict(model_type: str, **extra: object) -> dict:
    arch = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}[model_type]
    return dict(architectures=[arch], model_type=model_type, vocab_size=64, hidden_size=32,
                intermediate_size=64, num_hidden_layers=7, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, **extra)


def test_older_config_forms() -> None:
    # Gemma 2 files from before `layer_types`: even layers slide; class defaults for caps.
    g2 = families.config_from_hf(_dict("gemma2", rope_theta=10000.0, sliding_window=8))
    assert [s.sliding_window for s in g2.layer_specs] == [8, None] * 3 + [8]
    assert g2.final_soft_cap == 30.0 and g2.layer_specs[0].soft_cap == 50.0
    # Gemma 3 files from before `rope_parameters`: `sliding_window_pattern`, the local base
    # in `rope_local_base_freq`, rope_scaling on the global layers only.
    g3 = families.config_from_hf(_dict(
        "gemma3_text", sliding_window_pattern=3, rope_theta=1e6, rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window=16))
    assert [s.attention_type for s in g3.layer_specs].count("full_attention") == 2
    local, glob = g3.layer_specs[0], g3.layer_specs[2]
    assert glob.sliding_window is None and glob.rope_scaling.factor == 8.0
    assert (local.rope_theta, local.rope_scaling.rope_type) == (1e4, "default")
    assert g3.tie_word_embeddings and g3.final_soft_cap is None


@pytest.mark.parametrize("d, match", [
    ({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]},
     "multimodal Gemma 3"),
    (_dict("gemma2", hidden_activation="gelu"), "hidden_activation"),
    (_dict("gemma3_text", use_bidirectional_attention=True), "bidirectional"),
    (_dict("gemma3_text", layer_types=["sliding_attention"]), "layer_types"),
])
def test_refused_configs_say_why(d: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        families.config_from_hf(d)

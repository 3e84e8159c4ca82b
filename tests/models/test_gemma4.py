"""Gemma 4 (text) against transformers, through jaxserve's loader.

Each model is built at random by transformers' `Gemma4ForCausalLM` (support.hf_models'
GEMMA4_ARCHS: a 5-layer sliding / full pattern, a window of 4 tokens, shorter than every
prompt; local heads of 16 and global heads of 32 with proportional RoPE; one model with K = V
and a single global KV head and a final soft-cap, one with separate V, biases and an untied
head, one with per-layer embeddings and its last two layers reusing earlier layers' K/V with
double-wide MLPs, as Gemma 4 E2B / E4B), saved with `save_pretrained` and loaded as `jaxserve generate --model DIR` loads it.
Checked: the per-layer specs the config maps to, full-sequence float32 logits within the
error bound of the two computations (support.numerics: summation order and transcendentals
along the chain, counting Gemma 4's value norm and layer scalar), greedy decoding through
`LLM(model=DIR)` (tiny pages, chunked prefill, a prefix-cache hit) equal to transformers'
greedy `generate`, the Orbax round trip of `jaxserve convert` and the HF export loading back
in transformers, the config forms (class defaults, `global_head_dim` without
`per_layer_config`), and the configs refused with the field named.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from support.engine_fixtures import few_token_buckets  # noqa: E402
from support.hf_models import GEMMA4_ARCHS, GEMMA_WINDOW, build_gemma_model, hf_greedy  # noqa: E402
from support.numerics import logits_atol  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.models import decoder, families, loading  # noqa: E402
from jaxserve.models.config import ConfigError  # noqa: E402
from jaxserve.models.kv_groups import kv_groups  # noqa: E402

PROMPTS = [[5, 17, 99, 3, 42, 8, 150, 7, 61, 33, 12, 190, 4], [9, 9, 100, 23, 77, 6],
           list(range(20, 39))]


@pytest.fixture(scope="module", params=sorted(GEMMA4_ARCHS))
def hf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    d = tmp_path_factory.mktemp(request.param)
    return request.param, d, build_gemma_model(request.param, d)


def _ours(model: loading.LoadedModel, tokens: np.ndarray) -> np.ndarray:
    return np.asarray(decoder.forward_jit(model.params, tokens,
                                          np.array([tokens.shape[1]], np.int32),
                                          cfg=model.config))


def _ref(model, tokens: np.ndarray) -> np.ndarray:  # noqa: ANN001 - a transformers model
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def test_config_is_per_layer(hf) -> None:  # noqa: ANN001
    arch, d, _ = hf
    cfg = loading.load_model(d).config
    types = json.loads((d / "config.json").read_text())["layer_types"]
    specs = cfg.layer_specs
    assert [s.attention_type for s in specs] == types
    assert cfg.model_type == "gemma4_text" and cfg.head_dim == 32 and cfg.num_kv_heads == 2
    assert cfg.embed_scale == 8.0 and cfg.norm_offset == 0.0
    assert all(s.query_scale == 1.0 and s.post_norms and s.qk_norm and s.v_norm
               and s.layer_scalar and s.norm_offset == 0.0 for s in specs)
    local, glob = specs[0], specs[types.index("full_attention")]
    assert (local.sliding_window, local.head_dim, local.rope_scaling.rope_type) == (
        GEMMA_WINDOW, 16, "default")
    assert glob.sliding_window is None and glob.head_dim is None  # the widest: the model's
    assert glob.rope_scaling.rope_type == "proportional"
    if arch == "gemma4_kv":
        assert glob.v_from_k and glob.num_kv_heads == 1 and not local.v_from_k
        assert cfg.final_soft_cap == 3.0 and cfg.tie_word_embeddings
    elif arch == "gemma4_ple":
        # Layers 4 (sliding) and 5 (full) reuse the K/V of layers 3 and 1, as transformers'
        # kv_sharing_modes; their MLPs are the model's (double) width, the others half.
        assert [(s.kv_store, s.kv_reuse) for s in specs] == [
            (None, None), (0, None), (None, None), (1, None), (None, 1), (None, 0)]
        assert cfg.intermediate_size == 192
        assert [s.intermediate_size for s in specs] == [96] * 4 + [None] * 2
        assert (cfg.per_layer_input_size, cfg.per_layer_vocab_size) == (8, cfg.vocab_size)
    else:
        assert not glob.v_from_k and glob.num_kv_heads is None
        assert glob.rope_theta == 1e5 and glob.rope_scaling.partial_rotary_factor == 0.5
        assert cfg.attention_bias and not cfg.tie_word_embeddings


def test_kv_shared_layers_hold_no_pages_of_their_own(hf) -> None:  # noqa: ANN001
    """A layer reusing an earlier layer's K/V reads that layer's pages (same KV group and
    slot): the KV array holds pages for the storing layers only."""
    arch, d, _ = hf
    cfg = loading.load_model(d).config
    groups = kv_groups(cfg)
    owners = [i for i, s in enumerate(cfg.layer_specs) if s.kv_reuse is None]
    where = list(zip(groups.layer_groups, groups.layer_slots))
    assert len({where[i] for i in owners}) == len(owners)  # the others: one slot each
    store = {s.kv_store: i for i, s in enumerate(cfg.layer_specs) if s.kv_store is not None}
    for i, s in enumerate(cfg.layer_specs):
        if s.kv_reuse is not None:
            assert where[i] == where[store[s.kv_reuse]], (arch, i)
    windows = [cfg.layer_specs[i].sliding_window for i in owners]
    # every group's slots, padding included, cover the owners and nothing more than needed
    assert groups.slots == min(windows.count(w) for w in set(windows))
    if arch == "gemma4_ple":
        # 6 layers, 2 of them reusing: 1 global and 3 sliding owners, so 1 slot per page id
        # and a block table per owner (2 slots if the reusing layers held pages)
        assert (groups.slots, groups.windows) == (1, (None,) + (GEMMA_WINDOW,) * 3)


def test_logits_match_transformers(hf) -> None:  # noqa: ANN001
    arch, d, model = hf
    ours = loading.load_model(d)
    tokens = np.array([PROMPTS[0]], np.int32)  # 13 tokens: three windows
    err = float(np.max(np.abs(_ours(ours, tokens) - _ref(model, tokens))))
    tol = logits_atol(ours.config, ours.params, tokens.shape[1])
    print(f"{arch}: max|diff| = {err:.2e}, bound {tol:.2e}")
    assert err <= tol


def test_greedy_through_llm_equals_transformers_generate(hf) -> None:  # noqa: ANN001
    arch, d, model = hf
    n = 6
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    # Tiny pages and a small step budget: windows span pages, prompts prefill in chunks;
    # one token bucket, the whole 8-token step (each bucket is a whole-model compile).
    with LLM(model=str(d), max_num_seqs=4, max_num_batched_tokens=8, page_size=4,
             max_model_len=64, kv_cache_memory=1 << 20, enable_prefix_caching=True,
             token_buckets=few_token_buckets(8)) as llm:
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, n)
                                                          for p in PROMPTS], arch
        # A later prompt sharing the third one's 19 tokens: its first pages come from the
        # prefix cache.
        longer = PROMPTS[2] + [7, 8, 9]
        again = llm.generate([longer], sp, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 16  # four full pages of the 19 shared tokens
    assert again.outputs[0].token_ids == hf_greedy(model, longer, n), arch


def test_orbax_round_trip_and_hf_export(hf, tmp_path: pathlib.Path) -> None:  # noqa: ANN001
    """Orbax keeps the padded params and the config exactly; the HF export writes each
    layer at its own shape (no v_proj on K = V layers) and transformers loads it."""
    arch, d, _ = hf
    src = loading.load_model(d)
    back = loading.load_model(loading.convert(d, tmp_path / "orbax", fmt="orbax"))
    assert back.format == "orbax" and back.config == src.config
    tokens = np.array([PROMPTS[2]], np.int32)
    np.testing.assert_array_equal(_ours(back, tokens), _ours(src, tokens))
    export = loading.convert(d, tmp_path / "hf", fmt="hf")
    assert loading.load_model(export).config == src.config
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    ref_model.config._attn_implementation = "eager"
    assert type(ref_model).__name__ == "Gemma4ForCausalLM"
    err = np.max(np.abs(_ours(src, tokens) - _ref(ref_model, tokens)))
    assert err <= logits_atol(src.config, src.params, tokens.shape[1])


def _dict(**extra: object) -> dict:
    return dict(architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", vocab_size=64,
                hidden_size=32, intermediate_size=64, num_hidden_layers=7,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                hidden_size_per_layer_input=0, **extra)


def test_config_forms() -> None:
    # Class defaults: 5 sliding then 1 full, the last layer forced full (as transformers
    # does), global heads of 512, proportional RoPE on a quarter of them, window 512.
    c = families.config_from_hf(_dict())
    assert [s.attention_type for s in c.layer_specs] == (
        ["sliding_attention"] * 5 + ["full_attention"] * 2)
    assert c.head_dim == 512 and c.layer_specs[0].head_dim == 16
    glob = c.layer_specs[-1]
    assert (glob.rope_theta, glob.rope_scaling.partial_rotary_factor) == (1e6, 0.25)
    assert c.layer_specs[0].sliding_window == 512 and c.layer_specs[0].rope_theta == 1e4
    # Released files' form: global_head_dim / num_global_key_value_heads, no per_layer_config;
    # the global KV-head count applies only under attention_k_eq_v (transformers' gate).
    k = families.config_from_hf(_dict(global_head_dim=32, num_global_key_value_heads=1,
                                      attention_k_eq_v=True))
    assert (k.head_dim, k.num_kv_heads) == (32, 2)
    assert (k.layer_specs[-1].num_kv_heads, k.layer_specs[-1].v_from_k) == (1, True)
    no = families.config_from_hf(_dict(global_head_dim=32, num_global_key_value_heads=1))
    assert no.layer_specs[-1].num_kv_heads is None and not no.layer_specs[-1].v_from_k
    # Back through config_to_hf (per_layer_config) to the same config.
    assert families.config_from_hf(families.config_to_hf(k)) == k
    # use_double_wide_mlp widens only KV-shared layers: without them it changes nothing.
    assert families.config_from_hf(_dict(use_double_wide_mlp=True)) == c


@pytest.mark.parametrize("d, match", [
    ({"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"]},
     "multimodal Gemma 4"),
    (_dict(num_kv_shared_layers=7), "num_kv_shared_layers=7 must be below"),
    # Layers 0-4 slide, 5-6 are full: sharing 2 leaves no earlier full layer to take KV from.
    (_dict(num_kv_shared_layers=2), "no earlier layer of its type"),
    (_dict(enable_moe_block=True, num_experts=4, top_k_experts=2), "enable_moe_block=True"),
    (_dict(use_bidirectional_attention="all"), "use_bidirectional_attention='all'"),
    (_dict(hidden_activation="gelu"), "hidden_activation"),
    (_dict(per_layer_config={"6": {"intermediate_size": 8}}),
     r"per_layer_config\['6'\].intermediate_size"),
    (_dict(rope_parameters={"full_attention": {"rope_type": "dynamic", "rope_theta": 1e6}}),
     "rope_type='dynamic'"),
])
def test_refused_configs_say_why(d: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        families.config_from_hf(d)


def test_gemma4_gguf_is_served_by_this_family() -> None:
    """llama.cpp's gemma4 architecture maps here (test_gemma4_gguf loads such files)."""
    fam, model_type = families.family_for_gguf("gemma4", "model.gguf")
    assert fam.__name__.endswith(".gemma4") and model_type == "gemma4_text"

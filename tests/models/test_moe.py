"""The MoE block (`models/moe.py`) against its references, and the MoE families (Qwen3-MoE,
Qwen2-MoE, Mixtral) against transformers, through jaxserve's loader.

Block: the grouped matmul (`jax.lax.ragged_dot`) equals the per-row definition for routings
with empty groups, one-row groups, every row in one group and rows past the groups' sum
(zero); the sorted / un-sorted expert MLP equals the dense all-experts oracle, also with a
shared expert and without renormalisation. The bound: both sides sum the same float32
products in different orders (gamma of the reduction lengths, support.numerics), relative
to the sum of |terms|.

Families (the LLM and Orbax checks of Mixtral and Qwen2-MoE in the slow tier): each model
is built at random by transformers (support.hf_models' MOE_ARCHS: 4 experts, top-2;
Qwen3-MoE with a dense layer between two sparse ones and norm_topk_prob, Qwen2-MoE with
its shared expert and biases, Mixtral), saved with `save_pretrained`
(per-expert tensors) and loaded as `jaxserve generate --model DIR` loads it. Checked: the
per-layer specs, full-sequence float32 logits within the error bound of the two computations,
the experts each token selects (and their weights) equal transformers' router on the same
layer inputs, greedy decoding through `LLM(model=DIR)` (tiny pages, chunked prefill, a
prefix-cache hit) equal to transformers' greedy `generate`, the Orbax round trip and the HF
export loading back in transformers, and what is refused with the field named.
"""

from __future__ import annotations

import json
import pathlib
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from support.hf_models import MOE_ARCHS, build_moe_model, hf_greedy  # noqa: E402
from support.numerics import gamma, logits_atol  # noqa: E402
from support.tiers import run_slow  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.models import decoder, families, loading, moe  # noqa: E402
from jaxserve.models.config import ConfigError, MoESpec  # noqa: E402

PROMPTS = [[5, 17, 99, 3, 42, 8, 150, 7, 61, 33, 12, 190, 4], [9, 9, 100, 23, 77, 6],
           list(range(20, 39))]


# ------------------------------------------------------------------------------ the block
def _grouped_bound(x: np.ndarray, w: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Per element: gamma(in) * sum |x_i w_io| over the row's own group (two summation
    orders of the same float32 products: each side within gamma_n of the exact sum)."""
    ends = np.cumsum(sizes)
    group = np.minimum(np.searchsorted(ends, np.arange(len(x)), side="right"), len(w) - 1)
    mag = np.einsum("mi,mio->mo", np.abs(x).astype(np.float64),
                    np.abs(w[group]).astype(np.float64))
    return 2 * gamma(x.shape[1]) * mag + 1e-30


@pytest.mark.parametrize("sizes", [
    [3, 0, 5, 0],      # empty groups between full ones
    [1, 1, 1, 1],      # one row per group
    [0, 0, 8, 0],      # every row in one group
    [0, 2, 0, 3],      # rows past the groups' sum (3 of 8): they come out zero
])
def test_grouped_matmul_equals_definition(sizes: list[int]) -> None:
    rng = np.random.default_rng(0)
    m = 8
    x = rng.standard_normal((m, 24)).astype(np.float32)
    w = rng.standard_normal((4, 24, 40)).astype(np.float32)
    s = np.asarray(sizes, np.int32)
    got = np.asarray(jax.jit(moe.grouped_matmul)(x, w, s))
    want = np.asarray(moe.grouped_matmul_reference(x, w, s))
    bound = _grouped_bound(x, w, s)
    assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) - bound)
    assert np.all(got[s.sum():] == 0) and np.all(want[s.sum():] == 0)
    # The definition itself, row by row in float64: the reference is not trusted blindly.
    ends = np.cumsum(s)
    for r in range(int(s.sum())):
        g = int(np.searchsorted(ends, r, side="right"))
        exact = x[r].astype(np.float64) @ w[g].astype(np.float64)
        assert np.all(np.abs(want[r] - exact) <= bound[r])


@pytest.mark.parametrize("sizes, tile", [
    ([3, 0, 5, 0], 8),       # empty groups; groups inside one tile each
    ([1, 1, 1, 1], 8),       # one row per group: a tile each, mostly padding
    ([0, 0, 8, 0], 8),       # every row in one group: exactly one tile
    ([0, 0, 21, 0], 8),      # one group over three tiles, the last partial
    ([9, 2, 0, 10], 4),      # groups over several tiles, one empty
])
def test_grouped_mlps_equal_the_definition(sizes: list[int], tile: int) -> None:
    """The CPU tile loop and the ragged-dot MLP (the two `grouped_mlp` backends) equal the
    per-row definition: each row through its own group's gate / up / down."""
    rng = np.random.default_rng(1)
    s = np.asarray(sizes, np.int32)
    m, hidden, width = int(s.sum()), 12, 10
    xs = rng.standard_normal((m, hidden)).astype(np.float32)
    wg, wu = (rng.standard_normal((4, hidden, width)).astype(np.float32) for _ in range(2))
    wd = rng.standard_normal((4, width, hidden)).astype(np.float32)
    group = np.searchsorted(np.cumsum(s), np.arange(m), side="right")
    x64 = xs.astype(np.float64)
    g = np.einsum("mi,mio->mo", x64, wg[group].astype(np.float64))
    u = np.einsum("mi,mio->mo", x64, wu[group].astype(np.float64))
    h = g / (1 + np.exp(-g)) * u
    want = np.einsum("mi,mio->mo", h, wd[group].astype(np.float64))
    # |h| error: gamma(hidden) relative on g and u, SiLU's exp; then gamma(width) on down:
    # relative to the sums of |terms| (float64 magnitudes)
    mag_h = (np.einsum("mi,mio->mo", np.abs(x64), np.abs(wg[group]).astype(np.float64))
             * np.einsum("mi,mio->mo", np.abs(x64), np.abs(wu[group]).astype(np.float64)))
    mag = np.einsum("mi,mio->mo", mag_h, np.abs(wd[group]).astype(np.float64))
    bound = 4 * gamma(hidden + width + 8) * mag + 1e-30
    tiled = np.asarray(jax.jit(lambda *a: moe.grouped_mlp_tiled(*a, tile=tile))(
        xs, s, wg, wu, wd))
    ragged = np.asarray(jax.jit(moe.grouped_mlp_ragged)(xs, s, wg, wu, wd))
    for name, got in (("tiled", tiled), ("ragged", ragged)):
        assert np.all(np.abs(got - want) <= bound), (name, np.max(np.abs(got - want) - bound))
    assert [moe.tile_rows(m, 8) for m in (2, 16, 128, 512)] == [4, 4, 16, 32]


def _layer(rng: np.random.Generator, hidden: int, experts: int, width: int,
           shared: int) -> types.SimpleNamespace:
    f = np.float32
    lp = types.SimpleNamespace(
        router=rng.standard_normal((hidden, experts)).astype(f),
        we_gate=(0.3 * rng.standard_normal((experts, hidden, width))).astype(f),
        we_up=(0.3 * rng.standard_normal((experts, hidden, width))).astype(f),
        we_down=(0.3 * rng.standard_normal((experts, width, hidden))).astype(f))
    if shared:
        lp.ws_gate = (0.3 * rng.standard_normal((hidden, shared))).astype(f)
        lp.ws_up = (0.3 * rng.standard_normal((hidden, shared))).astype(f)
        lp.ws_down = (0.3 * rng.standard_normal((shared, hidden))).astype(f)
        lp.ws_router = rng.standard_normal((hidden, 1)).astype(f)
    return lp


@pytest.mark.parametrize("experts, top_k, norm, shared, tokens", [
    (8, 2, True, 0, 16),
    (8, 2, False, 0, 3),     # fewer pairs than experts: most groups empty
    (4, 1, True, 0, 1),      # one token, one expert: one one-row group
    (6, 3, False, 12, 10),   # a shared expert, no renormalisation
])
def test_moe_mlp_equals_dense_all_experts(experts: int, top_k: int, norm: bool, shared: int,
                                          tokens: int) -> None:
    rng = np.random.default_rng(experts * 10 + tokens)
    hidden, width = 16, 20
    spec = MoESpec(experts, top_k, width, norm, shared)
    lp = _layer(rng, hidden, experts, width, shared)
    h = rng.standard_normal((2, tokens, hidden)).astype(np.float32)
    got = np.asarray(jax.jit(lambda h: moe.moe_mlp(spec, lp, h))(h))
    want = np.asarray(moe.dense_moe_reference(spec, lp, h))
    # Both sides: the same routing (the same router code on the same input), then sums of
    # hidden and width terms in other orders, then the k-term combine: relative to the sum
    # of |terms| along that chain, which the dense side's magnitude bounds per expert.
    mag = np.asarray(moe.dense_moe_reference(
        spec, types.SimpleNamespace(**{k: np.abs(v) for k, v in vars(lp).items()}),
        np.abs(h)))
    bound = 4 * gamma(hidden + width + top_k + 1) * (mag + 1.0) * np.abs(mag).max()
    assert got.shape == want.shape == h.shape
    np.testing.assert_array_less(np.abs(got - want), bound + 1e-30)
    assert np.abs(want).max() > 1e-3  # the comparison is not of zeros


def test_all_tokens_on_one_expert() -> None:
    """A router that sends every token to expert 2 first: one group holds all N rows of
    the first choice; the result is still the dense oracle's."""
    rng = np.random.default_rng(3)
    spec = MoESpec(4, 2, 8, True)
    lp = _layer(rng, 16, 4, 8, 0)
    lp.router = np.zeros_like(lp.router)
    lp.router[:, 2] = 5.0
    h = np.abs(rng.standard_normal((12, 16))).astype(np.float32) + 0.5  # logit 2 dominant
    w, e = moe.route(spec, jnp.asarray(lp.router), jnp.asarray(h))
    assert np.all(np.asarray(e)[:, 0] == 2)
    got = np.asarray(moe.moe_mlp(spec, lp, h))
    want = np.asarray(moe.dense_moe_reference(spec, lp, h))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_routing_softmax_topk_renormalised() -> None:
    """route: softmax over all experts then the top-k, renormalised if asked (transformers'
    Qwen3-MoE / Mixtral routers), in float64 by hand."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((7, 6)).astype(np.float32)
    r = rng.standard_normal((6, 5)).astype(np.float32)
    logits = x.astype(np.float64) @ r.astype(np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top = np.argsort(-p, axis=-1, kind="stable")[:, :2]
    for norm in (False, True):
        w, e = moe.route(MoESpec(5, 2, 4, norm), jnp.asarray(r), jnp.asarray(x))
        pw = np.take_along_axis(p, top, -1)
        if norm:
            pw = pw / pw.sum(-1, keepdims=True)
        np.testing.assert_array_equal(np.asarray(e), top)
        np.testing.assert_allclose(np.asarray(w), pw, rtol=1e-5)


# ------------------------------------------------------------------ families vs transformers
@pytest.fixture(scope="module", params=sorted(MOE_ARCHS))
def hf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    d = tmp_path_factory.mktemp(request.param)
    return request.param, d, build_moe_model(request.param, d)


def _default_tier(arch: str) -> None:
    """The engine and round-trip tests run Qwen3-MoE (sparse and dense layer groups) in the
    default tier, the other families with JAXSERVE_RUN_SLOW=1 (their logits and routing
    are checked in both)."""
    if arch != "qwen3_moe" and not run_slow():
        pytest.skip("slow tier: this family through LLM / Orbax (JAXSERVE_RUN_SLOW=1)")


def _ours(model: loading.LoadedModel, tokens: np.ndarray) -> np.ndarray:
    return np.asarray(decoder.forward_jit(model.params, tokens,
                                          np.array([tokens.shape[1]], np.int32),
                                          cfg=model.config))


def _ref(model, tokens: np.ndarray) -> np.ndarray:  # noqa: ANN001 - a transformers model
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def test_config_specs(hf) -> None:  # noqa: ANN001
    arch, d, _ = hf
    cfg = loading.load_model(d).config
    assert cfg.model_type == arch
    specs = cfg.layer_specs
    if arch == "qwen3_moe":  # layer 1 dense (mlp_only_layers), its own scan group
        assert [s.moe is not None for s in specs] == [True, False, True]
        assert [(g.start, g.stop) for g in cfg.layer_groups] == [(0, 1), (1, 2), (2, 3)]
        assert specs[0].moe == MoESpec(4, 2, 32, True) and specs[0].qk_norm
    elif arch == "qwen2_moe":
        assert specs[0].moe == MoESpec(4, 2, 32, False, 48) and cfg.attention_bias
    else:
        assert specs[0].moe == MoESpec(4, 2, 32, True) and not specs[0].qk_norm
    assert families.config_from_hf(families.config_to_hf(cfg)) == cfg


def test_logits_match_transformers(hf) -> None:  # noqa: ANN001
    arch, d, model = hf
    ours = loading.load_model(d)
    tokens = np.array([PROMPTS[0]], np.int32)
    err = float(np.max(np.abs(_ours(ours, tokens) - _ref(model, tokens))))
    tol = logits_atol(ours.config, ours.params, tokens.shape[1])
    print(f"{arch}: max|diff| = {err:.2e}, bound {tol:.2e}")
    assert err <= tol


def test_router_choice_equals_transformers(hf) -> None:  # noqa: ANN001
    """On the inputs transformers' routers see (captured by hooks), jaxserve's router picks
    the same experts, in the same order, with the same weights."""
    arch, d, model = hf
    ours = loading.load_model(d)
    routers = [(name, m) for name, m in model.named_modules()
               if type(m).__name__.endswith("Router")]
    assert routers, "no router modules found in the transformers model"
    seen: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def hook(name: str):  # noqa: ANN202
        def f(mod, args, out) -> None:  # noqa: ANN001
            _, scores, idx = out
            seen[name] = (args[0].reshape(-1, args[0].shape[-1]).numpy(), scores.numpy(),
                          idx.numpy())
        return f

    handles = [m.register_forward_hook(hook(n)) for n, m in routers]
    try:
        _ref(model, np.array([PROMPTS[2]], np.int32))
    finally:
        for h in handles:
            h.remove()
    assert len(seen) == sum(s.moe is not None for s in ours.config.layer_specs)
    for name, (x, scores, idx) in seen.items():
        layer = int(name.split(".layers.")[1].split(".")[0])
        spec = ours.config.layer_specs[layer].moe
        w, e = moe.route(spec, ours.params.layers.router[layer], jnp.asarray(x))
        np.testing.assert_array_equal(np.asarray(e), idx, err_msg=f"{arch} {name}")
        # softmax of E logits and a k-term renormalisation, both sides float32
        np.testing.assert_allclose(np.asarray(w), scores, rtol=8 * gamma(spec.num_experts),
                                   atol=1e-7, err_msg=f"{arch} {name}")


@pytest.mark.slow(reason="MoE greedy through LLM: tests/engine/test_engine.py runs Qwen3-MoE "
                  "against transformers' generate through the engine in the default tier")
def test_greedy_through_llm_equals_transformers_generate(hf) -> None:  # noqa: ANN001
    arch, d, model = hf
    _default_tier(arch)
    n = 6
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    # Tiny pages and a small step budget: prompts prefill in chunks over several pages.
    with LLM(model=str(d), max_num_seqs=4, max_num_batched_tokens=8, page_size=4,
             max_model_len=64, kv_cache_memory=1 << 20, enable_prefix_caching=True) as llm:
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, n)
                                                          for p in PROMPTS], arch
        longer = PROMPTS[2] + [7, 8, 9]  # shares the third prompt's 19 tokens
        again = llm.generate([longer], sp, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 16  # four full pages from the prefix cache
    assert again.outputs[0].token_ids == hf_greedy(model, longer, n), arch


def test_orbax_round_trip_and_hf_export(hf, tmp_path: pathlib.Path) -> None:  # noqa: ANN001
    """Orbax keeps the stacked experts and the config exactly; the HF export writes one
    tensor per expert (and no dense MLP on sparse layers) and transformers loads it."""
    arch, d, _ = hf
    _default_tier(arch)
    src = loading.load_model(d)
    back = loading.load_model(loading.convert(d, tmp_path / "orbax", fmt="orbax"))
    assert back.format == "orbax" and back.config == src.config
    tokens = np.array([PROMPTS[2]], np.int32)
    np.testing.assert_array_equal(_ours(back, tokens), _ours(src, tokens))
    export = loading.convert(d, tmp_path / "hf", fmt="hf")
    assert loading.load_model(export).config == src.config
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    assert type(ref_model).__name__ == json.loads((d / "config.json").read_text())[
        "architectures"][0]
    err = np.max(np.abs(_ours(src, tokens) - _ref(ref_model, tokens)))
    assert err <= logits_atol(src.config, src.params, tokens.shape[1])


def test_compressed_tensors_experts_load_as_stored(hf, tmp_path: pathlib.Path) -> None:  # noqa: ANN001
    """A compressed-tensors checkpoint whose experts are stored int8 per channel loads them
    as they are (per-column int8 stacks, the stored values), and its logits equal
    transformers' over the dequantized checkpoint (support.compressed_ckpt writes both)."""
    from jaxserve.models.quant import QuantizedWeight
    from support.compressed_ckpt import write_compressed

    arch, d, _ = hf
    if arch == "mixtral":  # its experts' w1 / w2 / w3 are not `*_proj` modules there
        pytest.skip("the test writer quantizes `*_proj` linears only")
    _default_tier(arch)
    ref_dir = write_compressed(d, tmp_path / "q", "int8", "channel")
    ours = loading.load_model(tmp_path / "q")
    stored = np.load(tmp_path / "q" / "stored.npz")
    for field, proj in (("we_gate", "gate_proj"), ("we_down", "down_proj")):
        w = getattr(ours.params.layers, field)
        assert isinstance(w, QuantizedWeight) and w.scheme == "int8" and w.group_size == (
            w.shape[-2])
        q = stored[f"model.layers.0.mlp.experts.1.{proj}.q"].view(np.int8)
        np.testing.assert_array_equal(np.asarray(w.values[0, 1]), q.T)
    ref = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32)
    tokens = np.array([PROMPTS[0]], np.int32)
    err = np.max(np.abs(_ours(ours, tokens) - _ref(ref, tokens)))
    assert err <= logits_atol(ours.config, ours.params, tokens.shape[1])


# ----------------------------------------------------------------------------- refusals
def _q3(**extra: object) -> dict:
    return {**dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                   vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
                   num_experts_per_tok=2, moe_intermediate_size=16), **extra}


def test_config_forms() -> None:
    # decoder_sparse_step 2: layers 1 and 3 sparse; mlp_only_layers removes 3.
    c = families.config_from_hf(_q3(decoder_sparse_step=2, mlp_only_layers=[3]))
    assert [s.moe is not None for s in c.layer_specs] == [False, True, False, False]
    assert [(g.start, g.stop) for g in c.layer_groups] == [(0, 1), (1, 2), (2, 4)]
    assert families.config_from_hf(families.config_to_hf(c)) == c
    # transformers 5 writes num_local_experts; the Hub's files num_experts: either is read.
    a = families.config_from_hf(_q3())
    b = families.config_from_hf({**{k: v for k, v in _q3().items() if k != "num_experts"},
                                 "num_local_experts": 8})
    assert a == b and a.layer_specs[0].moe.num_experts == 8
    # num_experts 0: every layer dense (transformers' condition).
    assert all(s.moe is None for s in families.config_from_hf(_q3(num_experts=0)).layer_specs)


@pytest.mark.parametrize("d, match", [
    (_q3(num_local_experts=4), "num_experts=8 and num_local_experts=4 disagree"),
    (_q3(num_experts_per_tok=9), "num_experts_per_tok=9"),
    (_q3(mlp_only_layers=[7]), "mlp_only_layers=\\[7\\]"),
    (_q3(decoder_sparse_step=0), "decoder_sparse_step=0"),
    (_q3(norm_topk_prob="yes"), "norm_topk_prob='yes'"),
    (_q3(hidden_act="gelu"), "hidden_act='gelu'"),
    ({**_q3(), "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
      "use_sliding_window": True}, "use_sliding_window=true"),
])
def test_refused_configs_say_why(d: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        families.config_from_hf(d)


def test_moe_gguf_without_experts_is_refused(tmp_path: pathlib.Path) -> None:
    """A `qwen2` GGUF that claims experts is no architecture llama.cpp writes: refused, not
    loaded as a dense model. (MoE GGUF files themselves: test_moe_gguf.py.)"""
    pytest.importorskip("gguf")
    from support.gguf_files import tiny_weights, write_tiny_gguf

    path = tmp_path / "q2.gguf"
    write_tiny_gguf(path, tiny_weights(np.random.default_rng(0), "qwen2"), arch="qwen2",
                    meta_override={"qwen2.expert_count": 4, "qwen2.expert_used_count": 2})
    with pytest.raises(ValueError, match=r"qwen2 file with experts is not a known"):
        loading.load_model(path)

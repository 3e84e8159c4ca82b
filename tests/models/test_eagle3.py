"""The EAGLE-3 head (`models/eagle3.py`) and the target's auxiliary hidden states (`paged.py`).

Oracles: `tests/support/eagle3_oracle.py`, the head in plain PyTorch over whole sequences
(dense causal attention, no pages), on random weights saved in the released key layout and
loaded by jaxserve's loader; HF transformers' `output_hidden_states` for the auxiliary states
(its hidden_states[i], i < L, is the stream entering layer i, as vLLM takes them).

Tolerance (float32 throughout): every value is O(1) (unit-scale linears, RMS-normed inputs)
and each output is a chain of 5 matmuls of depth <= 96 plus a softmax; float32 rounding
gives about depth * 2**-24 ~ 6e-6 relative error per matmul, so 5e-5 absolute bounds the
chain with room for the different summation orders (paged attention sums over pages), while
the conventions the tests tell apart (residual before / after hidden_norm, a missing
position) move outputs by more than 1e-2.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels_pallas import AttentionMetadata
from jaxserve.models import eagle3, llama, paged, tiny
from jaxserve.models.config import ConfigError
from jaxserve.models.eagle3_config import eagle3_config_from_hf
from jaxserve.models.safetensors_io import CheckpointError
from support.eagle3_oracle import HEAD_CONFIG, random_weights, reference, write_head
from support.tiers import slow

TOL = 5e-5
PAGE = 4
# Two sequences' pages (page 0 is trash), deliberately out of order.
TABLES = {0: [3, 5, 1], 1: [2, 6, 4]}
LENGTHS = {0: 12, 1: 9}
# Each step: (sequence, start, stop); a prefill in two chunks, then single tokens.
STEPS = [[(0, 0, 5), (1, 0, 4)], [(0, 5, 9), (1, 4, 7)], [(0, 9, 10), (1, 7, 8)],
         [(0, 10, 11), (1, 8, 9)], [(0, 11, 12)]]


def _metadata(rows: list[tuple[int, int, int]]) -> AttentionMetadata:
    slots, cu = [], [0]
    for s, start, stop in rows:
        pos = np.arange(start, stop)
        slots += list(np.asarray(TABLES[s])[pos // PAGE] * PAGE + pos % PAGE)
        cu.append(cu[-1] + stop - start)
    return AttentionMetadata(
        slot_mapping=jnp.asarray(slots, jnp.int32),
        block_tables=jnp.asarray([TABLES[s] for s, _, _ in rows], jnp.int32),
        kv_lens=jnp.asarray([stop for _, _, stop in rows], jnp.int32),
        cu_q_lens=jnp.asarray(cu, jnp.int32), num_seqs=jnp.asarray([len(rows)], jnp.int32))


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, object, object]:
    weights = random_weights(HEAD_CONFIG, seed=1)
    d = write_head(tmp_path_factory.mktemp("eagle3"), HEAD_CONFIG, weights)
    cfg, params = eagle3.load_eagle3(d)
    return HEAD_CONFIG, weights, cfg, params


def _run_paged(cfg, params, inputs, impl: str, target_embed=None):  # noqa: ANN001, ANN202
    """The head over STEPS through its own pages: {seq: (out [L, H], logits [L, Vd])}."""
    kv = eagle3.init_eagle3_kv(cfg, 7, PAGE, jnp.float32)
    step = jax.jit(eagle3.eagle3_hidden, static_argnames=("cfg", "attn_impl"),
                   donate_argnames=("kv_pages",))
    outs = {s: [] for s in LENGTHS}
    for rows in STEPS:
        ids = np.concatenate([inputs[s][0][a:b] for s, a, b in rows])
        aux = np.concatenate([inputs[s][1][a:b] for s, a, b in rows])
        pos = np.concatenate([np.arange(a, b) for _, a, b in rows]).astype(np.int32)
        hidden = eagle3.eagle3_fuse(params, jnp.asarray(aux))
        out, kv = step(params, kv, jnp.asarray(ids, jnp.int32), hidden, jnp.asarray(pos),
                       _metadata(rows), cfg=cfg, target_embed=target_embed, attn_impl=impl)
        off = 0
        for s, a, b in rows:
            outs[s].append(np.asarray(out[off:off + b - a]))
            off += b - a
    res = {}
    for s, parts in outs.items():
        o = np.concatenate(parts)
        res[s] = (o, np.asarray(eagle3.eagle3_logits(params, jnp.asarray(o), cfg,
                                                     target_embed)))
    return res


def _inputs(cfg_dict: dict, seed: int = 7) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    Ht = cfg_dict.get("target_hidden_size", cfg_dict["hidden_size"])
    return {s: (rng.integers(0, cfg_dict["vocab_size"], n),
                rng.standard_normal((n, 3 * Ht)).astype(np.float32))
            for s, n in LENGTHS.items()}


@pytest.mark.parametrize("impl", [pytest.param("cpu", marks=slow(
    "the served head is checked against this dense oracle in the default tier, through "
    "the engine (tests/serving/test_spec_eagle3_build.py)")), pytest.param("reference", marks=slow(
    "the jnp reference attention compiles ~6x slower; the CPU kernel runs by default"))])
def test_paged_head_matches_dense_torch(head, impl: str) -> None:  # noqa: ANN001
    """Chunks, single tokens, two sequences in a step, pages out of order: every token's
    pre-norm output and draft logits equal the dense oracle's over the whole sequence."""
    cfg_dict, weights, cfg, params = head
    inputs = _inputs(cfg_dict)
    got = _run_paged(cfg, params, inputs, impl)
    for s, (ids, aux) in inputs.items():
        want_out, want_logits = reference(weights, cfg_dict, ids, aux=aux)
        np.testing.assert_allclose(got[s][0], want_out, rtol=TOL, atol=TOL)
        np.testing.assert_allclose(got[s][1], want_logits, rtol=TOL, atol=TOL)
        # The oracle can tell the residual conventions apart (the test can fail).
        other, _ = reference(weights, cfg_dict, ids, aux=aux, norm_before_residual=True)
        assert np.abs(other - want_out).max() > 1e-2


@pytest.mark.parametrize("tied", [False, True])
def test_norm_before_residual_and_shared_embedding(tmp_path, tied: bool) -> None:  # noqa: ANN001
    """A head without embed_tokens reads the target's (passed in), and a tied one uses it as
    its lm_head too; `norm_before_residual` takes the normed hidden as the residual;
    logit_scale scales the logits."""
    cfg_dict = HEAD_CONFIG | {"norm_before_residual": True, "logit_scale": 0.5}
    weights = random_weights(cfg_dict, seed=2, embed=False)
    if tied:
        cfg_dict |= {"tie_word_embeddings": True, "draft_vocab_size": 211}
        weights = {k: v for k, v in weights.items() if k not in ("lm_head.weight", "d2t")}
    cfg, params = eagle3.load_eagle3(write_head(tmp_path, cfg_dict, weights))
    assert params.embed is None and cfg.norm_before_residual
    assert (params.lm_head is None) == tied
    table = np.random.default_rng(3).standard_normal((211, 32)).astype(np.float32)
    inputs = _inputs(cfg_dict, seed=4)
    got = _run_paged(cfg, params, inputs, "cpu", target_embed=jnp.asarray(table))
    for s, (ids, aux) in inputs.items():
        out, logits = reference(weights, cfg_dict, ids, aux=aux, embed_table=table,
                                norm_before_residual=True)
        np.testing.assert_allclose(got[s][0], out, rtol=TOL, atol=TOL)
        np.testing.assert_allclose(got[s][1], 0.5 * logits, rtol=TOL, atol=TOL)
    with pytest.raises(ValueError, match="target_embed"):
        eagle3.eagle3_logits(params, jnp.zeros((1, 32)), cfg)
    if tied:  # the identity map
        np.testing.assert_array_equal(
            np.asarray(eagle3.draft_to_target(params, jnp.arange(211))), np.arange(211))


def test_d2t_maps_draft_ids_to_target_ids(head) -> None:  # noqa: ANN001
    _, weights, _, params = head
    hot = np.flatnonzero(weights["t2d"])  # the draft vocabulary, in target ids
    got = eagle3.draft_to_target(params, jnp.arange(50, dtype=jnp.int32))
    np.testing.assert_array_equal(np.asarray(got), hot)


@pytest.mark.parametrize("edit,match", [
    (lambda w: w.pop("midlayer.hidden_norm.weight"), r"midlayer\.hidden_norm\.weight"),
    (lambda w: w.pop("d2t"), r"'d2t'"),
    (lambda w: w.update({"fc.weight": w["fc.weight"].T.copy()}),
     r"fc\.weight has shape \(96, 32\), expected \(32, 96\)"),
    (lambda w: w.update({"midlayer.self_attn.q_proj.weight": np.zeros((32, 32), np.float32)}),
     r"midlayer\.self_attn\.q_proj\.weight has shape \(32, 32\), expected \(32, 64\)"),
    (lambda w: w.update({"midlayer.self_attn.q_proj.bias": np.zeros(32, np.float32)}),
     r"midlayer\.self_attn\.q_proj\.bias"),
    (lambda w: w.update({"d2t": w["d2t"] + 500}), r"d2t maps draft ids outside"),
], ids=["missing", "missing_d2t", "transposed", "wrong_shape", "unknown", "d2t_range"])
def test_bad_checkpoint_refused_naming_the_tensor(tmp_path, edit,  # noqa: ANN001
                                                  match: str) -> None:
    weights = random_weights(HEAD_CONFIG, seed=5)
    edit(weights)
    with pytest.raises(CheckpointError, match=match):
        eagle3.load_eagle3(write_head(tmp_path, HEAD_CONFIG, weights))


@pytest.mark.parametrize("change,match", [
    ({"num_hidden_layers": 2}, "num_hidden_layers=2"),
    ({"architectures": ["LlamaForCausalLM"]}, "not an EAGLE-3 head"),
    ({"attention_bias": True}, "attention_bias"),
    ({"eagle_config": {"use_aux_hidden_state": False}}, "use_aux_hidden_state"),
    ({"draft_vocab_size": 300}, "draft_vocab_size=300"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 2]}, "eagle_aux_hidden_state_layer_ids"),
])
def test_bad_config_refused_naming_the_field(change: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        eagle3_config_from_hf(HEAD_CONFIG | change, "head/config.json")


def test_target_checks_and_aux_layer_choice(head) -> None:  # noqa: ANN001
    _, _, cfg, _ = head
    target = tiny.tiny_config(**tiny.TEST_SHAPE)
    cfg.check_target(target, has_embed=True)
    with pytest.raises(ConfigError, match="size 32.*hidden_size is 64"):
        cfg.check_target(tiny.tiny_config(**(tiny.TEST_SHAPE | {"hidden_size": 64})), True)
    wide = dataclasses.replace(cfg, target_hidden_size=64)
    wide.check_target(tiny.tiny_config(**(tiny.TEST_SHAPE | {"hidden_size": 64})), True)
    with pytest.raises(ConfigError, match="hidden_size=32 differs .* hidden_size=64"):
        wide.check_target(tiny.tiny_config(**(tiny.TEST_SHAPE | {"hidden_size": 64})), False)
    assert cfg.aux_layers(dataclasses.replace(target, num_layers=32)) == (2, 16, 29)
    named = eagle3_config_from_hf(HEAD_CONFIG | {"eagle_config": {
        "eagle_aux_hidden_state_layer_ids": [30, 1, 16]}}, "c")
    assert named.aux_layers(dataclasses.replace(target, num_layers=32)) == (1, 16, 30)
    with pytest.raises(ConfigError, match=r"\[0, 8\]"):
        named.aux_layers(dataclasses.replace(target, num_layers=8))


@pytest.fixture(scope="module")
def target():  # noqa: ANN201
    """A 6-layer tiny Llama and random params."""
    cfg = tiny.tiny_config(**(tiny.TEST_SHAPE | {"num_layers": 6}))
    return cfg, _numpy_params(cfg)


def _numpy_params(cfg):  # noqa: ANN001, ANN202
    """tiny.random_params' distribution drawn with numpy (jax's eager random ops compile
    once per new shape, seconds on the shared host)."""
    rng = np.random.default_rng(3)

    def leaf(path, a):  # noqa: ANN001, ANN202
        x = rng.standard_normal(a.shape)
        x = 1 + 0.1 * x if "norm" in jax.tree_util.keystr(path) else tiny.TEST_INIT_SCALE * x
        return jnp.asarray(x, jnp.float32)

    return jax.tree_util.tree_map_with_path(leaf, llama.abstract_params(cfg, jnp.float32))


def _paged_aux(cfg, params, ids, aux_layers):  # noqa: ANN001, ANN202
    """paged_hidden over sequence 0's STEPS -> (aux [L, n * H], last hidden [L, H])."""
    kv = paged.init_kv_cache(cfg, 7, PAGE, jnp.float32)
    step = jax.jit(paged.paged_hidden, static_argnames=("cfg", "attn_impl", "aux_layers"),
                   donate_argnames=("kv_pages",))
    got, hid = [], []
    for rows in STEPS:
        (_, a, b), = rows = [r for r in rows if r[0] == 0]
        x, kv, aux = step(params, kv, jnp.asarray(ids[a:b], jnp.int32),
                          jnp.arange(a, b, dtype=jnp.int32), _metadata(rows), cfg=cfg,
                          attn_impl="cpu", aux_layers=aux_layers)
        got.append(np.asarray(aux))
        hid.append(np.asarray(x))
    got_all = np.concatenate(got)
    assert got_all.shape == (len(ids), len(aux_layers) * cfg.hidden_size)
    return got_all, np.concatenate(hid)


def _check_aux(got: np.ndarray, hidden: np.ndarray, states: list[np.ndarray],
               aux_layers: tuple[int, ...], num_layers: int) -> None:
    """got's k-th block is states[aux_layers[k]] (the stream entering that layer; index
    num_layers: the last layer's output before the final norm, the step's own hidden)."""
    H = hidden.shape[-1]
    for k, i in enumerate(aux_layers):
        want = hidden if i == num_layers else states[i]
        scale = np.abs(want).max()
        np.testing.assert_allclose(got[:, k * H:(k + 1) * H], want, rtol=1e-4,
                                   atol=1e-4 * scale)
        if i < num_layers:  # the next layer's stream differs: an off-by-one would fail
            assert np.abs(states[i + 1] - want).max() > 1e-2 * scale


def test_aux_hidden_states_are_layer_inputs(target) -> None:  # noqa: ANN001
    """Oracle: a python loop of `decoder_layer` over the layers with dense causal attention
    (no scan, no pages), recording x before each layer, as vLLM's `hidden + residual` before
    layer i runs. Indices 0 (the embeddings), a middle one and L."""
    from jaxserve.models.blocks import causal_mask, embed, masked_attention
    from jaxserve.models.decoder import decoder_layer

    cfg, params = target
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, LENGTHS[0])
    pos = jnp.arange(len(ids), dtype=jnp.int32)[None]

    def attn(q, k, v, state, spec):  # noqa: ANN001, ANN202 - the AttnFn protocol
        mask = causal_mask(pos, pos, jnp.ones_like(pos, bool), None)
        return masked_attention(q, k, v, mask, spec.query_scale), state

    @jax.jit
    def loop(params: object, tokens: jax.Array) -> list[jax.Array]:
        x = embed(params, tokens)
        states = []
        for i, spec in enumerate(cfg.layer_specs):
            states.append(x[0])
            x, *_ = decoder_layer(cfg, spec, jax.tree.map(lambda a, i=i: a[i], params.layers),
                                  x, pos, attn, None)
        return [*states, x[0]]

    states = [np.asarray(a) for a in loop(params, jnp.asarray(ids[None], jnp.int32))]
    aux_layers = (0, 3, cfg.num_layers)
    got, hidden = _paged_aux(cfg, params, ids, aux_layers)
    np.testing.assert_allclose(hidden, states[-1], rtol=1e-4, atol=1e-4 * np.abs(hidden).max())
    _check_aux(got, hidden, states, aux_layers, cfg.num_layers)


@slow("imports transformers and loads the target with it (~20 s on the 2-core host)")
@pytest.mark.parametrize("which", ["default", "ends"])
def test_aux_hidden_states_match_transformers(target, head, which: str,  # noqa: ANN001
                                             tmp_path) -> None:  # noqa: ANN001
    """The same against transformers' `output_hidden_states` (hidden_states[i], i < L, is
    the stream entering layer i; its last one is after the final norm, so index L is left to
    the loop test). "default": the head's choice for 8 layers, (2, 4, 5)."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxserve.models.hf_loader import save_hf_dir

    cfg = dataclasses.replace(target[0], num_layers=8)  # defaults (2, 4, 5) are distinct
    params = _numpy_params(cfg)
    save_hf_dir(tmp_path, cfg, params)
    aux_layers = head[2].aux_layers(cfg) if which == "default" else (0, 1, 7)
    assert which == "ends" or aux_layers == (2, 4, 5)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, LENGTHS[0])
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        out = hf(torch.from_numpy(ids[None]), output_hidden_states=True).hidden_states
    states = [s[0].numpy() for s in out[:-1]]  # the inputs of layers 0 .. L - 1
    got, hidden = _paged_aux(cfg, params, ids, aux_layers)
    _check_aux(got, hidden, states + [hidden], aux_layers, cfg.num_layers)


def test_aux_option_keeps_kv_in_place_and_is_checked(target) -> None:  # noqa: ANN001
    """With aux_layers the donated KV is still updated in place (aliased, never copied), and
    without it the step returns just (hidden, kv); bad indices are refused."""
    cfg, params = target
    kv = paged.init_kv_cache(cfg, 7, PAGE, jnp.float32)
    rows = [(0, 0, 5)]
    args = (params, kv, jnp.zeros(5, jnp.int32), jnp.arange(5, dtype=jnp.int32),
            _metadata(rows))
    step = jax.jit(paged.paged_hidden, static_argnames=("cfg", "attn_impl", "aux_layers"),
                   donate_argnames=("kv_pages",))
    hlo = step.lower(*args, cfg=cfg, attn_impl="cpu", aux_layers=(2, 3, 5)).compile().as_text()
    kv_type = "f32[%s]" % ",".join(map(str, kv.shape))
    assert "input_output_alias={ {1}: (" in hlo  # output 1 (the KV) reuses its input
    assert not re.search(re.escape(kv_type) + r"\{[^}]*\} copy\(", hlo)
    assert len(jax.eval_shape(lambda *a: paged.paged_hidden(*a, cfg=cfg), *args)) == 2
    for bad in ((3, 2, 5), (2, 2, 5), (2, 3, 7)):
        with pytest.raises(ValueError, match="aux_layers"):
            jax.eval_shape(lambda *a, bad=bad: paged.paged_hidden(*a, cfg=cfg, aux_layers=bad),
                           *args)


def test_per_group_tables_refused(head) -> None:  # noqa: ANN001
    """A target with KV groups hands per-group tables [G, S, W]: refused, not misread."""
    _, _, cfg, params = head
    md = _metadata([(0, 0, 5)])
    md = AttentionMetadata(md.slot_mapping[None], md.block_tables[None], md.kv_lens,
                           md.cu_q_lens, md.num_seqs)
    with pytest.raises(ValueError, match="KV groups"):
        eagle3.eagle3_hidden(params, eagle3.init_eagle3_kv(cfg, 7, PAGE, jnp.float32),
                             jnp.zeros(5, jnp.int32), jnp.zeros((5, 32)),
                             jnp.arange(5, dtype=jnp.int32), md, cfg)

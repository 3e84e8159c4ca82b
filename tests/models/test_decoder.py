"""Layers of different specs: the grouped scan and the paged step against a per-layer loop.

Oracles: a python loop over the layers, each `decoder_layer` on that layer's slice of the
stacked weights with its own spec (no scan, no groups); the full-sequence forward for the
paged step, which must hand each layer's sliding window, soft-cap and query scale to the
attention kernel. The model mixes groups that differ in window, rope base, soft-cap and MLP
activation (the Gemma-shaped variation the specs carry), on the Llama family's params.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels_pallas import AttentionMetadata
from jaxserve.models import decoder, paged, tiny
from jaxserve.models.blocks import causal_mask, embed, lm_logits, masked_attention
from jaxserve.models.config import LayerGroup, ModelConfig
from jaxserve.models.kv_groups import first_live_page, kv_groups
from jaxserve.models.packing import pack_params
from jaxserve.models.quant import WeightQuant
from jaxserve.models.quantized_params import quantize_params


def mixed_config() -> ModelConfig:
    """Five layers in three groups: local, global, local (plus one spec of its own)."""
    base = tiny.tiny_config(**(tiny.TEST_SHAPE | {"num_layers": 5}))
    u = base.uniform_spec()
    local = dataclasses.replace(u, sliding_window=3)
    glob = dataclasses.replace(u, rope_theta=1e6, soft_cap=1.5, mlp_activation="gelu_pytorch_tanh")
    last = dataclasses.replace(local, query_scale=0.5)
    return dataclasses.replace(base, per_layer=(local, local, glob, glob, last))


def test_groups_are_runs_of_equal_spec() -> None:
    cfg = mixed_config()
    s = cfg.layer_specs
    assert cfg.layer_groups == (LayerGroup(s[0], 0, 2), LayerGroup(s[2], 2, 4),
                                LayerGroup(s[4], 4, 5))


def loop_forward(params: object, tokens: jax.Array, lengths: jax.Array,
                 cfg: ModelConfig) -> jax.Array:
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    valid = positions < lengths[:, None]

    def attn(q, k, v, state, spec):  # noqa: ANN001, ANN202 - the AttnFn protocol
        mask = causal_mask(positions, positions, valid, spec.sliding_window)
        return masked_attention(q, k, v, mask, spec.query_scale, spec.soft_cap), state

    x = embed(params, tokens)
    for i, spec in enumerate(cfg.layer_specs):
        lp = jax.tree.map(lambda a: a[i], params.layers)
        x, *_ = decoder.decoder_layer(cfg, spec, lp, x, positions, attn, None)
    return lm_logits(cfg, params, x)


TOKENS = np.array([[5, 17, 3, 99, 42, 7, 150, 8, 61, 23, 4, 11, 200],
                   [9, 1, 44, 3, 12, 0, 0, 0, 0, 0, 0, 0, 0]], np.int32)
LENGTHS = np.array([13, 5], np.int32)


@pytest.fixture(scope="module")
def model() -> tuple[ModelConfig, object]:
    cfg = mixed_config()
    return cfg, tiny.random_params(cfg, seed=3, scale=tiny.TEST_INIT_SCALE)


def test_grouped_scan_equals_layer_loop(model: tuple[ModelConfig, object]) -> None:
    cfg, params = model
    want = np.asarray(jax.jit(loop_forward, static_argnames="cfg")(params, TOKENS, LENGTHS,
                                                                   cfg=cfg))
    got = np.asarray(decoder.forward_jit(params, TOKENS, LENGTHS, cfg=cfg))
    valid = np.arange(TOKENS.shape[1])[None, :] < LENGTHS[:, None]
    np.testing.assert_allclose(got[valid], want[valid], rtol=2e-5, atol=2e-5)
    # The specs matter: the same weights as one uniform group give other logits.
    uniform = np.asarray(decoder.forward_jit(params, TOKENS, LENGTHS,
                                             cfg=dataclasses.replace(cfg, per_layer=())))
    assert np.abs(uniform[valid] - want[valid]).max() > 1e-2


def test_grouped_scan_reads_packed_and_quantized_stacks(model: tuple[ModelConfig, object]
                                                        ) -> None:
    """The CPU kernel's packed panels and quantized weights are indexed per group as well."""
    cfg, params = model
    want = np.asarray(decoder.forward_jit(params, TOKENS, LENGTHS, cfg=cfg))
    got = np.asarray(decoder.forward_jit(pack_params(params), TOKENS, LENGTHS, cfg=cfg))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    q = quantize_params(params, WeightQuant("int8"))
    loop = jax.jit(loop_forward, static_argnames="cfg")(q, TOKENS, LENGTHS, cfg=cfg)
    np.testing.assert_allclose(np.asarray(decoder.forward_jit(q, TOKENS, LENGTHS, cfg=cfg)),
                               np.asarray(loop), rtol=2e-5, atol=2e-5)
    qp = pack_params(jax.tree.map(jnp.asarray, q))
    np.testing.assert_allclose(np.asarray(decoder.forward_jit(qp, TOKENS, LENGTHS, cfg=cfg)),
                               np.asarray(loop), rtol=1e-3, atol=1e-3)


def _chunk_metadata(start: int, stop: int, page_size: int, max_pages: int,
                    cfg: ModelConfig) -> AttentionMetadata:
    """One sequence, new tokens [start, stop); page 0 is trash. The model has KV groups
    (`models/kv_groups.py`): group g's table is pages g * max_pages + 1, 2, ..., with the
    trash page where a sliding group's pages slid out of the window of the chunk's first
    query (as the engine's tables are: those pages must not be read)."""
    groups = kv_groups(cfg)
    assert groups is not None
    pos = np.arange(start, stop)
    tables = []
    for g, window in enumerate(groups.windows):
        table = g * max_pages + np.arange(1, max_pages + 1)
        if window is not None:
            table[: first_live_page(window, start, page_size)] = 0
        tables.append(table)
    tables_np = np.stack(tables)[:, None, :]  # [G, S = 1, max_pages]
    slots = np.stack([t[pos // page_size] * page_size + pos % page_size for t in tables])
    return AttentionMetadata(
        slot_mapping=jnp.asarray(slots, jnp.int32),
        block_tables=jnp.asarray(tables_np, jnp.int32),
        kv_lens=jnp.asarray([stop], jnp.int32),
        cu_q_lens=jnp.asarray([0, stop - start], jnp.int32),
        num_seqs=jnp.asarray([1], jnp.int32))


@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_paged_step_passes_each_layers_spec(model: tuple[ModelConfig, object], impl: str
                                            ) -> None:
    """Prefill chunks through the paged step: the logits of every token equal the
    full-sequence forward's, which needs each layer's own window, soft-cap and scale, and
    each layer's pages read through its KV group's table and slot (sliding groups with
    their slid-out pages replaced by the trash page)."""
    cfg, params = model
    page_size, max_pages = 4, 5
    groups = kv_groups(cfg)
    assert groups is not None and groups.windows == (None, 3, 3) and groups.slots == 2
    num_pages = 1 + groups.num_groups * max_pages
    want = np.asarray(decoder.forward_jit(params, TOKENS[:1], LENGTHS[:1], cfg=cfg))[0]
    kv = paged.init_kv_cache(cfg, num_pages, page_size, jnp.float32)
    assert kv.shape[0] == groups.slots * num_pages  # two layer slots, not five layers
    step = jax.jit(paged.paged_forward, static_argnames=("cfg", "attn_impl"))
    # Three chunks: the second and third start past the window, with the sliding groups'
    # first pages the trash page.
    for start, stop in ((0, 8), (8, 11), (11, 13)):
        md = _chunk_metadata(start, stop, page_size, max_pages, cfg)
        ids = jnp.asarray(TOKENS[0, start:stop])
        logits, kv = step(params, kv, ids, jnp.arange(start, stop, dtype=jnp.int32), md,
                          jnp.arange(stop - start, dtype=jnp.int32), cfg=cfg, attn_impl=impl)
        np.testing.assert_allclose(np.asarray(logits), want[start:stop], rtol=1e-4, atol=1e-4)

"""The paged step with adapter slots: each sequence of one ragged step gets its own adapter.

Oracle: the full-sequence forward (`decoder.forward_jit`, no pages) over the base weights with
that sequence's adapter merged in (W + A @ B per layer), or over the base weights alone for a
row on slot 0. The step under test mixes slot 0 and two adapters of different ranks and
targets in one batch, over plain weights, over the CPU dense kernel's packed weights, and over
a model of several layer groups (the stacks indexed per layer inside each group's scan).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support.engine_fixtures import tiny_model, tiny_model_config, tiny_tokenizer
from support.tiers import slow

from jaxserve.kernels_pallas import AttentionMetadata
from jaxserve.models import decoder, paged, tiny
from jaxserve.models.lora import (LORA_FIELDS, attach, init_lora_stacks, lora_targets,
                                  slot_arrays, write_slot_jit)
from jaxserve.models.packing import pack_params
from jaxserve.models.quant import WeightQuant
from jaxserve.models.quantized_params import dequantized_params, quantize_params

RANK = 8
PAGE = 4


def random_adapter(cfg, fields, rank, seed, scale=0.3):  # noqa: ANN001, ANN201
    """field -> (a [L, in, r], b [L, r, out]) of a random adapter (scaling folded into b)."""
    rng = np.random.default_rng(seed)
    out = {}
    for f in fields:
        L, i, o = lora_targets(cfg)[f]
        out[f] = (rng.normal(0, scale / np.sqrt(i), (L, i, rank)).astype(np.float32),
                  rng.normal(0, scale / np.sqrt(rank), (L, rank, o)).astype(np.float32))
    return out


def merged(params, weights):  # noqa: ANN001, ANN201
    """`params` with the adapter's product added to each target weight (the oracle)."""
    layers = params.layers
    return params.replace(layers=layers.replace(**{
        f: getattr(layers, f) + jnp.einsum("lir,lro->lio", a, b) for f, (a, b) in
        weights.items()}))


def _metadata(lengths: list[int]) -> tuple[AttentionMetadata, int]:
    """Prefill of whole sequences of `lengths`, end to end, each on its own pages."""
    max_pages = max(-(-n // PAGE) for n in lengths)
    tables, slots, next_page = [], [], 1
    for n in lengths:
        table = np.arange(next_page, next_page + max_pages)
        next_page += max_pages
        tables.append(table)
        pos = np.arange(n)
        slots.extend(table[pos // PAGE] * PAGE + pos % PAGE)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    md = AttentionMetadata(slot_mapping=jnp.asarray(slots, jnp.int32),
                           block_tables=jnp.asarray(np.stack(tables), jnp.int32),
                           kv_lens=jnp.asarray(lengths, jnp.int32),
                           cu_q_lens=jnp.asarray(cu, jnp.int32),
                           num_seqs=jnp.asarray([len(lengths)], jnp.int32))
    return md, next_page


def _step_logits(cfg, params, stacks, tokens, slots_of_seq):  # noqa: ANN001, ANN201
    lengths = [len(t) for t in tokens]
    md, num_pages = _metadata(lengths)
    ids = jnp.asarray(np.concatenate(tokens), jnp.int32)
    positions = jnp.asarray(np.concatenate([np.arange(n) for n in lengths]), jnp.int32)
    token_slots = jnp.asarray(np.repeat(slots_of_seq, lengths), jnp.int32)
    kv = paged.init_kv_cache(cfg, num_pages, PAGE, jnp.float32)

    @jax.jit
    def step(params, stacks, kv, ids, positions, md, token_slots):  # noqa: ANN001, ANN202
        p = params.replace(layers=attach(params.layers, stacks, token_slots, cfg))
        return paged.paged_forward(p, kv, ids, positions, md,
                                   jnp.arange(ids.shape[0], dtype=jnp.int32), cfg=cfg,
                                   attn_impl="reference")[0]

    logits = np.asarray(step(params, stacks, kv, ids, positions, md, token_slots))
    return np.split(logits, np.cumsum(lengths)[:-1])


def _check(model, pack: bool, quant: str | None = None,  # noqa: ANN001
           dtype: object = jnp.float32) -> None:
    """`quant`: the base weights stored quantized (the oracle merges the adapters into their
    dequantized values: the delta runs beside the quantized matmul, in float). `dtype`: the
    stacks' (bfloat16: the oracle merges the adapters' bfloat16-rounded values)."""
    cfg, params = model.config, model.params
    run_params = params
    if quant is not None:
        run_params = jax.tree.map(jnp.asarray, quantize_params(params, WeightQuant(quant)))
        params = dequantized_params(run_params, jnp.float32)
    adapters = {1: random_adapter(cfg, ("wq", "wv", "w_down"), 4, seed=1),
                2: random_adapter(cfg, LORA_FIELDS, RANK, seed=2)}
    stacks = init_lora_stacks(cfg, 3, RANK, dtype)
    adapters = {slot: {f: tuple(np.asarray(jnp.asarray(m, dtype).astype(jnp.float32))
                                for m in ab) for f, ab in w.items()}
                for slot, w in adapters.items()}
    for slot, w in adapters.items():
        stacks = write_slot_jit(stacks, np.int32(slot), slot_arrays(cfg, w, RANK))
    rng = np.random.default_rng(0)
    tokens = [rng.integers(3, cfg.vocab_size, n) for n in (5, 7, 6, 3)]
    slots = [1, 0, 2, 2]
    run_params = pack_params(run_params) if pack else run_params
    got = _step_logits(cfg, run_params, stacks, tokens, slots)
    for toks, slot, logits in zip(tokens, slots, got):
        oracle = params if slot == 0 else merged(params, adapters[slot])
        want = np.asarray(decoder.forward_jit(oracle, toks[None].astype(np.int32),
                                              np.array([len(toks)], np.int32), cfg=cfg))[0]
        np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4)
    # The adapters do change the outputs (the test can fail): slot 2's rows differ from base.
    base = np.asarray(decoder.forward_jit(params, tokens[2][None].astype(np.int32),
                                          np.array([len(tokens[2])], np.int32), cfg=cfg))[0]
    assert np.abs(got[2] - base).max() > 1e-2


@pytest.mark.parametrize("pack", [False, True], ids=["plain", "packed"])
def test_each_row_gets_its_own_adapter(pack: bool) -> None:
    _check(tiny_model(), pack)


@pytest.mark.parametrize("quant", ["int4", pytest.param("int8", marks=slow(
    "the same panels' path as int4 with another scheme"))])
def test_adapters_beside_quantized_packed_weights(quant: str) -> None:
    """Quantized base weights in the CPU kernel's quantized panels, the delta beside them."""
    _check(tiny_model(), pack=True, quant=quant)


def test_bfloat16_stacks() -> None:
    """--lora-dtype bfloat16: the stacks stored in bfloat16 (the CPU kernel reads them in
    place and accumulates in float32)."""
    _check(tiny_model(), pack=True, dtype=jnp.bfloat16)


def test_adapters_over_several_layer_groups() -> None:
    """Layers of three specs (one scan per group of equal spec, the stacks indexed by layer
    inside each): each layer reads its own slots."""
    cfg = tiny_model_config(num_layers=3)
    u = cfg.uniform_spec()
    glob = dataclasses.replace(u, rope_theta=1e6, soft_cap=2.0)
    cfg = dataclasses.replace(cfg, per_layer=(u, glob, u))
    assert len(cfg.layer_groups) == 3
    _check(tiny.random_model(cfg, seed=1, scale=tiny.TEST_INIT_SCALE,
                             tokenizer=tiny_tokenizer()), pack=False)


def test_slot_arrays_refuse_what_does_not_fit() -> None:
    cfg = tiny_model().config
    L, i, o = lora_targets(cfg)["wq"]
    with pytest.raises(ValueError, match="wq"):
        slot_arrays(cfg, {"wq": (np.zeros((L, i, RANK + 1)), np.zeros((L, RANK + 1, o)))}, RANK)
    with pytest.raises(ValueError, match="cannot adapt"):
        slot_arrays(cfg, {"embed": (np.zeros((1, 1, 1)), np.zeros((1, 1, 1)))}, RANK)


def test_kv_head_replication_repeats_b_per_head() -> None:
    """Tensor parallelism past the KV head count repeats each K/V head's output columns of
    b as placement repeats the base weight's."""
    cfg = tiny_model().config
    w = random_adapter(cfg, ("wk",), RANK, seed=3)
    one = slot_arrays(cfg, w, RANK)
    rep = 2
    two = slot_arrays(cfg, w, RANK, kv_rep=rep)
    D, H = cfg.head_dim, cfg.num_kv_heads
    b1 = one.b["wk"].reshape(cfg.num_layers, RANK, H, D)
    b2 = two.b["wk"].reshape(cfg.num_layers, RANK, H * rep, D)
    for h in range(H * rep):
        np.testing.assert_array_equal(b2[:, :, h], b1[:, :, h // rep])
    assert dataclasses.is_dataclass(one) and one.a["wk"].shape == two.a["wk"].shape

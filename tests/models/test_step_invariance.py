"""The engine's model step is batch invariant on CPU: a token's logits, bit for bit, do not
depend on how the step around it is shaped.

Why: greedy decoding with speculation must give the non-speculative tokens (issue #33).
Without speculation the token at position p is a one-token decode; with it, a row of a
1 + k verification; in a bucket it has padding rows beside it. With int8 activations (the
quantized models' default on CPU) one differing bit upstream can flip an activation's
rounding and grow, layer by layer, into another argmax, so the logits must be equal, not
close. The oracle is the one-token decode of the same sequence (its own step per token);
the other layouts (chunks of 1 + 3 as a verification runs them, decodes padded to a bucket of
8) must give the same bits at every position; float32 K/V pages, so that the attention's
bits reach the next layer unrounded. The model: SmolLM2-135M's
layer shapes (hidden 576: XLA summed a norm's squares in a bucket-dependent order at that
width, not at 96), 2 layers, GQA 3 (a 4-token chunk is a tall attention tile, one token a
short one), in int4 weights with int8 activations on the C++ dense kernel (float weights:
slow tier).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels_pallas import AttentionMetadata
from jaxserve.kernels_pallas.cpu_build import dense_isas
from jaxserve.models import paged, tiny
from jaxserve.models.packing import pack_params
from jaxserve.models.quant import WeightQuant
from jaxserve.models.quantized_params import quantize_params

PAGE, PAGES = 16, 4
PROMPT, NEW = 9, 8
CFG = tiny.tiny_config(vocab_size=211, hidden_size=576, intermediate_size=1536, num_heads=9,
                       num_kv_heads=3, head_dim=64, max_position_embeddings=256)


def _metadata(start: int, stop: int, t_pad: int) -> AttentionMetadata:
    """One sequence on pages 1..PAGES, new tokens [start, stop), padded to t_pad tokens
    (padding writes into the trash page 0)."""
    pos = np.arange(start, stop)
    slots = np.zeros(t_pad, np.int32)
    slots[:stop - start] = (1 + pos // PAGE) * PAGE + pos % PAGE
    return AttentionMetadata(
        slot_mapping=jnp.asarray(slots), block_tables=jnp.arange(1, PAGES + 1)[None].astype(
            jnp.int32), kv_lens=jnp.asarray([stop], jnp.int32),
        cu_q_lens=jnp.asarray([0, stop - start], jnp.int32), num_seqs=jnp.asarray([1], jnp.int32))


_step = jax.jit(paged.paged_forward, static_argnames=("cfg", "attn_impl"),
                donate_argnames=("kv_pages",))


def _logits(params, tokens: np.ndarray, chunk: int, t_pad: int | None) -> np.ndarray:
    """Logits of every position from PROMPT on: the prompt in one step, then the rest in
    steps of `chunk` tokens (each padded to t_pad tokens if given)."""
    kv = paged.init_kv_cache(CFG, 1 + PAGES, PAGE, jnp.float32)
    bounds = [0, PROMPT] + list(range(PROMPT + chunk, len(tokens), chunk)) + [len(tokens)]
    out = {}
    for start, stop in zip(bounds, bounds[1:]):
        n = stop - start
        t = n if t_pad is None or start == 0 else max(t_pad, n)
        ids = np.zeros(t, np.int32)
        ids[:n] = tokens[start:stop]
        pos = np.zeros(t, np.int32)
        pos[:n] = np.arange(start, stop)
        logits, kv = _step(params, kv, jnp.asarray(ids), jnp.asarray(pos),
                           _metadata(start, stop, t), jnp.arange(n, dtype=jnp.int32),
                           cfg=CFG, attn_impl="cpu")
        out.update({start + i: row for i, row in enumerate(np.asarray(logits))})
    return np.stack([out[p] for p in range(PROMPT - 1, len(tokens))])


@pytest.mark.parametrize("weights", [
    "int4, int8 activations",
    pytest.param("float32", marks=pytest.mark.slow(
        reason="float weights too (the default tier keeps the int8-activation model)"))])
def test_logits_do_not_depend_on_the_step_layout(weights: str) -> None:
    params = tiny.random_params(CFG, seed=3, scale=0.5)
    if weights == "float32":
        params = pack_params(params)
    else:
        if "avx512_vnni" not in dense_isas():
            pytest.skip("int8 activations need AVX-512 VNNI")
        q = quantize_params(params, WeightQuant("int4", group_size=32))
        params = pack_params(jax.tree.map(jnp.asarray, q), int8_activations="on")
    tokens = np.random.default_rng(0).integers(3, CFG.vocab_size, PROMPT + NEW)
    want = _logits(params, tokens, 1, None)
    assert np.isfinite(want).all()
    for chunk, t_pad in ((4, None), (1, 8)):
        got = _logits(params, tokens, chunk, t_pad)
        diff = np.abs(got - want).max()
        assert np.array_equal(got, want), (
            f"chunks of {chunk} padded to {t_pad}: logits differ by up to {diff}")

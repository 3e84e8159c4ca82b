"""Test oracle: a plain batched generation loop over a contiguous KV cache.

It shares only the model's layer math with the engine (no pages, no scheduler, no ragged
batches), so the engine's greedy output is checked against it.

Data flow: prompts (token ids) -> right-padded to a power-of-two bucket -> one jitted
`cached_step` writes the prompt's K/V into a contiguous cache `[L, B, S, Hkv, D]` and returns
the logits of each row's last prompt token -> `sample` -> then one `cached_step` per new token
(T = 1) until every row hit EOS or `max_new_tokens`. The cache is donated to each step so XLA
updates it in place.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxserve.models.config import ModelConfig
from jaxserve.models.blocks import causal_mask, embed, lm_logits, masked_attention
from jaxserve.models.config import LayerSpec
from jaxserve.models.decoder import run_layers
from jaxserve.models.llama import LlamaParams


@struct.dataclass
class KVCache:
    """Contiguous per-row cache; slot s of row b holds the K/V of position s."""

    k: jax.Array  # f[L, B, S, Hkv, D]
    v: jax.Array  # f[L, B, S, Hkv, D]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: jnp.dtype) -> KVCache:
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def cached_step(params: LlamaParams, cache: KVCache, tokens: jax.Array, positions: jax.Array,
                last_index: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, KVCache]:
    """Run T new tokens per row against the cache.

    tokens, positions: i32[B, T]; last_index: i32[B] (which of the T tokens to return logits
    for). Returns (f32[B, vocab] logits, updated cache). Slots past a row's real length may hold
    padding K/V; they are masked causally and overwritten before they become visible.
    """
    B, T = tokens.shape
    S = cache.k.shape[2]
    rows = jnp.arange(B)[:, None]
    k_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))

    def attn(q: jax.Array, k: jax.Array, v: jax.Array, state: tuple[jax.Array, jax.Array],
             spec: LayerSpec) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        ck, cv = state
        ck = ck.at[rows, positions].set(k.astype(ck.dtype), mode="drop")
        cv = cv.at[rows, positions].set(v.astype(cv.dtype), mode="drop")
        mask = causal_mask(positions, k_pos, jnp.ones((B, S), bool), spec.sliding_window)
        return masked_attention(q, ck, cv, mask, spec.query_scale, spec.soft_cap), (ck, cv)

    x = embed(params, tokens, cfg.embed_scale)
    x, (new_k, new_v) = run_layers(cfg, params.layers, x, positions, attn, (cache.k, cache.v))
    last = x[jnp.arange(B), last_index]
    return lm_logits(cfg, params, last), KVCache(k=new_k, v=new_v)


def sample(logits: jax.Array, temperature: jax.Array, key: jax.Array) -> jax.Array:
    """Greedy where temperature == 0, else a draw from softmax(logits / T). -> i32[B]."""
    greedy = jnp.argmax(logits, axis=-1)
    safe_t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    drawn = jax.random.categorical(key, logits / safe_t, axis=-1)
    return jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)


def _step_and_sample(params: LlamaParams, cache: KVCache, tokens: jax.Array,
                     positions: jax.Array, last_index: jax.Array, temperature: jax.Array,
                     key: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, KVCache]:
    logits, cache = cached_step(params, cache, tokens, positions, last_index, cfg)
    return sample(logits, temperature, key), cache


_step_jit = jax.jit(_step_and_sample, static_argnames=("cfg",), donate_argnames=("cache",))


def _bucket(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << (n - 1).bit_length())


def generate(params: LlamaParams, cfg: ModelConfig, prompts: Sequence[Sequence[int]],
             max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
             stop_token_ids: Sequence[int] = (),
             on_tokens: Callable[[np.ndarray], None] | None = None) -> list[list[int]]:
    """Generate up to `max_new_tokens` per prompt; a row stops after a stop token (included).

    `on_tokens` receives each step's sampled ids (i64[B]) as they arrive, for streaming.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token id lists")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if not (temperature >= 0 and np.isfinite(temperature)):
        raise ValueError(f"temperature={temperature} must be a finite number >= 0")
    lens = np.array([len(p) for p in prompts], np.int32)
    total = int(lens.max()) + max_new_tokens
    if total > cfg.max_position_embeddings:
        raise ValueError(
            f"prompt ({int(lens.max())} tokens) + max_new_tokens ({max_new_tokens}) = {total} "
            f"exceeds the model's max_position_embeddings={cfg.max_position_embeddings}")
    for p in prompts:
        bad = [t for t in p if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
    B = len(prompts)
    T = _bucket(int(lens.max()))
    S = min(_bucket(total, 128), max(cfg.max_position_embeddings, T))
    S = max(S, T)
    cache = init_cache(cfg, B, S, params.final_norm.dtype)
    tokens = np.zeros((B, T), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = p
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    temp = jnp.full((B,), temperature, jnp.float32)
    key = jax.random.key(seed)
    stop = set(int(t) for t in stop_token_ids)

    outputs: list[list[int]] = [[] for _ in range(B)]
    done = np.zeros(B, bool)
    key, sub = jax.random.split(key)
    next_ids, cache = _step_jit(params, cache, jnp.asarray(tokens), jnp.asarray(positions),
                                jnp.asarray(lens - 1), temp, sub, cfg=cfg)
    pos = lens.copy()
    for step in range(max_new_tokens):
        ids = np.asarray(next_ids)
        for b in np.flatnonzero(~done):
            outputs[b].append(int(ids[b]))
            if int(ids[b]) in stop:
                done[b] = True
        if on_tokens is not None:
            on_tokens(ids)
        if done.all() or step == max_new_tokens - 1:
            break
        key, sub = jax.random.split(key)
        next_ids, cache = _step_jit(params, cache, jnp.asarray(ids[:, None].astype(np.int32)),
                                    jnp.asarray(pos[:, None]), jnp.zeros((B,), jnp.int32),
                                    temp, sub, cfg=cfg)
        pos = pos + 1
    return outputs

"""The contiguous-cache generation loop vs a plain full-sequence greedy rollout."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.cached_generate import generate

from jaxserve.models import decoder, llama, tiny
from jaxserve.models.config import ModelConfig


def tiny_config(**overrides: object) -> ModelConfig:
    """The test model's shape (`tiny.TEST_SHAPE`) with a smaller vocabulary and context and no
    special token ids."""
    return tiny.tiny_config(**(tiny.TEST_SHAPE | {
        "vocab_size": 97, "max_position_embeddings": 128, "bos_token_id": None,
        "eos_token_ids": ()} | overrides))


def rollout(params: llama.LlamaParams, cfg: ModelConfig, prompt: list[int], n: int) -> list[int]:
    """Oracle: re-run the whole sequence each step and take the argmax of the last logits.
    The sequence is right-padded to one power-of-two length (causal: the padding cannot
    reach the last real position): one compile per rollout, not one per step."""
    seq = list(prompt)
    T = 1 << (len(prompt) + n - 1).bit_length()
    for _ in range(n):
        tokens = np.zeros((1, T), np.int32)
        tokens[0, :len(seq)] = seq
        logits = decoder.forward_jit(params, jnp.asarray(tokens),
                                     jnp.asarray([len(seq)], jnp.int32), cfg=cfg)
        seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
    return seq[len(prompt):]


@pytest.mark.parametrize("overrides", [{}, {"sliding_window": 6, "model_type": "mistral"},
                                       {"model_type": "qwen3", "qk_norm": True}])
def test_greedy_matches_full_sequence_rollout(overrides: dict) -> None:
    cfg = tiny_config(**overrides)
    params = llama.init_random_params(cfg, jax.random.key(1), scale=0.3)
    prompts = [[5, 9, 13, 2, 77, 31, 4], [8], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 3, 19]]
    got = generate(params, cfg, prompts, max_new_tokens=12)
    for p, g in zip(prompts, got):
        assert g == rollout(params, cfg, p, 12)


def test_stop_token_ends_row_and_is_included() -> None:
    cfg = tiny_config()
    params = llama.init_random_params(cfg, jax.random.key(2), scale=0.3)
    free = generate(params, cfg, [[1, 2, 3]], max_new_tokens=10)[0]
    stop = free[3]
    first = free.index(stop)
    got = generate(params, cfg, [[1, 2, 3]], max_new_tokens=10, stop_token_ids=[stop])
    assert got[0] == free[: first + 1]


def test_sampling_is_seeded() -> None:
    cfg = tiny_config()
    params = llama.init_random_params(cfg, jax.random.key(3), scale=0.3)
    a = generate(params, cfg, [[1, 2, 3]], 16, temperature=1.0, seed=7)
    b = generate(params, cfg, [[1, 2, 3]], 16, temperature=1.0, seed=7)
    c = generate(params, cfg, [[1, 2, 3]], 16, temperature=1.0, seed=8)
    assert a == b
    assert a != c


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompts=[[]], max_new_tokens=4), "non-empty"),
    (dict(prompts=[[1]], max_new_tokens=0), "max_new_tokens"),
    (dict(prompts=[[1]], max_new_tokens=4, temperature=-1.0), "temperature"),
    (dict(prompts=[[1]], max_new_tokens=4, temperature=float("nan")), "temperature"),
    (dict(prompts=[[1, 500]], max_new_tokens=4), "vocabulary"),
    (dict(prompts=[[1] * 120], max_new_tokens=20), "max_position_embeddings"),
])
def test_bad_input_raises_value_error(kwargs: dict, match: str) -> None:
    cfg = tiny_config()
    params = llama.init_random_params(cfg, jax.random.key(0))
    with pytest.raises(ValueError, match=match):
        generate(params, cfg, **kwargs)

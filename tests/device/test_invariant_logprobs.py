"""`blocks.log_softmax(invariant=True)` (batch-invariant mode) keeps a row's logprobs' bits
whatever the number of rows; the default (`jax.nn.log_softmax`) does not in the prompt
logprobs pass, where XLA:CPU fuses it with the LM head.

Oracle: each position scored alone (one position, a 16-token bucket); then the same
positions scored 42 at a time in a 64-token bucket (one [64, vocab] chunk), as a step that
scores several prompts at once runs them. The tiny test model, packed for the C++ dense
kernel as the engine runs it on CPU (its LM head is row invariant on its own).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from support.engine_fixtures import tiny_model

from jaxserve.device.prompt_logprobs import PromptLogprobsInputs, prompt_logprobs
from jaxserve.models.blocks import log_softmax
from jaxserve.models.packing import pack_params

N = 42


def _scored(invariant: bool) -> tuple[np.ndarray, np.ndarray]:
    m = tiny_model()
    params = pack_params(m.params)
    hidden = np.random.default_rng(0).normal(size=(64, m.config.hidden_size)).astype(
        np.float32)
    run = jax.jit(lambda h, i: prompt_logprobs(params, h, i, m.config, invariant))

    def score(T: int, rows: np.ndarray) -> np.ndarray:
        idx = np.zeros(T, np.int32)
        idx[:len(rows)] = rows
        inputs = PromptLogprobsInputs(jnp.asarray(idx), jnp.full(T, 5, jnp.int32),
                                      jnp.asarray([len(rows)], jnp.int32))
        out = run(jnp.asarray(hidden[:T] if T <= 16 else hidden), inputs)
        return np.concatenate([np.asarray(out.logprob)[:, None],
                               np.asarray(out.top_logprobs)], axis=1)[:len(rows)]

    alone = np.concatenate([score(16, np.array([i % 16])) for i in range(N)])
    together = score(64, np.arange(N) % 16)
    return alone, together


def test_invariant_prompt_logprobs_do_not_depend_on_the_rows() -> None:
    alone, together = _scored(invariant=True)
    assert np.array_equal(alone, together)


def test_default_prompt_logprobs_depend_on_the_rows() -> None:
    """What the mode changes (if this starts passing, XLA changed: update
    docs/batch-invariance.md, which says the default differs)."""
    alone, together = _scored(invariant=False)
    assert not np.array_equal(alone, together)
    np.testing.assert_allclose(alone, together, rtol=0, atol=1e-5)


def test_invariant_log_softmax_is_log_softmax() -> None:
    x = np.random.default_rng(1).normal(size=(5, 211)).astype(np.float32) * 4
    got = np.asarray(log_softmax(jnp.asarray(x), invariant=True))
    np.testing.assert_allclose(got, np.asarray(jax.nn.log_softmax(x, axis=-1)), rtol=0,
                               atol=2e-6)

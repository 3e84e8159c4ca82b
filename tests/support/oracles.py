"""Independent oracles shared by tests in several layers."""

from __future__ import annotations

import numpy as np
from support.engine_fixtures import tiny_model

from jaxserve.models import decoder
from jaxserve.models.loading import LoadedModel


def oracle(prompt: list[int], k: int, model: LoadedModel | None = None
           ) -> list[dict | None]:
    """Prompt logprobs from the full-sequence forward of `model` (default: the tiny one)."""
    model = model or tiny_model()
    T = 1 << (len(prompt) - 1).bit_length()
    tokens = np.zeros((1, T), np.int32)
    tokens[0, : len(prompt)] = prompt
    logits = np.asarray(decoder.forward_jit(model.params, tokens, np.array([len(prompt)], np.int32),
                                            cfg=model.config))[0].astype(np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1,
                                                                                keepdims=True)) \
        - logits.max(-1, keepdims=True)
    want: list[dict | None] = [None]
    for j in range(len(prompt) - 1):
        entry = {prompt[j + 1]: logp[j, prompt[j + 1]]}
        for t in np.argsort(-logp[j])[:k].tolist():
            entry.setdefault(t, logp[j, t])
        want.append(entry)
    return want

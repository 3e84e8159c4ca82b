"""Tiny random-weight models wrapped as LoadedModels, and engines over them, for engine tests.

The models come from the package's one factory, `jaxserve.models.tiny`, at the test suite's
shape (`TEST_SHAPE`: vocabulary VOCAB = 211, hidden 32) and init scale (`TEST_INIT_SCALE`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import subprocess
import sys

import numpy as np

from support.numerics import model_logprob_atol
from support.tiers import run_slow  # noqa: F401 - re-exported for the workers

from jaxserve.config import EngineConfig
from jaxserve.engine.batch import default_buckets
from jaxserve.engine.engine import Engine
from jaxserve.engine.outputs import RequestOutput
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.models import decoder, tiny
from jaxserve.models.config import ModelConfig
from jaxserve.models.loading import LoadedModel
from jaxserve.models.tokenizer import Tokenizer
from jaxserve.serving.build import build_engine

VOCAB = tiny.TEST_SHAPE["vocab_size"]  # 211

# Token buckets of the device workers' default runs (tp_worker, dp_worker, ...): a decode
# bucket and the whole step of max_num_batched_tokens=64. Warmup compiles each bucket several
# times (its forward, the sampler variants, the prompt logprobs pass): 7 compiles instead of
# the default powers of two's 26, and compiles are most of those runs' time on CPU. The full
# grids (JAXSERVE_RUN_SLOW=1) keep the default buckets.
FEW_TOKEN_BUCKETS = (8, 64)


def few_token_buckets(budget: int) -> tuple[int, ...]:
    """FEW_TOKEN_BUCKETS' rule at another step budget: a decode bucket of 8 and the whole
    step (just the step when it is 8 tokens or fewer). For tests whose oracle (a model's
    greedy, a family's logits) does not depend on the bucket set: each bucket is a whole-model
    compile (~4 s of a tiny model's warmup on the 2-core CPU)."""
    return (8, budget) if budget > 8 else (budget,)


def tiny_model_config(**overrides: object) -> ModelConfig:
    """The test model's config: `tiny.tiny_config(**TEST_SHAPE)`, then `overrides`."""
    return tiny.tiny_config(**(tiny.TEST_SHAPE | overrides))


@functools.lru_cache(maxsize=None)
def tiny_tokenizer() -> Tokenizer:
    """The word tokenizer over VOCAB ids (one per test process)."""
    return tiny.word_tokenizer(VOCAB)


@functools.lru_cache(maxsize=None)
def tiny_model(seed: int = 0, **overrides: object) -> LoadedModel:
    """`tiny_model_config(**overrides)` with random float32 weights at TEST_INIT_SCALE (large:
    sharp distributions, so greedy argmaxes are far from ties)."""
    return tiny.random_model(tiny_model_config(**overrides), seed=seed,
                             scale=tiny.TEST_INIT_SCALE, tokenizer=tiny_tokenizer())


@functools.cache
def tiny_logprob_atol(context_len: int = 256, seed: int = 0) -> float:
    """The bound two runs of the test model (`tiny_model(seed)`) in different layouts keep
    their logprobs within (batch neighbours, buckets, prefill chunks, TP, another process):
    support.numerics.model_logprob_atol over `context_len` positions (default: tiny_engine's
    max_model_len)."""
    m = tiny_model(seed)
    return model_logprob_atol(m.config, m.params, context_len)


def mixed_layer_model(tokenizer: Tokenizer | None = None, **overrides: object) -> LoadedModel:
    """The test model (`overrides` as tiny_model's) with four layers of three specs: two
    sliding-window layers (window 5), a global one with its own rope base and a soft-cap,
    one more local: what the engine's step runs as data (one scan per group of equal spec),
    handing each layer's window and soft-cap to the attention kernel."""
    cfg = tiny_model_config(**({"num_layers": 4} | overrides))
    u = cfg.uniform_spec()
    local = dataclasses.replace(u, sliding_window=5)
    glob = dataclasses.replace(u, rope_theta=1e6, soft_cap=2.0)
    cfg = dataclasses.replace(cfg, per_layer=(local, local, glob, local))
    return tiny.random_model(cfg, seed=1, scale=tiny.TEST_INIT_SCALE,
                             tokenizer=tokenizer or tiny_tokenizer())


def tiny_engine(model: LoadedModel | None = None, warmup: bool = True,
                **cfg: object) -> Engine:
    base = dict(max_num_seqs=8, max_num_batched_tokens=64, page_size=8,
                kv_cache_memory=None, max_model_len=256, attention_impl="reference")
    base.update(cfg)
    if "token_buckets" not in cfg:
        # Powers of two: every compiled shape is a whole-model compile, and what these tests
        # check (outputs against oracles) does not depend on the bucket set; the default set
        # is tested in test_buckets, test_llm_api and test_logit_bias.
        budget = base["max_num_batched_tokens"]
        assert isinstance(budget, int)
        base["token_buckets"] = default_buckets(budget, 1)
    config = EngineConfig(**base)  # type: ignore[arg-type]
    return build_engine(config, model or tiny_model(), warmup=warmup, progress=False)


def run_checked(eng: Engine, prompts: list[list[int]], params: list[SamplingParams]
                ) -> dict[str, RequestOutput]:
    """Requests "r0", "r1", ... stepped to the end -> their final outputs; asserts that no KV
    page leaked and nothing compiled after warmup (the guard counts the whole process's
    compiles: run oracles after this, not before)."""
    compiles = eng.runner.compiles_after_warmup
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
    finals = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out
    alloc = eng.scheduler.allocator
    assert alloc.num_free_pages == alloc.num_usable_pages, "KV pages leaked"
    assert eng.runner.compiles_after_warmup == compiles, "compiled after warmup"
    return finals


def rollout(model: LoadedModel, prompt: list[int], n: int) -> list[int]:
    """Oracle: greedy decoding with the plain full-sequence forward (no cache, no pages)."""
    seq = list(prompt)
    T = 1 << (len(prompt) + n - 1).bit_length()  # one compile per power of two
    for _ in range(n):
        tokens = np.zeros((1, T), np.int32)
        tokens[0, : len(seq)] = seq
        logits = decoder.forward_jit(model.params, tokens, np.array([len(seq)], np.int32),
                                     cfg=model.config)
        seq.append(int(np.argmax(np.asarray(logits[0, len(seq) - 1]))))
    return seq[len(prompt):]


def device_count_flags(num_devices: int) -> str:
    """XLA_FLAGS for a subprocess with `num_devices` virtual CPU devices: the session's flags
    (conftest's) and the device count."""
    return f"{os.environ.get('XLA_FLAGS', '')} " \
        f"--xla_force_host_platform_device_count={num_devices}".strip()


def run_device_worker(script: str, num_devices: int = 8, args: tuple[str, ...] = ()) -> dict:
    """Run tests/support/workers/SCRIPT (with `args`) in a subprocess with `num_devices`
    virtual CPU devices (the count is fixed when jax starts, so multi-device engines cannot
    run in the test process) and return the JSON document it prints."""
    tests_dir = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, XLA_FLAGS=device_count_flags(num_devices),
               JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(tests_dir), os.environ.get(
                   "PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(tests_dir / "support" / "workers" / script),
                          *args],
                         env=env, cwd=tests_dir.parent,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)

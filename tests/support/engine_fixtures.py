"""Tiny random-weight models wrapped as LoadedModels, and engines over them, for engine tests."""

from __future__ import annotations

import functools
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from support.hf_models import save_tiny_tokenizer

from jaxserve.config import EngineConfig
from jaxserve.engine.batch import default_buckets
from jaxserve.engine.engine import Engine
from jaxserve.models import llama
from jaxserve.models.config import ModelConfig
from jaxserve.models.loading import LoadedModel
from jaxserve.models.tokenizer import Tokenizer
from jaxserve.serving.build import build_engine

VOCAB = 211

# Token buckets of the device workers' default runs (tp_worker, dp_worker, ...): a decode
# bucket and the whole step of max_num_batched_tokens=64. Warmup compiles each bucket several
# times (its forward, the sampler variants, the prompt logprobs pass): 7 compiles instead of
# the default powers of two's 26, and compiles are most of those runs' time on CPU. The full
# grids (JAXSERVE_RUN_SLOW=1) keep the default buckets.
FEW_TOKEN_BUCKETS = (8, 64)


def run_slow() -> bool:
    """JAXSERVE_RUN_SLOW=1 (conftest's switch): the device workers then run their full grids;
    they inherit the variable from the test process."""
    return os.environ.get("JAXSERVE_RUN_SLOW") == "1"


def tiny_model_config(**overrides: object) -> ModelConfig:
    base = dict(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5,
                rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=False,
                attention_bias=False, qk_norm=False, bos_token_id=1, eos_token_ids=(2,))
    base.update(overrides)
    return ModelConfig(**base)  # type: ignore[arg-type]


@functools.lru_cache(maxsize=None)
def tiny_tokenizer() -> Tokenizer:
    d = pathlib.Path(tempfile.mkdtemp(prefix="jaxserve-tok-"))
    save_tiny_tokenizer(d, VOCAB)
    return Tokenizer.from_hf_dir(d)


@functools.lru_cache(maxsize=None)
def tiny_model(seed: int = 0, **overrides: object) -> LoadedModel:
    cfg = tiny_model_config(**overrides)
    # Large init scale: sharp distributions, so greedy argmaxes are far from ties.
    params = llama.init_random_params(cfg, jax.random.key(seed), jnp.float32, scale=0.5)
    return LoadedModel(config=cfg, params=params, tokenizer=tiny_tokenizer(),
                       source=pathlib.Path("tiny"), format="hf")


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


def rollout(model: LoadedModel, prompt: list[int], n: int) -> list[int]:
    """Oracle: greedy decoding with the plain full-sequence forward (no cache, no pages)."""
    seq = list(prompt)
    T = 1 << (len(prompt) + n - 1).bit_length()  # one compile per power of two
    for _ in range(n):
        tokens = np.zeros((1, T), np.int32)
        tokens[0, : len(seq)] = seq
        logits = llama.forward_jit(model.params, tokens, np.array([len(seq)], np.int32),
                                   cfg=model.config)
        seq.append(int(np.argmax(np.asarray(logits[0, len(seq) - 1]))))
    return seq[len(prompt):]


def run_device_worker(script: str, num_devices: int = 8) -> dict:
    """Run tests/support/workers/SCRIPT in a subprocess with `num_devices` virtual CPU devices
    (the count is fixed when jax starts, so multi-device engines cannot run in the test
    process) and return the JSON document it prints."""
    tests_dir = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={num_devices}",
               JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(tests_dir), os.environ.get(
                   "PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(tests_dir / "support" / "workers" / script)],
                         env=env, cwd=tests_dir.parent,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)

"""`SpeculativeConfig` (jaxserve/spec_config.py): vLLM's keys, defaults and rules, and every
key this engine does not honour refused by its name.

The expected defaults are vLLM's as its vllm/config/speculative.py states them (neither
prompt_lookup bound given: both 5; one given: the other copies it; disable_by_batch_size >= 2),
written out here as literals rather than read from the module under test.
"""

from __future__ import annotations

import json

import pytest

from jaxserve.config import SpeculativeConfig
from jaxserve import spec_config


def test_reexported_from_config() -> None:
    assert SpeculativeConfig is spec_config.SpeculativeConfig


@pytest.mark.parametrize("given,want", [
    ({}, (5, 5)),
    ({"prompt_lookup_max": 3}, (3, 3)),
    ({"prompt_lookup_min": 4}, (4, 4)),
    ({"prompt_lookup_min": 2, "prompt_lookup_max": 5}, (2, 5)),
    ({"prompt_lookup_min": 1, "prompt_lookup_max": 1}, (1, 1)),
])
def test_ngram_prompt_lookup_defaults(given, want) -> None:
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, **given})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == want
    assert c.model is None and c.disable_by_batch_size is None


def test_from_json_all_methods() -> None:
    c = SpeculativeConfig.from_json('{"method": "eagle3", "num_speculative_tokens": 5, '
                                    '"model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", '
                                    '"draft_tensor_parallel_size": 1, '
                                    '"disable_by_batch_size": 32}')
    assert (c.method, c.num_speculative_tokens, c.disable_by_batch_size) == ("eagle3", 5, 32)
    assert c.prompt_lookup_min is None and c.prompt_lookup_max is None
    c.check_target(1)
    c.check_target(2)  # 1: the head runs whole on each of the target's devices
    d = SpeculativeConfig.from_dict({"method": "draft_model", "model": "/m",
                                     "num_speculative_tokens": 1})
    assert d.model == "/m" and d.draft_tensor_parallel_size is None
    d.check_target(1)
    d.check_target(4)  # None: not split (replicated over the target's mesh)
    split = SpeculativeConfig("draft_model", 1, model="/m", draft_tensor_parallel_size=4)
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=4: the draft is not split"):
        split.check_target(4)
    # Frozen, hashable, equal by value.
    assert d == SpeculativeConfig("draft_model", 1, model="/m") and hash(d)
    with pytest.raises(Exception):
        d.method = "ngram"  # type: ignore[misc]


@pytest.mark.parametrize("data,match", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
    ({"method": "ngram", "num_speculative_tokens": 17}, r"num_speculative_tokens=17.*\[1, 16\]"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens=True"),
    ({"method": "ngram", "num_speculative_tokens": "5"}, "num_speculative_tokens='5'"),
    ({"method": "ngram", "num_speculative_tokens": 2.0}, "num_speculative_tokens=2.0"),
    ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
    ({"num_speculative_tokens": 2}, "needs 'method'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 3}, "prompt_lookup_min=4 must be <= prompt_lookup_max=3"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
     "prompt_lookup_min=0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": -1},
     "prompt_lookup_max=-1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model='x' is for"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1},
     "draft_tensor_parallel_size=1 is for"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs model"),
    ({"method": "eagle3", "num_speculative_tokens": 2, "model": ""}, "needs model"),
    ({"method": "eagle3", "num_speculative_tokens": 2, "model": 3}, "needs model"),
    ({"method": "eagle3", "num_speculative_tokens": 2, "model": "m", "prompt_lookup_max": 3},
     "prompt_lookup_max is for method 'ngram'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1},
     "disable_by_batch_size=1 must be an integer >= 2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 8.5},
     "disable_by_batch_size=8.5"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "m",
      "draft_tensor_parallel_size": 0}, "draft_tensor_parallel_size=0"),
    ({"method": "lookahead", "num_speculative_tokens": 2}, "method='lookahead' is unknown"),
    ({"method": None, "num_speculative_tokens": 2}, "method=None must be one of"),
])
def test_bad_values_are_refused_by_name(data, match) -> None:
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(data)


@pytest.mark.parametrize("method", ["eagle", "medusa", "mtp", "suffix", "mlp_speculator",
                                    "deepseek_mtp", "qwen3_next_mtp", "ngram_gpu"])
def test_other_vllm_methods_refused_as_unsupported(method) -> None:
    with pytest.raises(ValueError, match=f"method='{method}' is not supported here"):
        SpeculativeConfig.from_dict({"method": method, "num_speculative_tokens": 2,
                                     "model": "m"})


BASE = {"method": "draft_model", "num_speculative_tokens": 3, "model": "m"}


@pytest.mark.parametrize("key,ok", [
    ("acceptance_method", "rejection_sampler"),
    ("rejection_sample_method", "standard"),
    ("draft_sample_method", "greedy"),
    ("enforce_eager", False),
    ("disable_logprobs", False),
])
def test_keys_honoured_only_at_our_value(key, ok) -> None:
    assert SpeculativeConfig.from_dict({**BASE, key: ok}) == SpeculativeConfig.from_dict(BASE)
    assert SpeculativeConfig.from_dict({**BASE, key: None}) == SpeculativeConfig.from_dict(BASE)
    bad = {"rejection_sampler": "typical_acceptance_sampler", "standard": "block",
           "greedy": "probabilistic", False: True}[ok]
    with pytest.raises(ValueError, match=f"{key}={bad!r} is not supported"):
        SpeculativeConfig.from_dict({**BASE, key: bad})


@pytest.mark.parametrize("key", ["quantization", "max_model_len", "tensor_parallel_size",
                                 "kv_cache_dtype", "revision", "posterior_threshold",
                                 "speculative_token_tree", "parallel_drafting",
                                 "num_speculative_tokens_per_batch_size"])
def test_vllm_keys_we_do_not_honour_are_refused_by_name(key) -> None:
    with pytest.raises(ValueError, match=f"key '{key}' is not supported here"):
        SpeculativeConfig.from_dict({**BASE, key: 1})


def test_unknown_keys_and_bad_json() -> None:
    with pytest.raises(ValueError, match="key 'num_spec_tokens' is unknown"):
        SpeculativeConfig.from_dict({**BASE, "num_spec_tokens": 3})
    with pytest.raises(ValueError, match="not valid JSON"):
        SpeculativeConfig.from_json('{"method": "ngram",')
    with pytest.raises(ValueError, match="must be an object"):
        SpeculativeConfig.from_json('[1, 2]')
    with pytest.raises(ValueError, match="must be JSON text"):
        SpeculativeConfig.from_json({"method": "ngram"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be a string"):
        SpeculativeConfig.from_dict({1: 2})


def test_error_messages_are_bounded() -> None:
    huge = "x" * 100_000
    for data in ({**BASE, huge: 1}, {**BASE, "method": huge},
                 {"method": "ngram", "num_speculative_tokens": [0] * 50_000}):
        with pytest.raises(ValueError) as e:
            SpeculativeConfig.from_dict(data)
        assert len(str(e.value)) < 400
    with pytest.raises(ValueError) as e:
        SpeculativeConfig.from_json(json.dumps(BASE)[:-1] + huge)
    assert len(str(e.value)) < 400

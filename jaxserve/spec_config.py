"""Speculative decoding settings: the frozen `SpeculativeConfig` and its parser.

A user writes vLLM's `--speculative-config '{"method": "ngram", "num_speculative_tokens": 5}'`
(or `LLM(speculative_config={...})`); `SpeculativeConfig.from_json` / `from_dict` turn that
text or mapping into this frozen section, refusing what this engine does not do by the key's
name, and the engine reads it from there (issue 33). It sits in the config layer beside
`jaxserve.config` (which re-exports it) and imports nothing else of jaxserve.

Keys and meanings are vLLM's (vllm/config/speculative.py):
- `method`: "ngram" (prompt lookup: the last n tokens matched against the prompt and the
  output so far), "draft_model" (a smaller model with the same tokenizer) or "eagle3" (an
  EAGLE-3 head fed the target's hidden states). vLLM's other methods are refused by name.
- `num_speculative_tokens` k: tokens proposed per step, 1..MAX_NUM_SPECULATIVE_TOKENS.
- `prompt_lookup_min` / `prompt_lookup_max` (ngram only): the n-gram lengths tried. vLLM's
  rule: neither given -> both 5; one given -> the other takes its value; min <= max.
- `model` (draft_model / eagle3: required; ngram: refused): the draft or head checkpoint.
- `disable_by_batch_size`: a step with this many running sequences or more does not
  speculate (vLLM's `>=`; at least 2, as vLLM requires). None: always speculate.
- `draft_tensor_parallel_size` (draft_model / eagle3): the draft is not split (it runs whole
  on each of the target's devices), so the only value honoured is 1 (`check_target`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

METHODS = ("ngram", "draft_model", "eagle3")
# Each speculating sequence is a (k+1)-token query in the step, so k spends the token budget
# k times over; past ~10 proposals the chance that all earlier ones were accepted is small for
# every method (EAGLE-3's reported acceptance lengths are 3-6.5 at k=7-8), and 16 keeps the
# per-row arrays small.
MAX_NUM_SPECULATIVE_TOKENS = 16
PROMPT_LOOKUP_DEFAULT = 5  # vLLM's n when neither prompt_lookup_min nor _max is given
_REPR_LIMIT = 60  # characters of a bad value quoted in an error

# vLLM's other methods: named so the error says "not supported here", not "unknown".
UNSUPPORTED_METHODS = ("eagle", "medusa", "mlp_speculator", "mtp", "deepseek_mtp", "suffix",
                       "ngram_gpu", "custom_class", "extract_hidden_states", "dflash", "dspark",
                       "[ngram]")

# vLLM keys that are honoured only at the value that describes what this engine does anyway
# (a user copying a vLLM config may spell the default out) or None; any other value is refused.
_ONLY_VALUE = {
    "acceptance_method": ("rejection_sampler", "acceptance is the standard rejection-sampling "
                          "rule (typical acceptance is not supported)"),
    "rejection_sample_method": ("standard", "acceptance is the standard rejection-sampling "
                                "rule"),
    "draft_sample_method": ("greedy", "draft_model / eagle3 propose their argmax token (the "
                            "proposal is one-hot in the acceptance rule)"),
    "enforce_eager": (False, "JAX always runs the compiled step; there is no eager mode"),
    "disable_logprobs": (False, "logprobs of accepted tokens are always the target's exact "
                         "ones"),
}

# vLLM keys refused whatever their value, with the reason the error gives.
_REFUSED = {
    "tensor_parallel_size": "pass draft_tensor_parallel_size (vLLM's name for the draft's TP)",
    "quantization": "a separate weight format for the draft is not supported",
    "kv_cache_dtype": "a separate KV cache dtype for the draft is not supported",
    "max_model_len": "a separate max_model_len for the draft is not supported",
    "revision": "pass a local path or a pinned model id as model",
    "code_revision": "no remote code is run",
    "posterior_threshold": "typical acceptance is not supported",
    "posterior_alpha": "typical acceptance is not supported",
    "disable_mqa_scorer": "vLLM v0 only; verification is always one ragged step",
    "speculative_token_tree": "tree speculation is not supported",
    "parallel_drafting": "drafts are proposed one token at a time",
    "num_speculative_tokens_per_batch_size": "one k for every batch size (see "
                                             "disable_by_batch_size)",
    "synthetic_acceptance_rates": "synthetic acceptance is not supported",
    "synthetic_acceptance_length": "synthetic acceptance is not supported",
    "disable_padded_drafter_batch": "vLLM GPU kernels only",
    "attention_backend": "a separate attention kernel for the draft is not supported",
    "moe_backend": "a separate MoE kernel for the draft is not supported",
    "use_local_argmax_reduction": "not supported",
    "use_heterogeneous_vocab": "the draft must share the target's tokenizer",
    "draft_load_config": "a separate load config for the draft is not supported",
    "suffix_decoding_max_tree_depth": "method 'suffix' is not supported",
    "suffix_decoding_max_cached_requests": "method 'suffix' is not supported",
    "suffix_decoding_max_spec_factor": "method 'suffix' is not supported",
    "suffix_decoding_min_token_prob": "method 'suffix' is not supported",
}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _REPR_LIMIT else text[:_REPR_LIMIT - 3] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """How (and whether) the engine speculates; the module docstring gives each key's rule."""

    method: str
    num_speculative_tokens: int
    model: str | None = None
    # None here means "not given": __post_init__ fills vLLM's defaults for ngram.
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int | None = None
    draft_tensor_parallel_size: int | None = None

    def __post_init__(self) -> None:
        m = self.method
        if not isinstance(m, str):
            raise ValueError(f"speculative method={_short(m)} must be one of {METHODS}")
        if m in UNSUPPORTED_METHODS or m.endswith("_mtp"):
            raise ValueError(f"speculative method={m!r} is not supported here; choose one of "
                             f"{METHODS}")
        if m not in METHODS:
            raise ValueError(f"speculative method={_short(m)} is unknown; choose one of "
                             f"{METHODS}")
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_NUM_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens={_short(k)} must be an integer in "
                             f"[1, {MAX_NUM_SPECULATIVE_TOKENS}]")
        for name in ("prompt_lookup_min", "prompt_lookup_max", "draft_tensor_parallel_size"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 1):
                raise ValueError(f"{name}={_short(v)} must be a positive integer")
        d = self.disable_by_batch_size
        if d is not None and (not _is_int(d) or d < 2):
            raise ValueError(f"disable_by_batch_size={_short(d)} must be an integer >= 2 "
                             "(speculation is off in steps with this many running sequences "
                             "or more) or None")
        if m == "ngram":
            self._check_ngram()
        else:
            self._check_model_method()

    def _check_ngram(self) -> None:
        for name in ("model", "draft_tensor_parallel_size"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name}={_short(getattr(self, name))} is for draft_model / "
                                 "eagle3; method 'ngram' proposes from the sequence itself")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = PROMPT_LOOKUP_DEFAULT
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        if lo > hi:
            raise ValueError(f"prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        # Frozen: the resolved defaults are written once, here.
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    def _check_model_method(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"method {self.method!r} needs model (the "
                             f"{'draft model' if self.method == 'draft_model' else 'EAGLE-3 head'}"
                             f" checkpoint: a path or a model id); got {_short(self.model)}")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} is for method 'ngram', not {self.method!r}")

    def check_target(self, tensor_parallel_size: int) -> None:
        """Refuse a draft_tensor_parallel_size other than 1: the draft (or head) is not
        split, it runs whole on every device of the target's (replicated over its
        tensor-parallel mesh); called where the engine's tensor_parallel_size is known."""
        d = self.draft_tensor_parallel_size
        if d is not None and d != 1:
            raise ValueError(f"draft_tensor_parallel_size={d}: the draft is not split; it runs "
                             "whole on each of the target's devices (tensor_parallel_size="
                             f"{tensor_parallel_size}), as with draft_tensor_parallel_size=1")

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_json(cls, text: str) -> "SpeculativeConfig":
        """`--speculative-config` text: one JSON object (ValueError for anything else)."""
        if not isinstance(text, str):
            raise ValueError(f"speculative config must be JSON text, got {type(text).__name__}")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative config is not valid JSON ({e.msg} at character "
                             f"{e.pos}): {_short(text)}") from None
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SpeculativeConfig":
        """A mapping of vLLM's keys (`LLM(speculative_config={...})`): unknown keys and keys
        this engine does not honour are refused by name."""
        if not isinstance(data, Mapping):
            raise ValueError(f"speculative config must be an object of keys, got "
                             f"{_short(data)}")
        own = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if not isinstance(key, str):
                raise ValueError(f"speculative config key {_short(key)} must be a string")
            if key in own:
                kwargs[key] = value
            elif key in _ONLY_VALUE:
                allowed, why = _ONLY_VALUE[key]
                # None: vLLM's "not set", which means the same value here.
                if value is not None and (value != allowed
                                          or type(value) is not type(allowed)):
                    raise ValueError(f"speculative config {key}={_short(value)} is not "
                                     f"supported ({why}); only {allowed!r} is accepted")
            elif key in _REFUSED:
                raise ValueError(f"speculative config key {key!r} is not supported here: "
                                 f"{_REFUSED[key]}")
            else:
                raise ValueError(f"speculative config key {_short(key)} is unknown; known "
                                 f"keys: {sorted(own)}")
        for name in ("method", "num_speculative_tokens"):
            if name not in kwargs:
                raise ValueError(f"speculative config needs {name!r} (method one of "
                                 f"{METHODS}, num_speculative_tokens in "
                                 f"[1, {MAX_NUM_SPECULATIVE_TOKENS}])")
        return cls(**kwargs)

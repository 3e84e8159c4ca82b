"""Runs in a subprocess with 2 virtual CPU devices (XLA_FLAGS set by the caller): speculative
decoding (n-gram) on a tiny engine split over tensor_parallel_size=2 against the same engine
on one device, printed as one JSON document for tests/device/test_speculation_tp.py.
With the argument `drafters`: the same for a draft model and an EAGLE-3 head (random), which
run replicated over the target's mesh.

Greedy and seeded sampled requests on prompts that repeat themselves, twice per engine: with
n-gram lookup (which the random model's output seldom rewards), then with a proposer that
replays the TP 1 outputs, right for a few tokens then wrong (so proposals are accepted and
rejected); per engine and round: each request's tokens, the spec_decode counters, the
compiles after warmup and the pages left held.
"""

from __future__ import annotations

import json
import pathlib
import sys
import tempfile

from support.eagle3_oracle import HEAD_CONFIG, random_weights, write_head
from support.engine_fixtures import FEW_TOKEN_BUCKETS, tiny_engine, tiny_model

from jaxserve.config import EngineConfig, SpeculativeConfig
from jaxserve.models import tiny
from jaxserve.models.hf_loader import save_hf_dir
from jaxserve.serving.build import build_engines
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.speculation import OnTokens

BASE = [5, 6, 7, 8, 9, 10]
PROMPTS = [BASE * 3 + BASE[:2 + i] for i in range(3)]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
          SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=40, ignore_eos=True),
          SamplingParams(temperature=0.8, seed=9, max_tokens=40, logprobs=2, ignore_eos=True)]
SPEC = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                    "prompt_lookup_min": 1, "prompt_lookup_max": 3})


class Replay:
    """Proposes what `reference` (request id -> output tokens) continues a sequence with,
    right for (its length mod 4) tokens, then off by one."""

    def __init__(self, reference: dict):
        self.full = [p + reference[f"r{i}"] for i, p in enumerate(PROMPTS)]

    def propose(self, sequences):  # noqa: ANN001, ANN201 - token lists (`OnTokens`)
        out = []
        for tokens in sequences:
            n, props = len(tokens), []
            for ref in self.full:
                if ref[:n] == list(tokens):
                    props = [t if i < n % 4 else (t + 1) % 256
                             for i, t in enumerate(ref[n:n + 3])]
                    break
            out.append(props)
        return out


def run(tp: int, reference: dict | None) -> dict:
    model = tiny_model(num_heads=8, num_kv_heads=8, vocab_size=256)
    eng = tiny_engine(model, speculative_config=SPEC, tensor_parallel_size=tp,
                      token_buckets=FEW_TOKEN_BUCKETS, max_model_len=96)
    ngram = round_of(eng)
    eng._core.speculator.proposer = OnTokens(Replay(reference or ngram["tokens"]))
    return {"ngram": ngram, "replay": round_of(eng)}


def round_of(eng) -> dict:  # noqa: ANN001
    before = eng.stats()
    for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS)):
        eng.add_request(f"r{i}", p, sp)
    tokens = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    st = eng.stats()
    alloc = eng.scheduler.allocator
    return {"tokens": tokens, "drafts": st.spec_num_draft_tokens - before.spec_num_draft_tokens,
            "accepted": st.spec_num_accepted_tokens - before.spec_num_accepted_tokens,
            "compiles": eng.runner.compiles_after_warmup,
            "leaked": alloc.num_usable_pages - alloc.num_free_pages}


def drafters(tp: int, root: pathlib.Path, dp: int = 1) -> dict:
    """A draft model (another random model of the same shape) and an EAGLE-3 head (random),
    each run replicated over the TP mesh (or beside each of `dp` replicas): one round of the
    requests on each engine."""
    model = tiny_model(num_heads=8, num_kv_heads=8, vocab_size=256)
    draft_dir = root / "draft"
    if not draft_dir.exists():
        draft = tiny_model(seed=1, num_heads=8, num_kv_heads=8, vocab_size=256)
        save_hf_dir(draft_dir, draft.config, draft.params)
        tiny.save_word_tokenizer(draft_dir, 256)
        head = HEAD_CONFIG | {"vocab_size": 256, "eagle_aux_hidden_state_layer_ids": [0, 1, 2]}
        write_head(root / "head", head, random_weights(head, seed=3))
    out = {}
    for method, path in (("draft_model", draft_dir), ("eagle3", root / "head")):
        spec = SpeculativeConfig.from_dict({"method": method, "model": str(path),
                                            "num_speculative_tokens": 3})
        if dp == 1:
            engines = [tiny_engine(model, speculative_config=spec, tensor_parallel_size=tp,
                                   token_buckets=FEW_TOKEN_BUCKETS, max_model_len=96)]
        else:  # tiny_engine's configuration, as data-parallel replicas
            engines = build_engines(EngineConfig(
                max_num_seqs=8, max_num_batched_tokens=64, page_size=8, max_model_len=96,
                attention_impl="reference", token_buckets=FEW_TOKEN_BUCKETS,
                speculative_config=spec, data_parallel_size=dp), model, progress=False)
        out[method] = [round_of(eng) for eng in engines]
        for eng in engines:
            eng.close()
    return out


if __name__ == "__main__":
    if sys.argv[1:] == ["drafters"]:
        with tempfile.TemporaryDirectory() as d:
            print(json.dumps({"tp1": drafters(1, pathlib.Path(d)),
                              "tp2": drafters(2, pathlib.Path(d)),
                              "dp2": drafters(1, pathlib.Path(d), dp=2)}))
    else:
        one = run(1, None)
        print(json.dumps({"tp1": one, "tp2": run(2, one["ngram"]["tokens"])}))

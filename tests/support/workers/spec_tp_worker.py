"""Runs in a subprocess with 2 virtual CPU devices (XLA_FLAGS set by the caller): speculative
decoding (n-gram) on a tiny engine split over tensor_parallel_size=2 against the same engine
on one device, printed as one JSON document for tests/device/test_speculation_tp.py.

Greedy and seeded sampled requests on prompts that repeat themselves, twice per engine: with
n-gram lookup (which the random model's output seldom rewards), then with a proposer that
replays the TP 1 outputs, right for a few tokens then wrong (so proposals are accepted and
rejected); per engine and round: each request's tokens, the spec_decode counters, the
compiles after warmup and the pages left held.
"""

from __future__ import annotations

import json

from support.engine_fixtures import FEW_TOKEN_BUCKETS, tiny_engine, tiny_model

from jaxserve.config import SpeculativeConfig
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


if __name__ == "__main__":
    one = run(1, None)
    print(json.dumps({"tp1": one, "tp2": run(2, one["ngram"]["tokens"])}))

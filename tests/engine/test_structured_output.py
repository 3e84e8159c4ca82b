"""Structured output end to end on a tiny random-weight model (left alone it writes garbage),
through the offline API: every output must satisfy its spec.

Oracles: the outputs' own parsers (json + jsonschema, re.fullmatch, the choice list), a run of
the same seeded requests without any constrained neighbour (their tokens must not change),
and the model's raw log-softmax (the reported logprobs are the unconstrained distribution's).
The tokenizer is a byte-level BPE trained in the test (`bpe_tokenizer`), so any JSON text can
be spelled, in several ways. The KV cache is small enough that the heavy test preempts.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import pathlib
import re
import tempfile

import jsonschema
import numpy as np
import pytest
from support.bpe_tokenizer import train_bpe_tokenizer
from support.engine_fixtures import tiny_engine, tiny_model, tiny_model_config
from support.numerics import model_logprob_atol
from support.tiers import run_slow

from jaxserve import LLM, SamplingParams
from jaxserve.engine.sequence import FinishReason
from jaxserve.engine.structured_outputs import StructuredOutputs
from jaxserve.models import decoder

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                 "minItems": 1, "maxItems": 3},
        "inner": {"type": "object", "properties": {"x": {"type": "number", "minimum": -5,
                                                         "maximum": 5}},
                  "required": ["x"], "additionalProperties": False}},
     "required": ["tags", "inner"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 4},
    {"type": "object", "properties": {
        "points": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"x": {"type": "integer", "minimum": -9,
                                                   "maximum": 9},
                                             "ok": {"type": "boolean"}},
            "required": ["x", "ok"], "additionalProperties": False}},
        "kind": {"enum": ["a", "b", 3, None]}},
     "required": ["points", "kind"], "additionalProperties": False},
]
REGEXES = [r"[a-z]{2,6}@[a-z]{2,4}\.(com|org)", r"-?[0-9]{1,4}(\.[0-9]{1,2})?", r"(yes|no)!{0,3}"]
CHOICES = [("alpha", "beta", "gamma delta"), ("true", "false")]
PROMPT = "hello world"


@pytest.fixture(scope="module")
def llm() -> LLM:
    tok = train_bpe_tokenizer(pathlib.Path(tempfile.mkdtemp(prefix="jaxserve-bpe-")))
    model = dataclasses.replace(
        tiny_model(vocab_size=tok.vocab_size, eos_token_ids=tok.eos_token_ids), tokenizer=tok)
    obj = LLM.__new__(LLM)  # LLM() loads a checkpoint; the facade's own code is what is used
    # 24 KV pages of 16 tokens for up to 16 sequences of up to 300 tokens: the heavy test
    # preempts (checked there), and constrained sequences must resume where they were.
    obj.engine = tiny_engine(model, max_num_seqs=16, max_num_batched_tokens=64, page_size=16,
                             max_model_len=320, token_buckets=(16, 64),
                             kv_cache_memory=24 * 4096)  # f32 KV: 4 KiB a page
    obj.config = obj.engine.config
    obj._ids = itertools.count()
    return obj


def spec_ok(spec: StructuredOutputs, text: str) -> bool:
    if spec.json is not None:
        jsonschema.validate(json.loads(text), json.loads(spec.json))
        return True
    if spec.regex is not None:
        return re.fullmatch(spec.regex, text) is not None
    return text in spec.choice  # type: ignore[operator]


def test_json_schemas_hold_under_random_sampling(llm: LLM) -> None:
    """80 requests (240 with JAXSERVE_RUN_SLOW=1), 4 schemas, temperature 1.0, 16 at a time
    with preemption: every output that ended by its grammar parses and validates; ending by
    length is rare (a random model rambles inside strings and arrays; whitespace between
    tokens is bounded)."""
    specs = [StructuredOutputs(json=SCHEMAS[i % len(SCHEMAS)])
             for i in range(240 if run_slow() else 80)]
    params = [SamplingParams(max_tokens=300, temperature=1.0, seed=i, structured_outputs=s)
              for i, s in enumerate(specs)]
    before = llm.engine.stats().num_preemptions
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    reasons = collections.Counter()
    for spec, out in zip(specs, outs):
        c = out.outputs[0]
        reasons[c.finish_reason] += 1
        assert c.error is None
        if c.finish_reason is FinishReason.STOP:
            assert spec_ok(spec, c.text), c.text
    assert reasons[FinishReason.STOP] >= 0.9 * len(params), reasons
    assert set(reasons) <= {FinishReason.STOP, FinishReason.LENGTH}
    assert llm.engine.stats().num_preemptions > before  # resumed grammars were exercised
    assert llm.engine.stats().compiles_after_warmup == 0


def test_regex_choice_and_lark_grammar_hold(llm: LLM) -> None:
    grammar = 'start: expr\nexpr: NUM | "(" expr OP expr ")"\nOP: "+" | "*"\nNUM: /[0-9]/'
    specs = [StructuredOutputs(regex=r) for r in REGEXES] + \
        [StructuredOutputs(choice=c) for c in CHOICES] + [StructuredOutputs(grammar=grammar)]
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=i,
                             structured_outputs=specs[i % len(specs)]) for i in range(48)]
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    for p, out in zip(params, outs):
        c, spec = out.outputs[0], p.structured_outputs
        assert c.finish_reason in (FinishReason.STOP, FinishReason.EOS), (c.finish_reason, c.text)
        if spec.grammar is not None:
            assert re.fullmatch(r"[0-9]|\(.*[+*].*\)", c.text), c.text
            continue
        assert spec_ok(spec, c.text), c.text


def test_unconstrained_neighbours_are_unchanged(llm: LLM) -> None:
    """Seeded free-text requests give the same tokens alone and beside constrained ones (one
    step, masked rows and unmasked rows together); greedy ones too."""
    free = [SamplingParams(max_tokens=12, temperature=1.0 if i % 2 else 0.0, seed=100 + i,
                           ignore_eos=True) for i in range(6)]
    alone = llm.generate([PROMPT] * 6, free, use_tqdm=False)
    tied = [SamplingParams(max_tokens=40, temperature=1.0, seed=i,
                           structured_outputs=StructuredOutputs(json=SCHEMAS[i % 4]))
            for i in range(6)]
    mixed = llm.generate([PROMPT] * 12, [p for pair in zip(free, tied) for p in pair],
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[::2]] == \
        [o.outputs[0].token_ids for o in alone]
    assert llm.engine.stats().compiles_after_warmup == 0


def test_n_samples_each_follow_their_own_grammar(llm: LLM) -> None:
    spec = StructuredOutputs(regex=REGEXES[0])
    out = llm.generate(PROMPT, SamplingParams(n=4, max_tokens=40, temperature=1.0, seed=7,
                                              structured_outputs=spec), use_tqdm=False)[0]
    texts = [c.text for c in out.outputs]
    assert all(spec_ok(spec, t) for t in texts), texts
    assert len(set(texts)) > 1  # independent samples, not one matcher shared


def test_prefix_cache_hit_gives_the_same_constrained_output(llm: LLM) -> None:
    prompt = "the quick brown fox " * 6  # several full pages: cached after the first run
    p = SamplingParams(max_tokens=60, temperature=1.0, seed=3,
                       structured_outputs=StructuredOutputs(json=SCHEMAS[0]))
    first = llm.generate(prompt, p, use_tqdm=False)[0]
    second = llm.generate(prompt, p, use_tqdm=False)[0]
    assert second.num_cached_tokens > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert spec_ok(p.structured_outputs, first.outputs[0].text)


def test_grammar_end_and_stop_strings(llm: LLM) -> None:
    """A choice ends the output with STOP and its last token's text shown; a stop string
    inside the constrained text still cuts it."""
    spec = StructuredOutputs(choice=("gamma delta",))
    out = llm.generate(PROMPT, SamplingParams(max_tokens=30, structured_outputs=spec),
                       use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason) == ("gamma delta", FinishReason.STOP)
    cut = llm.generate(PROMPT, SamplingParams(max_tokens=30, structured_outputs=spec,
                                              stop=["ma d"]), use_tqdm=False)[0].outputs[0]
    assert (cut.text, cut.finish_reason) == ("gam", FinishReason.STOP_STRING)


def test_logprobs_are_the_model_distributions(llm: LLM) -> None:
    """The first token's reported logprob is the raw model's log-softmax at that token (the
    full-sequence forward as the oracle), not the renormalised constrained one."""
    spec = StructuredOutputs(choice=("yes", "no"))
    out = llm.generate(PROMPT, SamplingParams(max_tokens=5, temperature=0.0, logprobs=3,
                                              structured_outputs=spec), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    params, cfg = llm.engine.runner.params, llm.engine.runner.model_cfg
    T = 1 << len(ids).bit_length()
    tokens = np.zeros((1, T), np.int32)
    tokens[0, :len(ids)] = ids
    logits = np.asarray(decoder.forward_jit(params, tokens, np.array([len(ids)], np.int32),
                                            cfg=cfg)[0, len(ids) - 1], np.float64)
    raw = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    first = out.outputs[0].token_ids[0]
    got = out.outputs[0].logprobs[0]
    # The paged engine against the full-sequence forward of the same weights: two layouts,
    # support.numerics.model_logprob_atol (derived from the weights, over max_model_len).
    model = tiny_model(vocab_size=cfg.vocab_size, eos_token_ids=cfg.eos_token_ids)
    tol = model_logprob_atol(cfg, model.params, llm.engine.config.max_model_len)
    assert got[first] == pytest.approx(raw[first], abs=tol)
    assert raw[first] < -1e-3  # constrained renormalisation would have made it ~0
    assert out.outputs[0].text in ("yes", "no")


@pytest.mark.parametrize("spec,field", [
    ({"json": {"type": "nope"}}, "structured_outputs.json"),
    ({"regex": "(("}, "structured_outputs.regex"),
    ({"grammar": "start: missing_rule"}, "structured_outputs.grammar"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"json": {"type": "object"}, "regex": "a"}, "structured_outputs"),
])
def test_bad_specs_are_refused_naming_the_field(llm: LLM, spec: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{re.escape(field)}") as e:
        llm.generate(PROMPT, SamplingParams(max_tokens=4, structured_outputs=spec),
                     use_tqdm=False)
    assert e.value.field == field  # type: ignore[attr-defined]
    ok = llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) > 0  # the engine carries on
    assert llm.engine.stats().kv_pages_used == 0


def test_a_grammar_no_token_can_continue_ends_with_the_reason(tmp_path: pathlib.Path) -> None:
    """A vocabulary with no "Q" at all (a BPE trained without the byte alphabet). A regex of
    Qs cannot start: admission refuses it, naming the field. A regex that needs a Q only
    after several tokens passes admission (its first steps run); when no token can continue
    it, llguidance allows nothing but EOS and reports why, and the request ends with ERROR and
    that reason instead of sampling, its pages come back, and a neighbour is untouched."""
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers

    from jaxserve.config import EngineConfig
    from jaxserve.engine.engine import Engine
    from jaxserve.engine.errors import InvalidRequest
    from jaxserve.engine.fake_runner import ArithmeticRunner
    from jaxserve.engine.sizing import plan_engine
    from jaxserve.models.tiny import CHAT_TEMPLATE
    from jaxserve.models.tokenizer import Tokenizer

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(["abc abd"] * 5, trainers.BpeTrainer(
        vocab_size=30, special_tokens=["<eos>"]))
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<eos>", "chat_template": CHAT_TEMPLATE}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=16, page_size=4,
                          max_model_len=64, attention_impl="reference")
    plan = plan_engine(config, tiny_model_config(vocab_size=tok.vocab_size,
                                                 eos_token_ids=tok.eos_token_ids), 4, 1 << 30)
    engine = Engine(config, plan, ArithmeticRunner(tok.vocab_size), tok, tok.eos_token_ids)
    with pytest.raises(InvalidRequest, match=r"^structured_outputs.regex is not a usable "):
        engine.add_request("q", "abc", SamplingParams(max_tokens=8, structured_outputs={
            "regex": "Q+"}))
    engine.add_request("q", "abc", SamplingParams(max_tokens=8, structured_outputs={
        "regex": "(a|b|c)(a|b|c)(a|b|c)(a|b|c)Q"}))
    engine.add_request("ok", "abc", SamplingParams(max_tokens=4, ignore_eos=True))
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    q = done["q"].outputs[0]
    assert q.finish_reason is FinishReason.ERROR and 0 < len(q.token_ids) < 4
    assert "no token of the vocabulary can continue the grammar" in q.error
    assert len(done["ok"].outputs[0].token_ids) == 4
    assert engine.stats().kv_pages_used == 0

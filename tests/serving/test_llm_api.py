"""The offline API (`LLM`) on a tiny HF checkpoint written to disk, as a user would call it."""

from __future__ import annotations

import pathlib

import pytest

pytest.importorskip("transformers")

from support.engine_fixtures import rollout  # noqa: E402
from support.hf_models import build_hf_model, save_tiny_tokenizer  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.engine.sequence import FinishReason
from jaxserve.models.loading import load_model  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    d = tmp_path_factory.mktemp("tiny-llama")
    build_hf_model("llama3_gqa_rope_scaling", d)
    save_tiny_tokenizer(d, 211)
    return d


@pytest.fixture(scope="module")
def llm(model_dir: pathlib.Path) -> LLM:
    return LLM(model=str(model_dir), max_num_seqs=4, max_num_batched_tokens=32, page_size=8,
               max_model_len=128, kv_cache_memory=1 << 20, enable_prefix_caching=True,
               attention_impl="reference")


def test_generate_strings_and_ids_in_input_order(llm: LLM, model_dir: pathlib.Path) -> None:
    prompts = ["w5 w9 w33 w7", [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], "w100", [42]]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (5, 9, 3, 7)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    model = load_model(model_dir)
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 9, 3, 7]
    for o, p, sp in zip(outs, prompts, params):
        ids = model.tokenizer.encode(p) if isinstance(p, str) else p
        assert o.prompt_token_ids == ids
        assert o.outputs[0].token_ids == rollout(model, ids, sp.max_tokens)
        assert o.outputs[0].finish_reason is FinishReason.LENGTH
        m = o.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert m.queue_time is not None and m.ttft is not None


def test_single_prompt_single_params_and_chat(llm: LLM) -> None:
    out = llm.generate("w5 w6", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 4
    chat = llm.chat([{"role": "user", "content": "w5 w6"}],
                    SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                    use_tqdm=False)
    expected_prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "w5 w6"}], add_generation_prompt=True, tokenize=True)
    assert chat[0].prompt_token_ids == expected_prompt


def test_bad_prompt_in_a_batch_raises_and_leaves_engine_clean(llm: LLM) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[5, 6], [5, 100000]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished()
    alloc = llm.engine.scheduler.allocator
    assert alloc.num_free_pages == alloc.num_usable_pages
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        llm.generate(["w5"], [SamplingParams(), SamplingParams()], use_tqdm=False)
    for prio, match in (([0, "x"], "priority='x' must be an integer"),
                        ([0], "1 priorities for 2 prompts")):
        with pytest.raises(ValueError, match=match):
            llm.generate([[5, 6], [7, 8]], SamplingParams(max_tokens=2), use_tqdm=False,
                         priority=prio)
        assert not llm.engine.has_unfinished()


def test_varied_workload_compiles_nothing_after_warmup(llm: LLM) -> None:
    prompts = [[3 + i] * (1 + 7 * i) for i in range(10)]
    params = [SamplingParams(temperature=0.0, max_tokens=6),
              SamplingParams(temperature=0.9, top_k=5, seed=1, max_tokens=9),
              SamplingParams(temperature=1.1, top_p=0.8, min_p=0.05, seed=2, max_tokens=4),
              SamplingParams(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5,
                             frequency_penalty=0.2, max_tokens=5),
              SamplingParams(temperature=0.0, logprobs=5, max_tokens=3),
              SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=4),
              SamplingParams(stop=["w7"], max_tokens=8, temperature=0.5),
              SamplingParams(stop_token_ids=[5], min_tokens=2, max_tokens=6),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=2.0, max_tokens=2)]
    before = llm.engine.runner.compiles_after_warmup
    outs = llm.generate(prompts, params, use_tqdm=False)
    guard = llm.engine.runner.guard
    assert guard.compiles_after_warmup == before, guard.last_compiled
    assert all(o.finished for o in outs)
    assert len(outs[5].outputs) == 3

"""Multi-LoRA through the offline API, against HF transformers with each adapter merged.

Three random PEFT adapters (torch + peft; non-zero B) of different ranks, targets and scaling
(one rsLoRA) on a tiny HF Llama written to disk. One `generate` call mixes the base model and
all three adapters, so steps carry rows of several adapters at once; with `max_loras=2` and
`max_cpu_loras=2` the third adapter waits for a device slot and is read from disk again after
the host cache dropped it. Oracle: transformers' greedy decoding of the model with that
prompt's adapter merged (`merge_and_unload`), or of the base model. Nothing may compile after
warmup while adapters come and go.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from support.hf_models import build_hf_model, hf_greedy, save_tiny_tokenizer  # noqa: E402
from support.lora_adapters import make_peft_adapter, merged_model  # noqa: E402

from jaxserve import LLM, LoRARequest, SamplingParams  # noqa: E402

N_NEW = 6
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26], [30, 31],
           [40, 41, 42, 43], [50, 51, 52, 53, 54, 55], [60, 61, 62], [70, 71, 72, 73, 74]]
# The adapter of each prompt (None: the base model).
NAMES = [None, "a", "b", "c", "a", None, "c", "b"]
EOS = 2  # the tiny models' eos_token_id


def upto_eos(tokens: list[int]) -> list[int]:
    """The tokens through the first EOS: transformers' generate stops there (a merged PEFT
    model keeps the checkpoint's generation config), jaxserve runs on with ignore_eos."""
    return tokens[:tokens.index(EOS) + 1] if EOS in tokens else tokens


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = tmp_path_factory.mktemp("lora-llm")
    model = build_hf_model("llama3_gqa_rope_scaling", d / "base")
    save_tiny_tokenizer(d / "base", 211)
    dirs = {"a": make_peft_adapter(model, d / "a", rank=8, alpha=16, seed=1),
            "b": make_peft_adapter(model, d / "b", rank=4, alpha=8, seed=2, use_rslora=True,
                                   target_modules=("q_proj", "v_proj", "down_proj")),
            "c": make_peft_adapter(model, d / "c", rank=8, alpha=32, seed=3,
                                   target_modules=("o_proj", "gate_proj", "up_proj"))}
    want = {}
    for name in (None, "a", "b", "c"):
        m = model if name is None else merged_model(model, dirs[name])
        want[name] = [upto_eos(hf_greedy(m, p, N_NEW)) for p, n in zip(PROMPTS, NAMES)
                      if n == name]
    return {"base": d / "base", "dirs": dirs, "want": want}


def _requests(dirs: dict[str, pathlib.Path]) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, str(path))
            for i, (name, path) in enumerate(sorted(dirs.items()))}


@pytest.fixture(scope="module")
def llm(case: dict):  # noqa: ANN201
    llm = LLM(str(case["base"]), enable_lora=True, max_loras=2, max_lora_rank=8,
              max_cpu_loras=2, max_num_seqs=8, max_num_batched_tokens=64, page_size=8,
              max_model_len=128, kv_cache_memory=1 << 20, token_buckets=(8, 64),
              attention_impl="reference")
    yield llm
    llm.close()


def test_mixed_adapters_equal_merged_hf(case: dict, llm: LLM) -> None:
    reqs = _requests(case["dirs"])
    compiles = llm.engine.runner.compiles_after_warmup  # type: ignore[union-attr]
    sp = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)
    outs = llm.generate(PROMPTS, sp, use_tqdm=False,
                        lora_request=[None if n is None else reqs[n] for n in NAMES])
    got: dict = {name: [] for name in (None, "a", "b", "c")}
    for out, name in zip(outs, NAMES):
        got[name].append(upto_eos(out.outputs[0].token_ids))
    assert got == case["want"]
    # The adapters change the outputs (the comparison can fail).
    assert case["want"]["a"][0] != case["want"][None][0] or \
        case["want"]["a"][1] != case["want"][None][1]
    # A second call with one adapter for every prompt: the slots turn over again.
    again = llm.generate(PROMPTS[:3], sp, use_tqdm=False, lora_request=reqs["c"])
    want_c = [upto_eos(hf_greedy(merged_model_cached(case, "c"), p, N_NEW)) for p in PROMPTS[:3]]
    assert [upto_eos(o.outputs[0].token_ids) for o in again] == want_c
    assert llm.engine.runner.compiles_after_warmup == compiles  # type: ignore[union-attr]


def test_bad_adapters_are_refused_before_anything_is_queued(case: dict, llm: LLM,
                                                           tmp_path: pathlib.Path) -> None:
    """A prompt's adapter that cannot load, or a known name given another id, raises naming
    it, and no prompt of the call was queued."""
    reqs = _requests(case["dirs"])
    sp = SamplingParams(max_tokens=2)
    missing = LoRARequest("missing", 9, str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="nowhere"):
        llm.generate(PROMPTS[:2], sp, use_tqdm=False, lora_request=[reqs["a"], missing])
    assert not llm.engine.has_unfinished()
    other = LoRARequest("a", 7, reqs["a"].lora_path)
    with pytest.raises(ValueError, match="lora_int_id=1"):
        llm.generate(PROMPTS[:2], sp, use_tqdm=False, lora_request=[None, other])
    assert not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="2 lora_requests for 3 prompts"):
        llm.generate(PROMPTS[:3], sp, use_tqdm=False, lora_request=[None, None])
    assert llm.engine.resolve_lora("missing") is None


_MERGED: dict = {}


def merged_model_cached(case: dict, name: str):  # noqa: ANN201
    """The merged HF model of adapter `name` (built once)."""
    if name not in _MERGED:
        import transformers

        base = transformers.AutoModelForCausalLM.from_pretrained(str(case["base"]))
        _MERGED[name] = merged_model(base, case["dirs"][name])
    return _MERGED[name]


def test_lora_request_needs_enable_lora(case: dict) -> None:
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(str(case["base"]), max_loras=2)


def test_quantized_base_gets_bfloat16_stacks_by_default(case: dict) -> None:
    """Through the one build path: `lora_dtype` auto on a float32 model stored quantized
    (`quantization="int8"`) makes bfloat16 stacks (`serving.lora_build.stacks_dtype`), and
    the adapter still changes the greedy output."""
    llm = LLM(str(case["base"]), enable_lora=True, max_loras=1, max_lora_rank=8,
              quantization="int8", max_num_seqs=2, max_num_batched_tokens=16, page_size=8,
              max_model_len=64, kv_cache_memory=1 << 20, token_buckets=(16,),
              attention_impl="reference")
    try:
        dtypes = {leaf.dtype for leaf in jax.tree.leaves(llm.engine.runner.lora.stacks)}
        assert dtypes == {jnp.dtype(jnp.bfloat16)}
        sp = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)
        a = _requests(case["dirs"])["a"]
        base, tuned = llm.generate([PROMPTS[0]] * 2, sp, use_tqdm=False, lora_request=[None, a])
        assert base.outputs[0].token_ids != tuned.outputs[0].token_ids
    finally:
        llm.close()

"""Runs in a subprocess with 4 virtual CPU devices (XLA_FLAGS set by the caller): multi-LoRA
on a tiny HF Llama (8 query heads, 2 KV heads) split over tensor_parallel_size 1 and 2 (and,
with the argument `all`, 4: the KV heads, and with them the adapters' k/v outputs, replicated
twice), printed as one JSON document for tests/device/test_lora_tp.py.

Per TP size: the greedy tokens of prompts mixing the base model and two PEFT adapters (one
targets every projection, one rsLoRA on q/v/down) with one device slot for two adapters, the
compiles after warmup and the KV pages left held.
"""

from __future__ import annotations

import json
import pathlib
import sys
import tempfile

from support.engine_fixtures import FEW_TOKEN_BUCKETS
from support.hf_models import build_hf_model, save_tiny_tokenizer
from support.lora_adapters import make_peft_adapter

from jaxserve import LLM, LoRARequest, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26], [30, 31],
           [40, 41, 42, 43], [50, 51, 52, 53, 54, 55]]
NAMES = [None, "a", "b", "a", None, "b"]


def run(base: pathlib.Path, adapters: dict[str, LoRARequest], tp: int) -> dict:
    llm = LLM(str(base), tensor_parallel_size=tp, enable_lora=True, max_loras=1,
              max_lora_rank=8, max_num_seqs=8, max_num_batched_tokens=64, page_size=8,
              max_model_len=128, kv_cache_memory=1 << 20, token_buckets=FEW_TOKEN_BUCKETS,
              attention_impl="reference")
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(PROMPTS, sp, use_tqdm=False,
                        lora_request=[None if n is None else adapters[n] for n in NAMES])
    alloc = llm.engine.scheduler.allocator  # type: ignore[union-attr]
    doc = {"tokens": [o.outputs[0].token_ids for o in outs],
           "compiles": llm.engine.runner.compiles_after_warmup,  # type: ignore[union-attr]
           "leaked": alloc.num_usable_pages - alloc.num_free_pages}
    llm.close()
    return doc


def main() -> None:
    sizes = (1, 2, 4) if sys.argv[1:] == ["all"] else (1, 2)
    with tempfile.TemporaryDirectory() as tmp:
        d = pathlib.Path(tmp)
        model = build_hf_model("llama3_gqa_rope_scaling", d / "base")
        save_tiny_tokenizer(d / "base", 211)
        adapters = {
            "a": LoRARequest("a", 1, str(make_peft_adapter(model, d / "a", rank=8, seed=1))),
            "b": LoRARequest("b", 2, str(make_peft_adapter(
                model, d / "b", rank=4, seed=2, use_rslora=True,
                target_modules=("q_proj", "v_proj", "down_proj"))))}
        print(json.dumps({f"tp{tp}": run(d / "base", adapters, tp) for tp in sizes}))


if __name__ == "__main__":
    main()

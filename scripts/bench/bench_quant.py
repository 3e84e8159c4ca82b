#!/usr/bin/env python
"""What quantization costs and buys: memory, decode speed and accuracy per weight scheme x KV
cache dtype, for the bundled SmolLM2-135M and a tiny random model of the tests' shape.

Accuracy: a fixed English text (tests/data/apache-2.0.txt, the Apache License 2.0: 2,238
tokens of the bundled tokenizer) runs through the engine's own paged model step in chunks of
--chunk tokens (`paged_hidden` over KV pages of the KV dtype, chunks after the first reading
the pages the earlier ones wrote, the dense weights packed for the C++ kernel as the engine
packs them) -> the next-token log-probabilities at every position. Against the float32 model
with a float32 KV cache (the bundled model's float32 weights are its GGUF blocks dequantized,
what jaxserve served before quantization): perplexity of the text, mean KL(float || quantized)
of the next-token distributions, and top-1 agreement.

Speed (`LLM.generate`, greedy, ignore_eos): batch 1 and batch 32, --max-tokens each, median of
--runs after one warm-up; weight bytes as stored; KV tokens per GiB from the engine's plan
(pages and their scales).

    python scripts/bench/bench_quant.py --json benchmarks/results/quant/bench_quant.json
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

TEXT = pathlib.Path(__file__).resolve().parents[2] / "tests" / "data" / "apache-2.0.txt"
# name -> EngineConfig options. "auto" on the bundled GGUF: its Q4_1 / Q8_0 blocks as stored.
# The quantized schemes run as the engine runs them: int8_activations auto (int8 / int4
# weights as integer dots where this CPU can, kernels_pallas/dense_qdot_cpu.py); the "-a16"
# rows keep the activations float (int8_activations off), so the pair shows what quantizing
# the activations costs, and "-g16" / "-g8" quantize them in groups of 16 / 8 (default 32).
WEIGHTS = {
    "float32": {"quantization": "none"},
    "auto": {"quantization": "auto"},
    "auto-a16": {"quantization": "auto", "int8_activations": "off"},
    "auto-g16": {"quantization": "auto", "int8_activation_group_size": 16},
    "auto-g8": {"quantization": "auto", "int8_activation_group_size": 8},
    "int8": {"quantization": "int8"},
    "int8+lm_head": {"quantization": "int8", "quantize_lm_head": True},
    "fp8": {"quantization": "fp8"},
    "int4-g32": {"quantization": "int4", "quantization_group_size": 32},
    "int4-g32-a16": {"quantization": "int4", "quantization_group_size": 32,
                     "int8_activations": "off"},
    "int4-g64": {"quantization": "int4", "quantization_group_size": 64},
    "int4-g64+lm_head": {"quantization": "int4", "quantization_group_size": 64,
                         "quantize_lm_head": True},
}
# KV pages: "auto" here is float32 (the reference pages), not the engine's "auto" (bfloat16
# under quantized weights); --kv-dtypes also takes float32 / bfloat16 / float16.
KV_DTYPES = ("auto", "int8", "fp8")
PAGE = 16


def tiny_model_dir(out: pathlib.Path) -> pathlib.Path:
    """A tiny random Llama (the tests' kind of model) over the bundled tokenizer's vocabulary,
    saved as an HF directory."""
    from jaxserve.models.hf_loader import save_hf_dir
    from jaxserve.models.loading import load_model
    from jaxserve.models.quant import WeightQuant
    from jaxserve.models.tiny import random_params, tiny_config

    tok = load_model(None, quant=WeightQuant("none")).tokenizer
    cfg = tiny_config(vocab_size=tok.vocab_size, hidden_size=128, intermediate_size=256,
                      num_layers=4, num_heads=8, max_position_embeddings=4096,
                      tie_word_embeddings=True, eos_token_ids=tuple(tok.eos_token_ids))
    # The init scale of the tests' HF parity models (transformers' 0.02, doubled): a random
    # model's logits stay in a realistic range (the engine fixtures' 0.5 makes every
    # next-token distribution one-hot, and any rounding flips it).
    save_hf_dir(out, cfg, random_params(cfg, seed=0, scale=0.04))
    tok.save(out)
    return out


@functools.partial(jax.jit, static_argnames=("cfg",))
def _chunk_logprobs(params, kv, tokens, positions, md, cfg):  # noqa: ANN001, ANN202
    """One chunk through the paged step: (f32[chunk, vocab] log-probabilities, updated KV).
    The params are an argument, not a closure: each scheme is its own executable."""
    from jaxserve.models.blocks import lm_logits
    from jaxserve.models.paged import paged_hidden

    hidden, kv = paged_hidden(params, kv, tokens, positions, md, cfg, "cpu")
    return jax.nn.log_softmax(lm_logits(cfg, params, hidden), axis=-1), kv


def text_logprobs(model_path: str | None, weights: dict, kv_dtype: str, ids: np.ndarray,
                  chunk: int) -> np.ndarray:
    """f32[T - 1, vocab] next-token log-probabilities of `ids` through the paged step."""
    from jaxserve.kernels_pallas import AttentionMetadata
    from jaxserve.models.loading import load_model
    from jaxserve.models.packing import can_pack, pack_params
    from jaxserve.models.paged import init_kv_cache
    from jaxserve.models.quant import WeightQuant

    wq = WeightQuant(weights["quantization"], weights.get("quantization_group_size"),
                     weights.get("quantize_lm_head", False))
    model = load_model(model_path, quant=wq)
    cfg, params = model.config, model.params
    if can_pack(params) is None:
        params = pack_params(params, int8_activations=weights.get("int8_activations", "auto"),
                             int8_activation_group_size=weights.get(
                                 "int8_activation_group_size", 32))
    n = len(ids)
    pages = -(-n // PAGE) + 1
    dtype = {"auto": jnp.float32, "float32": jnp.float32, "bfloat16": jnp.bfloat16,
             "float16": jnp.float16, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[kv_dtype]
    kv = init_kv_cache(cfg, pages + 1, PAGE, dtype)
    block_table = np.arange(1, pages + 1, dtype=np.int32)[None]

    out = []
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        tokens = np.zeros(chunk, np.int32)
        tokens[:end - start] = ids[start:end]
        pos = np.arange(start, start + chunk, dtype=np.int32)
        slots = np.where(pos < end, (pos // PAGE + 1) * PAGE + pos % PAGE, 0).astype(np.int32)
        md = AttentionMetadata(slot_mapping=slots, block_tables=block_table,
                               kv_lens=np.array([end], np.int32),
                               cu_q_lens=np.array([0, end - start], np.int32),
                               num_seqs=np.array([1], np.int32))
        lp, kv = _chunk_logprobs(params, kv, tokens, pos, md, cfg)
        out.append(np.asarray(lp[:end - start]))
    return np.concatenate(out)[:-1]


def accuracy(ref: np.ndarray, got: np.ndarray, targets: np.ndarray) -> dict:
    rows = np.arange(len(targets))
    kl = np.sum(np.exp(ref) * (ref - got), axis=-1)
    return {"perplexity": float(np.exp(-got[rows, targets].mean())),
            "mean_kl": float(kl.mean()),
            "top1_agreement": float(np.mean(ref.argmax(-1) == got.argmax(-1)))}


def speed(model_path: str | None, weights: dict, kv_dtype: str, max_tokens: int,
          runs: int) -> dict:
    from jaxserve import LLM, SamplingParams
    from jaxserve.models.quant import weight_bytes

    llm = LLM(model=model_path, kv_cache_dtype=kv_dtype, max_num_seqs=32, max_model_len=512,
              max_num_batched_tokens=512, decode_token_budget=None, **weights)
    runner, plan = llm.engine.runner, llm.engine.plan
    out = {"weight_bytes": weight_bytes(runner.params),
           "kv_tokens_per_gib": int(2**30 / (plan.kv_bytes_per_page / plan.scheduler.page_size))}
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for batch in (1, 32):
        prompts = [f"Story {i}: once upon a time" for i in range(batch)]
        llm.generate(prompts, SamplingParams(max_tokens=4), use_tqdm=False)
        rates = []
        for _ in range(runs):
            t = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            rates.append(sum(len(o.outputs[0].token_ids) for o in outs)
                         / (time.perf_counter() - t))
        out[f"batch{batch}_tok_s"] = statistics.median(rates)
    llm.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="bundled,tiny")
    p.add_argument("--weights", default=",".join(WEIGHTS))
    p.add_argument("--kv-dtypes", default=",".join(KV_DTYPES))
    p.add_argument("--speed-weights", default="float32,auto,int8,int8+lm_head,fp8,int4-g64",
                   help="weight schemes timed (with the auto KV cache); 'none' skips timing")
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", type=pathlib.Path)
    args = p.parse_args()

    from jaxserve.models.tokenizer import Tokenizer
    from jaxserve.models.bundled import bundled_model_path

    ids = np.array(Tokenizer.from_gguf(bundled_model_path()).encode(TEXT.read_text()), np.int32)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-quant-"))
    models = {"bundled": None, "tiny": None}
    rows = []
    for name in args.models.split(","):
        path = None if name == "bundled" else str(tiny_model_dir(tmp / "tiny"))
        models[name] = path
        combos = [(w, kv) for w in args.weights.split(",") for kv in args.kv_dtypes.split(",")]
        if name == "tiny":  # a float checkpoint: auto is float32
            combos = [c for c in combos if c[0] != "auto"]
        ref = text_logprobs(path, WEIGHTS["float32"], "auto", ids, args.chunk)
        for w, kv in tqdm(combos, desc=f"accuracy ({name})"):
            got = ref if (w, kv) == ("float32", "auto") else text_logprobs(
                path, WEIGHTS[w], kv, ids, args.chunk)
            row = {"model": name, "weights": w, "kv_cache_dtype": kv,
                   **accuracy(ref, got, ids[1:])}
            rows.append(row)
            print(json.dumps(row), flush=True)
    timed = [] if args.speed_weights == "none" else args.speed_weights.split(",")
    for name, path in models.items():
        if name not in args.models.split(","):
            continue
        jobs = [(w, "auto") for w in timed if not (name == "tiny" and w == "auto")]
        jobs += [("auto" if name == "bundled" else "float32", kv) for kv in ("int8", "fp8")
                 if timed and kv in args.kv_dtypes.split(",")]
        for w, kv in tqdm(jobs, desc=f"speed ({name})"):
            s = speed(path, WEIGHTS[w], kv, args.max_tokens, args.runs)
            row = next((r for r in rows if (r["model"], r["weights"], r["kv_cache_dtype"]) ==
                        (name, w, kv)), None)
            if row is None:
                row = {"model": name, "weights": w, "kv_cache_dtype": kv}
                rows.append(row)
            row.update(s)
            print(json.dumps(row), flush=True)
    doc = {"text": str(TEXT.name), "text_tokens": int(len(ids)), "chunk": args.chunk,
           "max_tokens": args.max_tokens, "runs": args.runs, "rows": rows}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()

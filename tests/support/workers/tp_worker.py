"""Runs in a subprocess with 8 virtual CPU devices (XLA_FLAGS set by the caller): tiny engines
at several tensor-parallel sizes, printed as one JSON document for tests/device/test_tensor_parallel.py.

For each model (heads/KV heads) and TP size: greedy tokens, top-5 logprobs and top-3 prompt
logprobs of 3 prompts, seeded structured-output requests (the 8-KV-head model),
compiles after warmup, per-device and total bytes of the parameters and of the KV pages.

Quantized weights (QUANT_ROWS) at TP 1 and 2: the same greedy outputs and bytes.
The process runs one `part` of the grid, named by its argument: "default" (the default run:
one sharded configuration against its TP 1, DEFAULT_ROWS with FEW_TOKEN_BUCKETS, the gRPC
server over it and QUANT_ROWS); with JAXSERVE_RUN_SLOW=1 the test runs SLOW_PARTS, one process
each: the full grid (MODELS x TP_SIZES, the default buckets) a model per process, the gRPC
server over TP 4 with replicated KV heads, and each quantization row. Each document also
carries the process's memory-map count against vm.max_map_count.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import sys
import tempfile

import jax
from support.bpe_tokenizer import train_bpe_tokenizer  # noqa: E402 - run with tests/ on the path
from support.engine_fixtures import FEW_TOKEN_BUCKETS, run_slow, tiny_engine, tiny_model
from support.numerics import model_logprob_atol

from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.structured_outputs import StructuredOutputs

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], list(range(20, 70))]
# kv_heads -> (heads, vocab): KV heads dividing every TP size, replicated ones (2), and a
# vocabulary no TP size divides (211: replicated embeddings).
MODELS = {8: (8, 320), 2: (8, 256), 4: (8, 211)}
# The 8-KV-head model speaks a byte-level BPE tokenizer (its 320 ids), so grammars can spell
# JSON: its rows also run seeded structured-output requests (the grammar mask over a
# vocabulary-sharded LM head), whose tokens TP must not change.
STRUCTURED = (StructuredOutputs(json={"type": "object", "properties": {
    "n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"], "additionalProperties": False}),
    StructuredOutputs(regex=r"[a-z]{2,5}-[0-9]{1,3}"), StructuredOutputs(choice=("yes", "no")))
TP_SIZES = (1, 2, 4, 8)
# (kv_heads, tp) of the default run: KV pages, heads and the vocabulary-sharded LM head split
# in two (sharded attention, the sampler and the prompt logprobs pass over shards), and its
# TP 1 oracle. The rest of the grid runs with JAXSERVE_RUN_SLOW=1.
DEFAULT_ROWS = ((8, 1), (8, 2))


def shard_bytes(tree, device=None) -> tuple[int, int]:  # noqa: ANN001
    """(bytes on `device` (default: the first), bytes of the whole arrays)."""
    leaves = [x for x in jax.tree.leaves(tree) if hasattr(x, "addressable_shards")]
    dev0 = device or jax.devices()[0]
    per = sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == dev0)
    return per, sum(x.nbytes for x in leaves)


def greedy_outputs(engine, prompts: list[list[int]]) -> dict:  # noqa: ANN001
    """{request id: greedy tokens and top-5 logprobs} of each prompt, 8 tokens each, from an
    Engine or a ReplicaPool."""
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, prompt_logprobs=3,
                            ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    outs: dict = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                c = o.outputs[0]
                outs[o.request_id] = {"tokens": list(c.token_ids), "logprobs": [
                    {str(k): float(v) for k, v in lp.items()} for lp in c.logprobs],
                    "prompt_logprobs": [{str(k): float(v) for k, v in lp.items()}
                                        for lp in o.prompt_logprobs[1:]]}
    return outs


def engine_options() -> dict:
    """The default run compiles FEW_TOKEN_BUCKETS; the full grid the default buckets."""
    return {} if run_slow() else {"token_buckets": FEW_TOKEN_BUCKETS}


@functools.lru_cache(maxsize=None)
def model_of(kv_heads: int):  # noqa: ANN201 - LoadedModel
    heads, vocab = MODELS[kv_heads]
    if kv_heads != 8:
        return tiny_model(num_heads=heads, num_kv_heads=kv_heads, head_dim=8, hidden_size=64,
                          intermediate_size=128, vocab_size=vocab)
    tok = train_bpe_tokenizer(pathlib.Path(tempfile.mkdtemp(prefix="tp-bpe-")), vocab)
    model = tiny_model(num_heads=heads, num_kv_heads=kv_heads, head_dim=8, hidden_size=64,
                       intermediate_size=128, vocab_size=vocab,
                       eos_token_ids=tok.eos_token_ids)
    return dataclasses.replace(model, tokenizer=tok)


def structured_outputs(engine) -> dict:  # noqa: ANN001
    """{request id: tokens and text} of seeded temperature-1 requests under `STRUCTURED`."""
    for i, spec in enumerate(STRUCTURED):
        engine.add_request(f"s{i}", [5, 6, 7], SamplingParams(
            temperature=1.0, seed=i, max_tokens=48, structured_outputs=spec))
    outs: dict = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                c = o.outputs[0]
                outs[o.request_id] = {"tokens": list(c.token_ids), "text": c.text,
                                      "finish_reason": c.finish_reason.value}
    return outs


def run(kv_heads: int, tp: int) -> dict:
    heads = MODELS[kv_heads][0]
    eng = tiny_engine(model_of(kv_heads), tensor_parallel_size=tp, **engine_options())
    outs = greedy_outputs(eng, PROMPTS)
    structured = structured_outputs(eng) if kv_heads == 8 else {}
    p_dev, p_all = shard_bytes(eng.runner.params)
    kv_dev, kv_all = shard_bytes(eng.runner.kv_pages)
    model = model_of(kv_heads)
    return {"heads": heads, "kv_heads": kv_heads, "tp": tp, "outputs": outs,
            "structured": structured,
            # TP only reorders the model's sums: support.numerics's bound, from its weights.
            "logprob_atol": model_logprob_atol(model.config, model.params,
                                               eng.config.max_model_len),
            "compiles_after_warmup": eng.runner.compiles_after_warmup,
            "param_bytes_device0": p_dev, "param_bytes_total": p_all,
            "kv_bytes_device0": kv_dev, "kv_bytes_total": kv_all,
            "num_pages": eng.plan.scheduler.num_pages}


# Quantized weights under TP (the 8-KV-head model): int4 in groups of 32 (wo / w_down split by
# input rows: 2 and 4 groups per layer, split with them) with the vocabulary-sharded lm_head
# quantized too; with JAXSERVE_RUN_SLOW=1 also int8 per column (scales replicated over the
# split rows) and fp8.
QUANT_ROWS = ({"quantization": "int4", "quantization_group_size": 32, "quantize_lm_head": True},)
QUANT_SLOW_ROWS = ({"quantization": "int8"}, {"quantization": "fp8"})


def run_quantized(options: dict, tp: int) -> dict:
    # Float activations at every TP: split weights run XLA's dots, where int8 activations
    # (the CPU dense kernel's integer dots, on by default at TP 1) do not exist, so TP 1 and
    # TP 2 then differ only in the order of their sums.
    eng = tiny_engine(model_of(8), tensor_parallel_size=tp, int8_activations="off", **options,
                      **engine_options())
    outs = greedy_outputs(eng, PROMPTS)
    p_dev, p_all = shard_bytes(eng.runner.params)
    compiles = eng.runner.compiles_after_warmup  # before the bound's head matmul compiles
    return {"options": options, "tp": tp, "outputs": outs,
            "logprob_atol": model_logprob_atol(model_of(8).config, eng.runner.params,
                                               eng.config.max_model_len),
            "compiles_after_warmup": compiles,
            "param_bytes_device0": p_dev, "param_bytes_total": p_all}


def serve_grpc(kv_heads: int, tp: int) -> dict:
    """The gRPC server over a TP engine: greedy streams of the same prompts."""
    from jaxserve.server.background import BackgroundServer
    from jaxserve.server.client import Client
    from jaxserve.server.config import ServerConfig
    from jaxserve.serving.served import ServedModel

    model = model_of(kv_heads)
    factory = lambda: ServedModel(tiny_engine(model, tensor_parallel_size=tp,  # noqa: E731
                                              **engine_options()), "tiny", "hf")
    with BackgroundServer(ServerConfig(port=0, http_port=None), factory) as srv, \
            Client(srv.target) as client:
        params = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
        tokens = {f"r{i}": client.generate(p, params)[0].token_ids
                  for i, p in enumerate(PROMPTS)}
    return {"kv_heads": kv_heads, "tp": tp, "tokens": tokens}


def memory_maps() -> dict:
    """This process's memory mappings against the kernel's per-process cap (Linux: one map per
    JIT-compiled XLA:CPU code and data region, so the count grows with every executable)."""
    try:
        count = len(pathlib.Path("/proc/self/maps").read_text().splitlines())
        limit = int(pathlib.Path("/proc/sys/vm/max_map_count").read_text())
    except OSError:  # not Linux: nothing to guard
        return {"count": 0, "limit": 1}
    return {"count": count, "limit": limit}


def part(name: str) -> dict:
    """One worker process's share of the grid: {"offline": rows, "grpc": .., "quantized": ..}.

    Why parts: every engine here compiles its bucket set for 8 devices, and each XLA:CPU
    executable holds its own memory mappings. The whole slow grid in one process (19 engines)
    reached the kernel's vm.max_map_count (65,530) after ~450 s, where LLVM fails with "Cannot
    allocate memory" and the process dies; one model (or one quantization) per process stays
    far below it (`memory_maps` is reported, and the test checks the headroom).
    """
    if name == "default":
        return {"offline": [run(kv, tp) for kv, tp in DEFAULT_ROWS],
                "grpc": serve_grpc(*DEFAULT_ROWS[-1]),
                "quantized": [run_quantized(o, tp) for o in QUANT_ROWS for tp in (1, 2)]}
    kind, _, arg = name.partition(":")
    if kind == "offline":  # one model at every TP size
        return {"offline": [run(int(arg), tp) for tp in TP_SIZES]}
    if kind == "grpc":  # TP 4 with the 2 KV heads replicated
        return {"grpc": serve_grpc(2, 4)}
    if kind == "quantized":
        options = (QUANT_ROWS + QUANT_SLOW_ROWS)[int(arg)]
        return {"quantized": [run_quantized(options, tp) for tp in (1, 2)]}
    raise ValueError(f"unknown tp_worker part {name!r}")


# The slow run's parts, one process each (see `part`).
SLOW_PARTS = (*(f"offline:{kv}" for kv in MODELS), "grpc",
              *(f"quantized:{i}" for i in range(len(QUANT_ROWS + QUANT_SLOW_ROWS))))


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.devices()
    doc = part(sys.argv[1] if len(sys.argv) > 1 else "default")
    json.dump({**doc, "memory_maps": memory_maps()}, sys.stdout)

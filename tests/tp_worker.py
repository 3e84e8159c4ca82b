"""Runs in a subprocess with 8 virtual CPU devices (XLA_FLAGS set by the caller): tiny engines
at several tensor-parallel sizes, printed as one JSON document for tests/test_tensor_parallel.py.

For each model (heads/KV heads) and TP size: greedy tokens, top-5 logprobs and top-3 prompt
logprobs of 3 prompts,
compiles after warmup, per-device and total bytes of the parameters and of the KV pages.
"""

from __future__ import annotations

import json
import sys

import jax
from engine_fixtures import tiny_engine, tiny_model  # noqa: E402 - run with tests/ on the path

from jaxserve.engine.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], list(range(20, 70))]


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


def run(heads: int, kv_heads: int, tp: int, vocab: int) -> dict:
    model = tiny_model(num_heads=heads, num_kv_heads=kv_heads, head_dim=8, hidden_size=64,
                       intermediate_size=128, vocab_size=vocab)
    eng = tiny_engine(model, tensor_parallel_size=tp)
    outs = greedy_outputs(eng, PROMPTS)
    p_dev, p_all = shard_bytes(eng.runner.params)
    kv_dev, kv_all = shard_bytes(eng.runner.kv_pages)
    return {"heads": heads, "kv_heads": kv_heads, "tp": tp, "outputs": outs,
            "compiles_after_warmup": eng.runner.compiles_after_warmup,
            "param_bytes_device0": p_dev, "param_bytes_total": p_all,
            "kv_bytes_device0": kv_dev, "kv_bytes_total": kv_all,
            "num_pages": eng.plan.scheduler.num_pages}


def serve_grpc(tp: int) -> dict:
    """The gRPC server over a TP engine: greedy streams of the same prompts."""
    from jaxserve.server.background import BackgroundServer
    from jaxserve.server.client import Client
    from jaxserve.server.config import ServerConfig
    from jaxserve.serving.build import ServedModel

    model = tiny_model(num_heads=8, num_kv_heads=2, head_dim=8, hidden_size=64,
                       intermediate_size=128, vocab_size=256)
    factory = lambda: ServedModel(tiny_engine(model, tensor_parallel_size=tp), "tiny", "hf")  # noqa: E731
    with BackgroundServer(ServerConfig(port=0, http_port=None), factory) as srv, \
            Client(srv.target) as client:
        params = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
        return {f"r{i}": client.generate(p, params)[0].token_ids for i, p in enumerate(PROMPTS)}


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.devices()
    rows = [run(h, kv, tp, vocab) for h, kv, vocab in ((8, 8, 256), (8, 2, 256), (8, 4, 211))
            for tp in (1, 2, 4, 8)]
    json.dump({"offline": rows, "grpc_tp4": serve_grpc(4)}, sys.stdout)

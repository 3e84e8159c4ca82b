"""Runs in a subprocess with 8 virtual CPU devices (XLA_FLAGS set by the caller): data-parallel
replicas, offline and behind the gRPC server, printed as one JSON document for
tests/serving/test_data_parallel.py.

Offline: for two tiny models (8 KV heads, dividing TP 2; 1 KV head, which TP 2 replicates),
DP 2 x TP 2 and DP 2 x TP 1 engines (`build_offline_engine` -> ReplicaPool) against TP 1:
greedy tokens and top-5 logprobs of more prompts than one replica's share, the logits of the
full-sequence forward on each replica's params, compiles after warmup per replica, the devices
and per-device bytes of each replica, and how many steps each replica ran. `LLM(model=DIR,
data_parallel_size=2, tensor_parallel_size=2)` loads each replica from a saved checkpoint.
Served: a DP 2 x TP 2 gRPC server (metrics on) answers the same prompts; which replica served
what comes from the metrics' `engine` label.

By default the offline rows are DEFAULT_ROWS only and every engine compiles FEW_TOKEN_BUCKETS;
with JAXSERVE_RUN_SLOW=1 both models at DP 2 x TP 2 and DP 2 x TP 1, with the default buckets.
"""

from __future__ import annotations

import json
import pathlib
import sys
import urllib.request

import jax
import numpy as np
from support.engine_fixtures import (  # noqa: E402 - run with tests/ on the path
    FEW_TOKEN_BUCKETS, run_slow, tiny_engine, tiny_model)
from prometheus_client.parser import text_string_to_metric_families
from support.numerics import logits_atol, model_logprob_atol
from support.workers.tp_worker import greedy_outputs, shard_bytes

from jaxserve.config import EngineConfig
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.sizing import available_host_memory
from jaxserve.models import decoder
from jaxserve.serving.served import build_offline_engine

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], list(range(20, 70)), [3, 1, 4, 1, 5, 9, 2, 6],
           list(range(100, 140)), [42]]
BASE = dict(max_num_seqs=8, max_num_batched_tokens=64, page_size=8, max_model_len=256,
            attention_impl="reference",
            **({} if run_slow() else {"token_buckets": FEW_TOKEN_BUCKETS}))
MODELS = {"kv_divides": dict(num_heads=8, num_kv_heads=8), "kv_replicated":
          dict(num_heads=8, num_kv_heads=1)}
SIZES = ((1, 1), (2, 2), (2, 1))  # (dp, tp); (1, 1) is the oracle
# (model, dp, tp) of the default run: DP 2 x TP 2 (each replica's KV heads replicated over its
# two devices) and its TP 1 oracle, which the served and checkpoint runs compare with too.
DEFAULT_ROWS = (("kv_replicated", 1, 1), ("kv_replicated", 2, 2))


def model_of(name: str):  # noqa: ANN201 - LoadedModel
    return tiny_model(**MODELS[name], head_dim=8, hidden_size=64, intermediate_size=128,
                      vocab_size=256)


def full_logits(params, cfg) -> np.ndarray:  # noqa: ANN001
    """Logits of every prompt position with the plain full-sequence forward: under sharded
    params XLA partitions it as the engine's step is, so this compares the logits themselves
    (the engine reports only the top logprobs)."""
    T = max(len(p) for p in PROMPTS)
    tokens = np.zeros((len(PROMPTS), T), np.int32)
    for i, p in enumerate(PROMPTS):
        tokens[i, :len(p)] = p
    lens = np.array([len(p) for p in PROMPTS], np.int32)
    out = np.asarray(decoder.forward_jit(params, tokens, lens, cfg=cfg))
    mask = np.arange(T)[None, :] < lens[:, None]
    return out[mask]


def run(name: str, dp: int, tp: int) -> dict:
    model = model_of(name)
    if dp == 1 and tp == 1:
        return {"model": name, "dp": 1, "tp": 1,
                "outputs": greedy_outputs(tiny_engine(model, **BASE), PROMPTS),
                # Two layouts (DP x TP against TP 1) of this model: support.numerics's bounds.
                "logprob_atol": model_logprob_atol(model.config, model.params,
                                                   BASE["max_model_len"])}
    # DP x TP 1 sizes its KV pages from a sliver of host memory (below what the sequences
    # could use): the replicas must still agree on one page count.
    extra = {}
    if tp == 1:  # about 100 pages: KV bytes per page are 2 layers x K,V x Hkv x 8 x 8 x 4
        page_bytes = 2 * 2 * MODELS[name]["num_kv_heads"] * 8 * 8 * 4
        extra = {"kv_cache_memory_fraction": 100 * page_bytes / (available_host_memory() // dp)}
    pool = build_offline_engine(EngineConfig(**BASE, **extra, data_parallel_size=dp,
                                             tensor_parallel_size=tp), model, progress=False)
    outputs = greedy_outputs(pool, PROMPTS)
    # Read before the logits check below, whose forward compiles (the guard is process-wide).
    compiles = [e.runner.compiles_after_warmup for e in pool.engines]
    replicas = []
    for e, compiled in zip(pool.engines, compiles):
        first = e.runner.mesh.devices.flat[0]
        p_dev, p_all = shard_bytes(e.runner.params, first)
        kv_dev, kv_all = shard_bytes(e.runner.kv_pages, first)
        ref = full_logits(model.params, model.config)  # TP 1, on device 0
        got = full_logits(e.runner.params, e.runner.model_cfg)
        replicas.append({
            "logits_err": float(np.abs(got - ref).max()),
            "logits_atol": logits_atol(model.config, model.params, got.shape[1]),
            "devices": [d.id for d in e.runner.mesh.devices.flat],
            "kv_devices": sorted(d.id for d in e.runner.kv_pages.devices()),
            "param_devices": sorted({d.id for x in jax.tree.leaves(e.runner.params)
                                     for d in x.devices()}),
            "compiles_after_warmup": compiled,
            "steps": e.num_steps, "num_pages": e.plan.scheduler.num_pages,
            "param_bytes_first_device": p_dev, "param_bytes_total": p_all,
            "kv_bytes_first_device": kv_dev, "kv_bytes_total": kv_all})
    return {"model": name, "dp": dp, "tp": tp, "outputs": outputs, "replicas": replicas}


def offline_llm_from_dir(dp: int, tp: int) -> dict:
    """`LLM(model=DIR, data_parallel_size=dp, ...)`: each replica loads the saved checkpoint
    straight onto its own devices (no model passed in)."""
    import tempfile

    from support.hf_models import save_tiny_tokenizer

    from jaxserve.llm import LLM
    from jaxserve.models.hf_loader import save_hf_dir

    model = model_of("kv_replicated")
    with tempfile.TemporaryDirectory() as d:
        save_hf_dir(pathlib.Path(d), model.config, model.params)
        save_tiny_tokenizer(pathlib.Path(d), 256)
        llm = LLM(model=d, **BASE, data_parallel_size=dp, tensor_parallel_size=tp)
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8,
                                                    ignore_eos=True), use_tqdm=False)
    return {"tokens": {f"r{i}": list(o.outputs[0].token_ids) for i, o in enumerate(outs)},
            "replica_devices": [[d.id for d in e.runner.mesh.devices.flat]
                                for e in llm.engine.engines],
            "compiles_after_warmup": [e.runner.compiles_after_warmup for e in llm.engine.engines]}


def serve_grpc(dp: int, tp: int) -> dict:
    """A DP x TP gRPC server: the tokens it streams, and each replica's generated tokens."""
    from jaxserve.server.background import BackgroundServer
    from jaxserve.server.client import Client
    from jaxserve.server.config import ServerConfig
    from jaxserve.serving.served import build_served

    model = model_of("kv_replicated")
    cfg = EngineConfig(**BASE, data_parallel_size=dp, tensor_parallel_size=tp)
    factory = lambda: build_served(cfg, model, progress=False)  # noqa: E731
    params = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
    with BackgroundServer(ServerConfig(port=0, http_port=None, metrics_port=0), factory) as srv, \
            Client(srv.target) as client:
        tokens = {f"r{i}": client.generate(p, params)[0].token_ids for i, p in enumerate(PROMPTS)}
        url = f"http://127.0.0.1:{srv.server.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        compiles = [r.engine.runner.compiles_after_warmup for r in srv.server.engine.replicas]
    per_engine = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "jaxserve:generation_tokens_total":
                per_engine[s.labels["engine"]] = s.value
    return {"tokens": tokens, "generation_tokens_by_engine": per_engine,
            "compiles_after_warmup": compiles}


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.devices()
    rows = [run(name, dp, tp) for name in MODELS for dp, tp in SIZES] if run_slow() else \
        [run(*row) for row in DEFAULT_ROWS]
    json.dump({"offline": rows, "llm_dir_dp2_tp2": offline_llm_from_dir(2, 2),
               "grpc_dp2_tp2": serve_grpc(2, 2)}, sys.stdout)

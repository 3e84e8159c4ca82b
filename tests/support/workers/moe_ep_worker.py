"""Runs in a subprocess with 8 virtual CPU devices (XLA_FLAGS set by the caller): tiny MoE
models under expert parallelism, printed as one JSON document for
tests/device/test_expert_parallel.py.

Models: HF config.json dicts (hidden 64, 8 heads and 8 KV heads of 8, so attention splits
over 2 / 4 / 8 devices; 8 experts of 32, top-2) with random weights at the test suite's
scale (sharp router logits: each token's top-k is decided by margins far above the sums'
reordering), written as HF safetensors folders (one tensor per expert) and loaded by the
engine as `jaxserve generate --model DIR` loads them (straight into the expert-parallel
layout: `placement.place_params` hands each device its own box of the stacked experts):
  - "qwen3-moe": top-2 renormalised, qk-norm, four layers of which layer 1 is dense
    (mlp_only_layers: scan groups [0], [1], [2, 3]; the dense one tensor parallel; XLA
    unrolls the one-layer scans, the last stays a while loop);
  - "qwen2-moe": a shared expert of 48 with its sigmoid gate (split on its width, its
    partial sum joins the experts' psum), q/k/v biases;
  - "mixtral": top-2 of 8.
Each row (model, tp, ep) reports: greedy tokens, top-5 logprobs and top-3 prompt logprobs of
tp_worker's prompts; compiles after warmup; each device's bytes and box of each expert
stack; the collectives of the compiled step (forward_jit of its one token bucket of 64, as
the runner lowers it; one bucket because the step compiles are most of the worker's time),
counted by op and by how many while loops enclose them (`collectives_by_depth`); the
model's logprob tolerance. Parts: "default" (DEFAULT_ROWS), "slow" (the rest of ROWS).
"""

from __future__ import annotations

import json
import pathlib
import re
import sys
import tempfile

import jax
from support.numerics import model_logprob_atol
from support.workers.tp_worker import PROMPTS, greedy_outputs

from jaxserve.config import EngineConfig
from jaxserve.device.model_runner import empty_batch, forward_jit, to_step_inputs
from jaxserve.models import families, tiny
from jaxserve.models.loading import load_model
from jaxserve.serving.build import build_engine

_BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=8, head_dim=8,
             max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1e6,
             bos_token_id=1, eos_token_id=2, num_experts_per_tok=2)
CONFIGS = {
    "qwen3-moe": dict(_BASE, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                      num_hidden_layers=4, num_experts=8, moe_intermediate_size=32,
                      norm_topk_prob=True, mlp_only_layers=[1]),
    "qwen2-moe": dict(_BASE, architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe",
                      num_experts=8, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48),
    "mixtral": dict(_BASE, architectures=["MixtralForCausalLM"], model_type="mixtral",
                    num_local_experts=8, intermediate_size=32),
}
ROWS = [(m, tp, ep) for m in CONFIGS for tp, ep in ((1, False), (2, True), (4, True),
                                                    (8, True), (2, False))]
DEFAULT_ROWS = [("qwen3-moe", 1, False), ("qwen3-moe", 4, True)]
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute",
               "all-to-all", "ragged-all-to-all")


def collectives_by_depth(hlo: str) -> dict[str, list[int]]:
    """{op: [count at loop depth 0, 1, 2, ...]} of the collectives of a compiled module's
    text, depth = the number of while loops around the op on its call path from ENTRY (the
    layer scan's body is depth 1; a loop inside a layer, like the CPU tile loop, depth 2).
    A computation called from several places counts once per call site."""
    comps: dict[str, list[str]] = {}
    entry, name = None, None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            name = head.group(2)
            comps[name] = []
            entry = name if head.group(1) else entry
        elif line == "}":
            name = None
        elif name is not None:
            comps[name].append(line)
    counts = {op: [0] * 8 for op in COLLECTIVES}

    def walk(comp: str, depth: int) -> None:
        for line in comps[comp]:
            for op in COLLECTIVES:
                if re.search(rf"\s{op}(?:-start)?\(", line):
                    counts[op][depth] += 1
            for kind, callee in re.findall(r"(body|condition|calls|to_apply)=%([\w.\-]+)",
                                           line):
                if kind != "condition":
                    walk(callee, depth + (kind == "body"))
            for group in re.findall(r"(?:branch_computations|called_computations)=\{([^}]*)\}",
                                    line):
                for callee in re.findall(r"%([\w.\-]+)", group):
                    walk(callee, depth)

    assert entry is not None, "no ENTRY computation"
    walk(entry, 0)
    return {op: c[:max((i + 1 for i, n in enumerate(c) if n), default=0)]
            for op, c in counts.items()}


def step_hlo(eng) -> tuple[str, list[int]]:  # noqa: ANN001 - an Engine
    """The compiled forward of the engine's smallest bucket, lowered as the runner lowers it,
    and that bucket (tokens, seqs)."""
    r = eng.runner
    t, s = r.shape.buckets[0]
    inputs, _, _ = jax.device_put(to_step_inputs(empty_batch(r.shape, t, s, False)),
                                  r.inputs_sharding)
    text = forward_jit.lower(r.params, r.kv_pages, inputs, r._feed, cfg=r.model_cfg,
                             attn_impl=r.attn_impl, mesh=r.mesh,
                             expert_parallel=r.expert_parallel).compile().as_text()
    return text, [t, s]


def _box(a: jax.Array, device: jax.Device) -> list[list[int]]:
    """[[first expert, past the last], [first column, past the last]] of `a`'s shard on
    `device`."""
    index = next(s.index for s in a.addressable_shards if s.device == device)
    return [list(index[ax].indices(a.shape[ax])[:2]) for ax in (1, 3)]


def run(name: str, tp: int, ep: bool, folder: pathlib.Path) -> dict:
    cfg = families.config_from_hf(CONFIGS[name], f"{name}/config.json")
    path = folder / name
    if not path.exists():
        tiny.write_tiny_checkpoint(path, cfg, seed=2, scale=tiny.TEST_INIT_SCALE)
    config = EngineConfig(model=str(path), tensor_parallel_size=tp, enable_expert_parallel=ep,
                          max_num_seqs=8, max_num_batched_tokens=64, page_size=8,
                          max_model_len=256, attention_impl="cpu",
                          token_buckets=(64,))
    eng = build_engine(config, warmup=True, progress=False)
    layers = eng.runner.params.layers
    # each device's bytes of each expert stack, and the whole stack's
    experts = {f: [[sum(s.data.nbytes for s in getattr(layers, f).addressable_shards
                        if s.device == d) for d in jax.devices()[:tp]],
                   getattr(layers, f).nbytes]
               for f in ("we_gate", "we_up", "we_down")}
    # each device's box of each stack [L, E, in, out]: (experts, output columns)
    boxes = {f: [_box(getattr(layers, f), d) for d in jax.devices()[:tp]]
             for f in ("we_gate", "we_up", "we_down")}
    outputs = greedy_outputs(eng, PROMPTS)
    compiles = eng.runner.compiles_after_warmup  # before step_hlo compiles once more
    # (one device's step has no collectives: its compile is skipped)
    hlo, bucket = step_hlo(eng) if tp > 1 else ("ENTRY %e () -> () {\n}", None)
    host = load_model(path)
    return {"model": name, "tp": tp, "ep": ep, "outputs": outputs,
            "expert_bytes": experts, "expert_boxes": boxes, "hidden": cfg.hidden_size,
            "layer_groups": [[g.start, g.stop] for g in cfg.layer_groups],
            "sparse_groups": sum(g.spec.moe is not None for g in cfg.layer_groups),
            "dense_groups": sum(g.spec.moe is None for g in cfg.layer_groups),
            "collectives": collectives_by_depth(hlo), "bucket": bucket,
            "psums": re.findall(r"= (\w+\[[\d,]*\])\{[\d,]*\} all-reduce\([^\n]*shard_map/psum",
                                hlo),
            "compiles_after_warmup": compiles,
            "logprob_atol": model_logprob_atol(host.config, host.params,
                                               eng.config.max_model_len)}


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.devices()
    part = sys.argv[1] if len(sys.argv) > 1 else "default"
    rows = DEFAULT_ROWS if part == "default" else [
        r for r in ROWS if r not in DEFAULT_ROWS or r[1] == 1]
    with tempfile.TemporaryDirectory(prefix="moe-ep-") as d:
        json.dump([run(*r, pathlib.Path(d)) for r in rows], sys.stdout)

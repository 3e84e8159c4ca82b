"""A roofline model of the engine's step for Llama-3-8B on H200, TPU v5e and TPU v6e.

Plain arithmetic (no jax): what a decode step, a 2k prefill step and the output tokens/s should
cost on each chip, from the bytes a step moves and the FLOPs it runs, so the first device run
is judged against a stated expectation (docs/benchmarks/perf-model.md).

    step = max(bytes_per_chip / (eta_bw * HBM_BW), flops_per_chip / (eta_flops * peak))
           + all-reduce time (tensor parallelism only) + a fixed per-step overhead

What it reuses rather than restates: the model shape is a ModelConfig, for Llama-3-8B
`models.shapes.llama3_8b()` (what the export tests and the device check use; importing it loads
no jax); the padded step shapes come from the engine's own planner (`sizing.plan_engine` with
`batch.default_token_buckets`, then `batch.bucket_for`), so a batch of 32 costs what the 32
bucket costs.

`scripts/bench/perf_model.py` prints its tables (`--json`: every figure);
`tests/scripts/test_perf_model.py` checks the arithmetic against hand-worked figures.
"""

from __future__ import annotations

import dataclasses
import math

from jaxserve.config import EngineConfig
from jaxserve.engine.batch import bucket_for
from jaxserve.engine.sizing import plan_engine
from jaxserve.models.config import ModelConfig


# --------------------------------------------------------------------------- the chips
@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    hbm_bytes: float     # capacity per chip
    hbm_bw: float        # bytes/s per chip (vendor peak)
    bf16_flops: float    # dense (no sparsity) bf16 FLOP/s
    int8_ops: float      # dense int8 OP/s
    link_bw: float       # bytes/s one way per chip for an all-reduce (ring); see
                         # docs/benchmarks/perf-model.md
    overhead_s: float    # fixed cost per step: dispatch, host gap left after overlap
    source: str


CHIPS = {
    "h200": Chip("H200 SXM", 141e9, 4.8e12, 989e12, 1979e12, 450e9, 300e-6,
                 "NVIDIA H200 datasheet: 141 GB HBM3e, 4.8 TB/s, BF16 1,979 TFLOPS and INT8 "
                 "3,958 TOPS with 2:4 sparsity (dense: half), NVLink 900 GB/s both ways"),
    # Only for the peers' H100 figures (same chip as H200 but 80 GB at 3.35 TB/s).
    "h100": Chip("H100 SXM", 80e9, 3.35e12, 989e12, 1979e12, 450e9, 300e-6,
                 "NVIDIA H100 datasheet: 80 GB HBM3, 3.35 TB/s, BF16 1,979 TFLOPS sparse"),
    "v5e": Chip("TPU v5e", 16e9, 819e9, 197e12, 393e12, 200e9, 100e-6,
                "https://docs.cloud.google.com/tpu/docs/v5e: 16 GB HBM2, 819 GBps, "
                "197 bf16 TFLOPs, 393 int8 TOPs, ICI 400 GBps bidirectional per chip"),
    "v6e": Chip("TPU v6e", 32e9, 1638e9, 918e12, 1836e12, 400e9, 100e-6,
                "https://docs.cloud.google.com/tpu/docs/v6e: 32 GB HBM, 1638 GBps, "
                "918 bf16 TFLOPs, 1836 int8 TOPs, ICI 800 GBps bidirectional per chip"),
}


@dataclasses.dataclass(frozen=True)
class Assumptions:
    eta_bw: float = 0.80        # achievable fraction of peak HBM bandwidth in a decode step
    eta_flops: float = 0.60     # achievable fraction of peak matmul FLOP/s in a prefill step
    hbm_usable: float = 0.90    # fraction of HBM the engine may fill (weights + KV pages)
    allreduce_latency_s: float = 10e-6  # fixed cost of one small all-reduce (launch + hops)
    act_bytes_per_token_layer: tuple[int, int] = (12, 6)  # (x hidden, x intermediate) elems
    q_block: int = 128          # prefill query block: KV is read once per block of queries


# --------------------------------------------------------------------------- the model
@dataclasses.dataclass(frozen=True)
class Weights:
    """Parameter counts of a Llama-family config and their bytes in a weight format."""
    layer_matrix: int   # q, k, v, o, gate, up, down summed over layers
    layer_vector: int   # norms and biases summed over layers, plus the final norm
    embed: int
    lm_head: int        # 0 when tied (the embedding is then the head)
    matrix_outputs: int  # output channels of every matrix: one int8 scale each

    @classmethod
    def of(cls, cfg: ModelConfig) -> "Weights":
        h, q, kv, i, n = (cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size,
                          cfg.num_layers)
        matrix = n * (h * q + 2 * h * kv + q * h + 3 * h * i)
        vector = n * (2 * h + (q + 2 * kv if cfg.attention_bias else 0)
                      + (2 * cfg.head_dim if cfg.qk_norm else 0)) + h
        embed = cfg.vocab_size * h
        head = 0 if cfg.tie_word_embeddings else embed
        outs = n * (q + 2 * kv + h + 2 * i + h) + cfg.vocab_size * (1 if head == 0 else 2)
        return cls(matrix, vector, embed, head, outs)

    @property
    def params(self) -> int:
        return self.layer_matrix + self.layer_vector + self.embed + self.lm_head

    def bytes(self, fmt: str) -> int:
        """Stored bytes: bf16 everywhere, or int8 matrices (embedding and head included) with
        one f32 scale per output channel and bf16 norms."""
        if fmt == "bf16":
            return 2 * self.params
        if fmt == "int8":
            return (self.layer_matrix + self.embed + self.lm_head + 4 * self.matrix_outputs
                    + 2 * self.layer_vector)
        raise ValueError(f"fmt={fmt!r} must be 'bf16' or 'int8'")

    def bytes_read_per_step(self, fmt: str, tokens: int, hidden: int) -> int:
        """A step reads every weight once except the embedding table, of which it gathers one
        row per token (the head, untied, is read whole)."""
        per = 1 if fmt == "int8" else 2
        table = self.embed * per + (4 * (self.embed // hidden) if fmt == "int8" else 0)
        return self.bytes(fmt) - table + tokens * hidden * per


def kv_bytes_per_token(cfg: ModelConfig, kv_itemsize: int = 2) -> int:
    """K and V of one token in every layer: layers x 2 x kv heads x head dim x itemsize."""
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv_itemsize


@dataclasses.dataclass(frozen=True)
class Seq:
    """One sequence in a step: `q` new tokens after `ctx` tokens already in the cache."""
    q: int
    ctx: int


def step_cost(cfg: ModelConfig, fmt: str, seqs: list[Seq], bucket: tuple[int, int],
              kv_itemsize: int = 2, a: Assumptions = Assumptions(),
              logit_rows: int | None = None) -> dict:
    """Bytes, FLOPs and all-reduce payloads of one step, summed over all chips. `logit_rows`:
    rows the head runs on (None: one per padded sequence; speculative verification: every
    query token, perf_model_spec)."""
    w = Weights.of(cfg)
    tb, sb = bucket
    lr = sb if logit_rows is None else logit_rows
    h, i, n = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    kvt = kv_bytes_per_token(cfg, kv_itemsize)
    # Matmuls run on every padded token; logits only at one row per (padded) sequence.
    flops = 2 * w.layer_matrix * tb + 2 * h * cfg.vocab_size * lr
    attn = 0
    kv_read = 0
    for s in seqs:
        # Causal: new token j (1..q) attends to ctx + j keys. QK^T and PV: 4 x heads x dim.
        attn += 4 * cfg.num_heads * cfg.head_dim * n * (s.q * s.ctx + s.q * (s.q + 1) // 2)
        kv_read += math.ceil(s.q / a.q_block) * (s.ctx + s.q) * kvt
    real = sum(s.q for s in seqs)
    ch, ci = a.act_bytes_per_token_layer
    act = tb * n * (ch * h + ci * i) * 2 + lr * cfg.vocab_size * 4 * 3  # + f32 logits x 3
    return {"weight_read": w.bytes_read_per_step(fmt, tb, h), "kv_read": kv_read,
            "kv_write": real * kvt, "activations": act, "flops": flops + attn,
            "attn_flops": attn, "allreduce_bytes": tb * h * 2, "allreduces": 2 * n,
            "logits_bytes": lr * cfg.vocab_size * 4}


def step_time(cost: dict, chip: Chip, tp: int = 1,
              a: Assumptions = Assumptions()) -> dict:
    """Seconds for one step on `tp` chips (weights, KV heads and FLOPs split evenly)."""
    moved = cost["weight_read"] + cost["kv_read"] + cost["kv_write"] + cost["activations"]
    # int8 weights are modelled weight-only (w8a16): dequantized into bf16 matmuls.
    t_mem = moved / tp / (a.eta_bw * chip.hbm_bw)
    t_flop = cost["flops"] / tp / (a.eta_flops * chip.bf16_flops)
    t_comm = 0.0
    if tp > 1:
        ring = 2 * (tp - 1) / tp
        t_comm = cost["allreduces"] * (a.allreduce_latency_s
                                       + ring * cost["allreduce_bytes"] / chip.link_bw)
        # Vocabulary-split head: the logits are gathered once per step.
        t_comm += a.allreduce_latency_s + (tp - 1) / tp * cost["logits_bytes"] / chip.link_bw
    total = max(t_mem, t_flop) + t_comm + chip.overhead_s
    return {"s": total, "mem_s": t_mem, "flop_s": t_flop, "comm_s": t_comm,
            "bound": "memory" if t_mem >= t_flop else "compute", "bytes_per_chip": moved / tp}


# --------------------------------------------------------------------------- the engine
def engine_buckets(cfg: ModelConfig, max_num_seqs: int = 256,
                   max_num_batched_tokens: int = 2048,
                   token_buckets: tuple[int, ...] | None = None) -> tuple[tuple[int, int], ...]:
    """The (tokens, seqs) buckets the engine compiles for this budget (its own planner)."""
    ecfg = EngineConfig(dtype="bfloat16", max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max_num_batched_tokens, max_model_len=4096,
                        kv_cache_memory=1 << 30, token_buckets=token_buckets)
    return plan_engine(ecfg, cfg, 2, 1 << 40).batch_shape.buckets


def fits(cfg: ModelConfig, chip: Chip, fmt: str, tp: int, seqs: int, ctx: int,
         kv_itemsize: int = 2, a: Assumptions = Assumptions()) -> bool:
    need = Weights.of(cfg).bytes(fmt) + seqs * ctx * kv_bytes_per_token(cfg, kv_itemsize)
    return need / tp <= a.hbm_usable * chip.hbm_bytes


def min_tp(cfg: ModelConfig, chip: Chip, fmt: str, seqs: int, ctx: int,
           kv_itemsize: int = 2) -> int | None:
    """Smallest tensor-parallel degree (1, 2, 4, 8; at most the KV head count) that holds the
    weights and `seqs` sequences of `ctx` tokens; None when 8 chips do not."""
    for tp in (1, 2, 4, 8):
        if tp <= cfg.num_kv_heads and fits(cfg, chip, fmt, tp, seqs, ctx, kv_itemsize):
            return tp
    return None


def decode(cfg: ModelConfig, chip: Chip, fmt: str, batch: int, ctx: int, tp: int,
           buckets, kv_itemsize: int = 2, a: Assumptions = Assumptions()) -> dict:
    """One decode step of `batch` sequences at context `ctx`, in the engine's bucket."""
    bucket = bucket_for(batch, batch, buckets)
    cost = step_cost(cfg, fmt, [Seq(1, ctx)] * batch, bucket, kv_itemsize, a)
    t = step_time(cost, chip, tp, a)
    return {**t, "bucket": bucket, "out_tok_s": batch / t["s"], "cost": cost}


def prefill(cfg: ModelConfig, chip: Chip, fmt: str, prompt: int, tp: int, buckets,
            kv_itemsize: int = 2, a: Assumptions = Assumptions()) -> dict:
    """Prefill of one `prompt`-token prompt alone, chunked by the largest token bucket."""
    budget = buckets[-1][0]
    total, steps, done = 0.0, [], 0
    while done < prompt:
        q = min(budget, prompt - done)
        bucket = bucket_for(q, 1, buckets)
        t = step_time(step_cost(cfg, fmt, [Seq(q, done)], bucket, kv_itemsize, a), chip, tp,
                      a)
        total += t["s"]
        steps.append({"tokens": q, "bucket": bucket, **t})
        done += q
    return {"s": total, "steps": steps, "tok_s": prompt / total}


def serve(cfg: ModelConfig, chip: Chip, fmt: str, conc: int, in_len: int, out_len: int,
          tp: int, buckets, kv_itemsize: int = 2, a: Assumptions = Assumptions()) -> dict:
    """`conc` requests of `in_len` -> `out_len` tokens run as one wave: their prompts packed
    into full-budget prefill steps, then out_len - 1 decode steps at the mean context. (The
    engine interleaves the two; serialising them costs the same bytes and FLOPs.)"""
    budget = buckets[-1][0]
    per_step = max(1, budget // in_len)  # whole prompts per prefill step
    t_pre = 0.0
    left = conc
    while left > 0:
        k = min(per_step, left)
        if in_len <= budget:
            seqs = [Seq(in_len, 0)] * k
            bucket = bucket_for(k * in_len, k, buckets)
            t_pre += step_time(step_cost(cfg, fmt, seqs, bucket, kv_itemsize, a), chip, tp,
                               a)["s"]
        else:
            t_pre += k * prefill(cfg, chip, fmt, in_len, tp, buckets, kv_itemsize, a)["s"]
        left -= k
    mean_ctx = in_len + out_len // 2
    d = decode(cfg, chip, fmt, conc, mean_ctx, tp, buckets, kv_itemsize, a)
    t = t_pre + (out_len - 1) * d["s"]
    return {"s": t, "prefill_s": t_pre, "decode_step_s": d["s"],
            "out_tok_s": conc * out_len / t, "total_tok_s": conc * (in_len + out_len) / t}


# --------------------------------------------------------------------------- the peers
# Published figures for Llama-3(.1)-8B; the setting is modelled as closely as it is stated.
# conc: the stated concurrency (None: unstated, up to 512), cut to what fits in HBM.
JETSTREAM_PT = ("https://github.com/AI-Hypercomputer/jetstream-pytorch/blob/main/benchmarks/"
                "summary.md")
TRTLLM = ("https://github.com/NVIDIA/TensorRT-LLM/blob/v0.12.0/docs/source/performance/"
          "perf-overview.md")
PEERS = [
    dict(engine="JetStream-PyTorch", chip="v5e", tp=8, fmt="bf16", kv=2, conc=128,
         in_len=202, out_len=179, measured=8249.0, metric="out",
         setting="v5e-8, Llama-3-8B bf16, batch 128, cache 2048, ShareGPT 2000 prompts "
                 "(max in/out 1024/1024), 2024-04-24",
         url=JETSTREAM_PT),
    dict(engine="JetStream-PyTorch", chip="v5e", tp=8, fmt="int8", kv=1, conc=256,
         in_len=202, out_len=179, measured=10873.0, metric="out",
         setting="v5e-8, Llama-3-8B int8 weights + int8 KV, batch 256, cache 2048, ShareGPT",
         url=JETSTREAM_PT),
    dict(engine="vLLM-TPU (tpu-inference)", chip="v6e", tp=1, fmt="bf16", kv=2, conc=128,
         in_len=1199, out_len=123, measured=1415.14, metric="out",
         setting="Llama-3.1-8B, 1000 requests at once, 1199 in / ~123 out per request; chip "
                 "not stated in the PR (the project's dashboard runs v6e-1, PR #306); "
                 "total 15198 tok/s; vLLM's v6e-1 recipe uses max-num-seqs 128",
         url="https://github.com/vllm-project/tpu-inference/pull/1006"),
    dict(engine="TensorRT-LLM 0.12", chip="h200", tp=1, fmt="int8", kv=1, conc=None,
         in_len=2048, out_len=2048, measured=11093.62, metric="out",
         setting="H200, LLaMA v3 8B FP8 weights + FP8 KV, 2048/2048, max-load offline "
                 "(trtllm-bench); modelled as 1-byte weights and KV",
         url=TRTLLM),
    dict(engine="TensorRT-LLM 0.12", chip="h100", tp=1, fmt="bf16", kv=2, conc=None,
         in_len=2048, out_len=2048, measured=3986.83, metric="out",
         setting="H100 80GB, LLaMA v3 8B FP16 ('Mixed'), 2048/2048, max-load offline",
         url=TRTLLM),
]


def peer_rows(cfg: ModelConfig, a: Assumptions = Assumptions()) -> list[dict]:
    rows = []
    for p in PEERS:
        chip = CHIPS[p["chip"]]
        ctx = p["in_len"] + p["out_len"]
        # As many of the stated concurrent sequences as the chips' HBM holds.
        conc = 1
        while conc < (p["conc"] or 512) and fits(cfg, chip, p["fmt"], p["tp"], conc + 1, ctx,
                                                 p["kv"], a):
            conc += 1
        buckets = engine_buckets(cfg, max_num_seqs=conc)
        s = serve(cfg, chip, p["fmt"], conc, p["in_len"], p["out_len"], p["tp"], buckets,
                  p["kv"], a)
        rows.append({**p, "conc_modelled": conc, "predicted": s["out_tok_s"],
                     "measured_over_predicted": p["measured"] / s["out_tok_s"], "model": s})
    return rows


# --------------------------------------------------------------------------- the table
BATCHES = (1, 32, 128, 256)


def table(cfg: ModelConfig, ctx: int = 2048, a: Assumptions = Assumptions()) -> list[dict]:
    buckets = engine_buckets(cfg)
    rows = []
    for key in ("h200", "v5e", "v6e"):
        chip = CHIPS[key]
        for fmt in ("bf16", "int8"):
            for batch in BATCHES:
                tp = min_tp(cfg, chip, fmt, batch, ctx)
                if tp is None:
                    rows.append({"chip": key, "fmt": fmt, "batch": batch, "tp": None})
                    continue
                d = decode(cfg, chip, fmt, batch, ctx, tp, buckets, a=a)
                pf = prefill(cfg, chip, fmt, ctx, tp, buckets, a=a)
                rows.append({"chip": key, "fmt": fmt, "batch": batch, "tp": tp,
                             "bucket": d["bucket"], "decode_ms": d["s"] * 1e3,
                             "decode_bound": d["bound"], "comm_ms": d["comm_s"] * 1e3,
                             "gb_per_chip": d["bytes_per_chip"] / 1e9,
                             "out_tok_s": d["out_tok_s"], "prefill_2k_ms": pf["s"] * 1e3,
                             "prefill_bound": pf["steps"][0]["bound"],
                             "prefill_tok_s": pf["tok_s"]})
    return rows


def device_check_expectation(cfg: ModelConfig, a: Assumptions = Assumptions()) -> dict:
    """What scripts/device/device_engine_check.py should report on one H200 if the model holds: its
    defaults (64 sequences, context 2048, 64 decode steps; buckets 64/512/2048)."""
    chip = CHIPS["h200"]
    buckets = engine_buckets(cfg, max_num_seqs=64, token_buckets=(64, 512, 2048))
    d = decode(cfg, chip, "bf16", 64, 2048 + 32, 1, buckets, a=a)
    floor_bytes = (Weights.of(cfg).bytes("bf16")
                   + 64 * (2048 + 32) * kv_bytes_per_token(cfg))
    mixed = serve(cfg, chip, "bf16", 64, 1024, 128, 1, buckets, a=a)
    return {"decode_step_ms": d["s"] * 1e3, "decode_out_tok_s": d["out_tok_s"],
            "floor_ms_at_peak_bw": floor_bytes / chip.hbm_bw * 1e3,
            "mixed_out_tok_s": mixed["out_tok_s"], "mixed_total_tok_s": mixed["total_tok_s"],
            "prefill_2k_ms": prefill(cfg, chip, "bf16", 2048, 1, buckets, a=a)["s"] * 1e3}

"""The roofline model (`perf_model`) extended to speculative decoding with an EAGLE-3 head:
what Llama-3-8B on one H200 would gain at a given acceptance length (issue 33, part 4).

One speculative engine step of B sequences at context ctx, k proposals each:

    verify   one target step of B x (k+1) query tokens (the last token and k proposals),
             logits at every query token (`perf_model.step_cost(logit_rows=B(k+1))`);
    draft    k forwards of the EAGLE-3 head: the first over the k+1 positions the target
             just verified (its fc fuses three of the target's hidden states, 3 x hidden ->
             hidden), then k-1 forwards of one token per sequence (fed the head's own hidden
             state; no fc). Each forward: one Llama decoder layer whose q / k / v projections
             take 2 x hidden inputs (the token's embedding beside the hidden state), its own
             one-layer KV cache, a final norm and an lm_head over the draft vocabulary
             (32,000), at one row per sequence. The head shares the target's embedding table.

    t_spec = t_verify + sum of the k draft forwards, each max(bytes / (eta_bw BW),
             FLOPs / (eta_flops peak)) + `draft_overhead_s`
    out tok/s = B x tau / t_spec;   speed-up = tau x t_decode / t_spec

where tau, the acceptance length, is the mean number of tokens a sequence emits per target
step (accepted proposals + the bonus token; 1 <= tau <= k+1) and t_decode the plain decode
step. The draft forwards are assumed to run inside the step's one compiled program, so each
costs kernel launches (`draft_overhead_s`) rather than a step's host overhead; tau is an input
here, not predicted. Break-even: tau = t_spec / t_decode.
"""

from __future__ import annotations

import dataclasses

from jaxserve.cli.bench.perf_model import (CHIPS, Assumptions, Chip, Seq, decode,
                                           engine_buckets, step_cost, step_time)
from jaxserve.engine.batch import bucket_for
from jaxserve.models.config import ModelConfig

DRAFT_VOCAB = 32000  # the EAGLE-3 Llama-3 heads' draft vocabulary (draft -> target id map)
DRAFT_OVERHEAD_S = 20e-6  # launches of one draft forward (~15 kernels) inside the step
BATCHES = (1, 8, 32)
KS = (3, 5)
TAUS = (2, 3, 4)


@dataclasses.dataclass(frozen=True)
class Eagle3Head:
    """Parameter counts of an EAGLE-3 head for a Llama target (bf16)."""
    layer_matrix: int   # q, k, v from 2 x hidden; o; gate, up, down
    fc: int             # 3 x hidden -> hidden
    lm_head: int        # hidden -> draft vocab
    vectors: int        # input, hidden, post-attention and final norms
    kv_bytes_per_token: int  # its one layer's K and V, bf16

    @classmethod
    def of(cls, cfg: ModelConfig, draft_vocab: int = DRAFT_VOCAB) -> "Eagle3Head":
        h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
        return cls(layer_matrix=2 * h * q + 2 * (2 * h * kv) + q * h + 3 * h * i,
                   fc=3 * h * h, lm_head=h * draft_vocab, vectors=4 * h,
                   kv_bytes_per_token=2 * cfg.num_kv_heads * cfg.head_dim * 2)

    @property
    def params(self) -> int:
        return self.layer_matrix + self.fc + self.lm_head + self.vectors


def draft_forward_cost(cfg: ModelConfig, head: Eagle3Head, batch: int, q: int, ctx: int,
                       padded_tokens: int, first: bool,
                       a: Assumptions = Assumptions()) -> dict:
    """Bytes and FLOPs of one head forward: `batch` sequences of `q` new tokens after `ctx`
    in the head's cache, matmuls over `padded_tokens`; `first`: the fc runs (target
    features)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    matrix = head.layer_matrix + (head.fc if first else 0)
    weights = 2 * (matrix + head.lm_head + head.vectors) + padded_tokens * h * 2  # + embed rows
    kv_read = batch * (ctx + q) * head.kv_bytes_per_token
    kv_write = batch * q * head.kv_bytes_per_token
    ch, ci = a.act_bytes_per_token_layer
    draft_vocab = head.lm_head // h
    act = padded_tokens * (ch * h + ci * i) * 2 + batch * draft_vocab * 4 * 3
    attn = 4 * cfg.num_heads * cfg.head_dim * batch * (q * ctx + q * (q + 1) // 2)
    flops = 2 * matrix * padded_tokens + 2 * h * draft_vocab * batch + attn
    return {"bytes": weights + kv_read + kv_write + act, "flops": flops}


def draft_forward_time(cost: dict, chip: Chip, a: Assumptions = Assumptions(),
                       overhead_s: float = DRAFT_OVERHEAD_S) -> float:
    return max(cost["bytes"] / (a.eta_bw * chip.hbm_bw),
               cost["flops"] / (a.eta_flops * chip.bf16_flops)) + overhead_s


def spec_step(cfg: ModelConfig, chip: Chip, batch: int, k: int, ctx: int, buckets,
              a: Assumptions = Assumptions(), draft_vocab: int = DRAFT_VOCAB,
              overhead_s: float = DRAFT_OVERHEAD_S) -> dict:
    """One speculative step (bf16 weights and KV, one chip): verification + k draft forwards."""
    q = k + 1
    vb = bucket_for(batch * q, batch, buckets)
    verify = step_time(step_cost(cfg, "bf16", [Seq(q, ctx)] * batch, vb, a=a,
                                 logit_rows=batch * q), chip, 1, a)
    head = Eagle3Head.of(cfg, draft_vocab)
    drafts = []
    for step in range(k):
        # The first forward covers the k+1 verified positions; the head's cache then holds
        # ctx + k+1 + (step - 1) tokens before each later one.
        dq, dctx = (q, ctx) if step == 0 else (1, ctx + q + step - 1)
        tokens = bucket_for(batch * dq, batch, buckets)[0]
        cost = draft_forward_cost(cfg, head, batch, dq, dctx, tokens, step == 0, a)
        drafts.append(draft_forward_time(cost, chip, a, overhead_s))
    return {"verify_s": verify["s"], "verify_bound": verify["bound"], "verify_bucket": vb,
            "draft_s": sum(drafts), "draft_forward_s": drafts,
            "s": verify["s"] + sum(drafts)}


def table(cfg: ModelConfig, chip_key: str = "h200", ctx: int = 2048,
          a: Assumptions = Assumptions(), overhead_s: float = DRAFT_OVERHEAD_S) -> list[dict]:
    """Per batch and k: plain decode, the speculative step, and per acceptance length tau
    the output tokens/s and the speed-up over plain decode."""
    chip = CHIPS[chip_key]
    buckets = engine_buckets(cfg)
    rows = []
    for batch in BATCHES:
        d = decode(cfg, chip, "bf16", batch, ctx, 1, buckets, a=a)
        for k in KS:
            s = spec_step(cfg, chip, batch, k, ctx, buckets, a, overhead_s=overhead_s)
            per_tau = {tau: {"out_tok_s": batch * tau / s["s"],
                             "speedup": tau * d["s"] / s["s"]}
                       for tau in TAUS if tau <= k + 1}
            rows.append({"chip": chip_key, "batch": batch, "k": k, "ctx": ctx,
                         "decode_ms": d["s"] * 1e3, "decode_out_tok_s": d["out_tok_s"],
                         "verify_ms": s["verify_s"] * 1e3, "verify_bound": s["verify_bound"],
                         "draft_ms": s["draft_s"] * 1e3, "spec_step_ms": s["s"] * 1e3,
                         "break_even_tau": s["s"] / d["s"], "tau": per_tau})
    return rows

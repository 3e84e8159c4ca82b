"""The roofline model of a mixture-of-experts step: Qwen3-30B-A3B (bf16) on one H200 and on a
TPU v6e-8 with expert parallelism (docs/benchmarks/perf-model.md, "Mixture of experts").

Plain arithmetic, no jax; the chips and efficiencies are `perf_model`'s. What differs from a
dense model is which weights a step reads: every token uses k of E experts per layer, so a
step of T tokens reads the experts at least one of them chose. With routing uniform and
independent across tokens, an expert is untouched by all T with probability (1 - k/E)^T:

    distinct experts per layer  D(T) = E * (1 - (1 - k/E)^T)

(T = 1: k; T = 32: 111 of 128 for Qwen3-30B-A3B; T = 128: 127.8), so the bytes a decode step
reads grow with the batch until every expert is read, then stay. Real routing is skewed
(popular experts), which touches fewer distinct experts than this; a step under expert
parallelism waits for its busiest chip, so per chip the model takes the expected maximum over
the n chips of their touched experts (each chip's count Binomial(E/n, D/E): exact for n = 1,
ignoring the weak dependence between experts otherwise).

Expert parallelism on n chips (`v6e` x 8): each chip holds E / n whole experts; attention is
tensor-parallel (q heads / n per chip; KV heads split as far as they go, replicated past
that, as models/placement.py does for TP); embedding and head split by vocabulary. The
hidden states are replicated after each attention, so every chip routes every token and runs
its own experts on the rows that chose them; the expert outputs are summed by one all-reduce
per layer (beside the attention's), both ring all-reduces of T x hidden bf16 at `link_bw`.
The all-to-all alternative (each token's k rows sent to their experts' chips and back,
(n - 1) / n of them off-chip) is reported in bytes, not timed.

The grouped matmul's tile padding is modelled: the kernel runs (ceil(T k / tm) + D - 1) tiles
of tm rows per matmul (kernels_pallas/grouped_matmul.py), so at decode its FLOPs exceed the
real rows' (they stay far below the memory time).
"""

from __future__ import annotations

import dataclasses
import math

from .perf_model import CHIPS, Assumptions, Chip


@dataclasses.dataclass(frozen=True)
class MoEShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    expert_width: int  # moe_intermediate_size
    top_k: int
    vocab: int
    tied: bool = False

    @property
    def qo_params(self) -> int:  # q and o projections of one layer
        return 2 * self.hidden * self.heads * self.head_dim

    @property
    def kv_params(self) -> int:  # k and v projections of one layer
        return 2 * self.hidden * self.kv_heads * self.head_dim

    @property
    def router_params(self) -> int:
        return self.hidden * self.experts

    @property
    def expert_params(self) -> int:  # gate, up, down of one expert
        return 3 * self.hidden * self.expert_width

    @property
    def vector_params(self) -> int:  # two norms + q/k norms a layer, the final norm
        return self.layers * (2 * self.hidden + 2 * self.head_dim) + self.hidden

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        per_layer = self.qo_params + self.kv_params + self.router_params
        per_layer += self.experts * self.expert_params
        return (self.layers * per_layer + self.vector_params
                + self.embed_params * (1 if self.tied else 2))

    @property
    def active_params(self) -> int:
        """Parameters one token's step uses: attention, router, k experts a layer, norms,
        the head (the embedding contributes one row, not counted)."""
        per_layer = self.qo_params + self.kv_params + self.router_params
        return (self.layers * (per_layer + self.top_k * self.expert_params)
                + self.vector_params + self.embed_params)

    def kv_bytes_per_token(self, itemsize: int = 2) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * itemsize


def qwen3_30b_a3b() -> MoEShape:
    """Qwen/Qwen3-30B-A3B's config.json: 48 layers, hidden 2048, 32 q / 4 KV heads of 128,
    128 experts of 768, top-8, vocabulary 151936, untied head."""
    return MoEShape("Qwen3-30B-A3B", 48, 2048, 32, 4, 128, 128, 768, 8, 151936)


def distinct_experts(experts: int, top_k: int, tokens: int) -> float:
    """Expected experts a layer's `tokens` tokens touch: E (1 - (1 - k/E)^T)."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def busiest_chip_experts(experts: int, top_k: int, tokens: int, chips: int) -> float:
    """Expected touched experts on the busiest of `chips` holding E / chips each: the
    expected maximum of `chips` Binomial(E / chips, D / E) counts (= D for one chip)."""
    d = distinct_experts(experts, top_k, tokens)
    if chips == 1:
        return d
    per, p = experts // chips, d / experts
    cdf, expect = 0.0, 0.0
    for j in range(per + 1):  # E[max] = sum_{j >= 1} P(max >= j) = sum (1 - F(j - 1)^n)
        if j:
            expect += 1.0 - cdf ** chips
        cdf += math.comb(per, j) * p ** j * (1 - p) ** (per - j)
    return expect


@dataclasses.dataclass(frozen=True)
class Setup:
    """Where the model runs: `chips` chips, experts split over them (EP), attention TP."""
    chip: str
    chips: int = 1
    tile_rows: int = 128  # the grouped matmul's m-tile (TPU default; 64 on the GPU kernel)


def step(shape: MoEShape, setup: Setup, seqs: list[tuple[int, int]],
         a: Assumptions = Assumptions()) -> dict:
    """One step of sequences (new tokens q, context ctx) -> bytes, FLOPs, comms and time on
    the busiest chip."""
    chip: Chip = CHIPS[setup.chip]
    n = setup.chips
    kv_split = min(n, shape.kv_heads)  # KV heads past n are replicated
    tokens = sum(q for q, _ in seqs)
    d = distinct_experts(shape.experts, shape.top_k, tokens)
    busiest = busiest_chip_experts(shape.experts, shape.top_k, tokens, n)
    layers, h = shape.layers, shape.hidden
    # bytes on the busiest chip (bf16 weights and KV)
    attn_w = layers * (shape.qo_params / n + shape.kv_params / kv_split + shape.router_params)
    expert_w = layers * busiest * shape.expert_params
    head_w = shape.embed_params / n + tokens * h  # the head's vocabulary slice + embed rows
    weights = 2 * (attn_w + expert_w + head_w + shape.vector_params)
    kvt = shape.kv_bytes_per_token()
    kv_read = sum(math.ceil(q / a.q_block) * (ctx + q) for q, ctx in seqs) * kvt / kv_split
    kv_write = tokens * kvt / kv_split
    act = (tokens * layers * (12 * h + 6 * shape.top_k * shape.expert_width / n) * 2
           + len(seqs) * shape.vocab / n * 4 * 3)
    moved = weights + kv_read + kv_write + act
    # FLOPs per chip: dense parts split n ways, expert tiles with their padding
    dense = 2 * layers * (shape.qo_params + shape.kv_params + shape.router_params) * tokens
    tm = setup.tile_rows
    tiles = math.ceil(tokens * shape.top_k / tm) + d - 1
    expert_flops = 2 * layers * shape.expert_params * tiles * tm
    attn = sum(4 * shape.heads * shape.head_dim * layers * (q * ctx + q * (q + 1) // 2)
               for q, ctx in seqs)
    logits = 2 * h * shape.vocab * len(seqs)
    flops = (dense + expert_flops + attn + logits) / n
    t_mem = moved / (a.eta_bw * chip.hbm_bw)
    t_flop = flops / (a.eta_flops * chip.bf16_flops)
    allreduce = tokens * h * 2
    t_comm = 0.0
    if n > 1:  # attention's and the experts' all-reduce a layer, the logits gather
        ring = 2 * (n - 1) / n
        t_comm = 2 * layers * (a.allreduce_latency_s + ring * allreduce / chip.link_bw)
        t_comm += (a.allreduce_latency_s
                   + (n - 1) / n * len(seqs) * shape.vocab * 4 / chip.link_bw)
    total = max(t_mem, t_flop) + t_comm + chip.overhead_s
    return {"s": total, "mem_s": t_mem, "flop_s": t_flop, "comm_s": t_comm,
            "bound": "memory" if t_mem >= t_flop else "compute", "tokens": tokens,
            "distinct_experts": d, "busiest_chip_experts": busiest,
            "weight_bytes_read": weights, "expert_bytes_read": 2 * expert_w,
            "kv_bytes_read": kv_read, "bytes_per_chip": moved, "flops_per_chip": flops,
            "expert_tile_rows": tiles * tm,
            "ici_allreduce_bytes": (2 * layers * 2 * (n - 1) / n * allreduce if n > 1 else 0),
            "ici_all_to_all_bytes": (2 * layers * tokens * shape.top_k * h * 2 * (n - 1) / n
                                     if n > 1 else 0)}


def weight_bytes_per_chip(shape: MoEShape, setup: Setup) -> float:
    n, kv_split = setup.chips, min(setup.chips, shape.kv_heads)
    per_layer = (shape.qo_params / n + shape.kv_params / kv_split + shape.router_params
                 + shape.experts / n * shape.expert_params)
    return 2 * (shape.layers * per_layer + shape.vector_params
                + shape.embed_params * (1 if shape.tied else 2) / n)


def fits(shape: MoEShape, setup: Setup, seqs: int, ctx: int,
         a: Assumptions = Assumptions()) -> bool:
    kv = seqs * ctx * shape.kv_bytes_per_token() / min(setup.chips, shape.kv_heads)
    return weight_bytes_per_chip(shape, setup) + kv <= a.hbm_usable * CHIPS[setup.chip].hbm_bytes


BATCHES = (1, 32, 128, 256)
SETUPS = {"h200": Setup("h200", 1, 64), "v6e-8": Setup("v6e", 8, 128)}


def table(shape: MoEShape, ctx: int = 2048, a: Assumptions = Assumptions()) -> list[dict]:
    """The decode step of each batch at context `ctx` on each setup."""
    rows = []
    for key, setup in SETUPS.items():
        for batch in BATCHES:
            s = step(shape, setup, [(1, ctx)] * batch, a)
            rows.append({"setup": key, "chip": setup.chip, "chips": setup.chips,
                         "batch": batch, "fits": fits(shape, setup, batch, ctx, a),
                         "weights_gb_per_chip": weight_bytes_per_chip(shape, setup) / 1e9,
                         "step_ms": s["s"] * 1e3, "out_tok_s": batch / s["s"], **s})
    return rows


def serve(shape: MoEShape, setup: Setup, conc: int, in_len: int, out_len: int,
          budget: int = 2048, a: Assumptions = Assumptions()) -> dict:
    """`conc` requests of in_len -> out_len as one wave (perf_model.serve's shape): prompts
    in full-budget prefill steps, then out_len - 1 decode steps at the mean context."""
    t_pre, left = 0.0, conc * in_len
    while left > 0:
        q = min(budget, left)
        t_pre += step(shape, setup, [(q, 0)], a)["s"]
        left -= q
    d = step(shape, setup, [(1, in_len + out_len // 2)] * conc, a)
    t = t_pre + (out_len - 1) * d["s"]
    return {"s": t, "prefill_s": t_pre, "decode_step_s": d["s"],
            "out_tok_s": conc * out_len / t}


# Published Qwen3-30B-A3B bf16 figures with a stated setting (see the doc for what was
# searched and not found: no H200 or v6e figure).
PEERS = [
    dict(engine="vLLM (fused_moe, untuned)", setup=Setup("h100", 1, 64), conc=10,
         in_len=2048, out_len=1024, measured=739.79, tpot_ms=13.18,
         setting="H100, TP 1 / EP 1, Qwen3-30B-A3B bf16, random 2048 in / 1024 out, "
                 "max concurrency 10, 100 prompts; VLLM_USE_DEEP_GEMM=1",
         url="https://github.com/vllm-project/vllm/pull/23151"),
]


def peer_rows(shape: MoEShape, a: Assumptions = Assumptions()) -> list[dict]:
    rows = []
    for p in PEERS:
        s = serve(shape, p["setup"], p["conc"], p["in_len"], p["out_len"], a=a)
        rows.append({**{k: v for k, v in p.items() if k != "setup"},
                     "chip": p["setup"].chip, "predicted": s["out_tok_s"],
                     "predicted_tpot_ms": s["decode_step_s"] * 1e3,
                     "measured_over_predicted": p["measured"] / s["out_tok_s"]})
    return rows

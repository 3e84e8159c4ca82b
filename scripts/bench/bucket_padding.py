"""The padding section of `bench_buckets.py`: the scheduler over the benchmark workloads on
the arithmetic fake runner, the buckets each step ran in, and what that padding costs under a
measured step-cost curve (`CostCurve`). Imported by bench_buckets.py (same folder)."""

from __future__ import annotations

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.engine.batch import StepBatch

# (name, prompt tokens, new tokens, concurrency, requests): the A and C workloads of
# docs/benchmarks/earlier-runs.md.
WORKLOADS = (("A 256/128 c=1", 256, 128, 1, 4), ("A 256/128 c=8", 256, 128, 8, 16),
             ("A 256/128 c=32", 256, 128, 32, 64), ("C 2048/128 c=8", 2048, 128, 8, 16))


class CostCurve:
    """D(T, S): the all-padding step time of `cost` (CPU ms), linear between the measured token
    counts at seqs = min(T, max_num_seqs). A bucket with fewer seqs saves r(T) per row left
    out (its lm_head row and sampler row), r(T) = (D(T, full) - D(T, 1)) / (full - 1)
    measured at some T (`--cost-prefill-tokens`) and interpolated between them."""

    def __init__(self, cost: dict, key: str = "cpu_ms"):
        self.max_seqs = cost["max_num_seqs"]
        rows = [r for r in cost["rows"] if r["kind"] == "pad"]
        by_ts = {(r["tokens"], r["seqs"]): r[key] for r in rows}
        full = sorted((t, ms) for (t, s), ms in by_ts.items() if s == min(t, self.max_seqs))
        self.t = np.array([t for t, _ in full], float)
        self.ms = np.array([m for _, m in full])
        per_row = sorted((t, (by_ts[(t, min(t, self.max_seqs))] - ms)
                          / (min(t, self.max_seqs) - 1)) for (t, s), ms in by_ts.items()
                         if s == 1 < min(t, self.max_seqs) and (t, min(t, self.max_seqs)) in by_ts)
        self.row_t = np.array([t for t, _ in per_row] or [1.0])
        self.row_ms = np.array([max(0.0, r) for _, r in per_row] or [0.0])

    def __call__(self, tokens: int, seqs: int) -> float:
        full = min(tokens, self.max_seqs)
        row = float(np.interp(tokens, self.row_t, self.row_ms))
        return float(np.interp(tokens, self.t, self.ms)) - row * (full - min(seqs, full))


def run_workload(cfg: EngineConfig, prompt_len: int, max_tokens: int, concurrency: int,
                 num_requests: int) -> list[tuple[int, int, int, int]]:
    """Closed loop on the fake runner: `concurrency` requests in flight, the next one added as
    soon as one finishes. Returns each step's (tokens, seqs, T_b, S_b)."""
    from jaxserve import SamplingParams
    from jaxserve.engine.engine import Engine
    from jaxserve.engine.fake_runner import ArithmeticRunner
    from jaxserve.engine.sizing import plan_engine
    from jaxserve.models.tiny import tiny_config, word_tokenizer

    vocab = 4096
    tok = word_tokenizer(vocab)
    model = tiny_config(vocab_size=vocab, max_position_embeddings=8192)
    plan = plan_engine(cfg, model, 4, 1 << 40)
    runner = ArithmeticRunner(vocab)
    steps: list[tuple[int, int, int, int]] = []
    real_dispatch = runner.dispatch

    def dispatch(batch: StepBatch):  # noqa: ANN202 - records each step's shape
        f = batch.forward
        n = int(f.num_seqs[0])
        steps.append((int(f.cu_q_lens[n]), n, len(f.token_ids), len(f.logits_indices)))
        return real_dispatch(batch)

    runner.dispatch = dispatch  # type: ignore[method-assign]
    engine = Engine(cfg, plan, runner, tok, (2,))
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sent = 0

    def send() -> None:
        nonlocal sent
        engine.add_request(f"r{sent}", [int(x) for x in rng.integers(3, vocab, prompt_len)],
                           params)
        sent += 1

    for _ in range(min(concurrency, num_requests)):
        send()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished and sent < num_requests:
                send()
    return steps


def padding_figures(steps: list[tuple[int, int, int, int]], curve: CostCurve | None) -> dict:
    tokens = sum(n for n, _, _, _ in steps)
    padded = sum(t for _, _, t, _ in steps)
    out = {"steps": len(steps), "tokens": tokens, "padded_tokens": padded - tokens,
           "token_padding": (padded - tokens) / padded,
           "worst_step_token_padding": max((t - n) / t for n, _, t, _ in steps),
           "buckets_used": sorted({(t, s) for _, _, t, s in steps})}
    if curve is not None:
        bucket_ms = [curve(t, s) for _, _, t, s in steps]
        ideal_ms = [curve(n, k) for n, k, _, _ in steps]
        out["time_ms"] = sum(bucket_ms)
        out["time_padding"] = (sum(bucket_ms) - sum(ideal_ms)) / sum(bucket_ms)
        out["worst_step_time_padding"] = max((b - i) / b for b, i in zip(bucket_ms, ideal_ms))
    return out


def worst_steps(cfg: EngineConfig, curve: CostCurve) -> dict:
    """The worst time padding over every step the scheduler can produce under `cfg` (tokens
    <= max_num_batched_tokens, 1 <= seqs <= min(tokens, max_num_seqs)): of decode steps
    (tokens = seqs), of steps whose seqs fill their bucket's (seqs = min(tokens, max seqs)),
    of any step; each with the step and its bucket."""
    from jaxserve.engine.batch import bucket_for
    from jaxserve.engine.sizing import plan_engine
    from jaxserve.models.tiny import tiny_config

    model = tiny_config(vocab_size=4096, max_position_embeddings=8192)
    buckets = plan_engine(cfg, model, 4, 1 << 40).batch_shape.buckets
    worst = {"decode": (0.0, None), "full": (0.0, None), "any": (0.0, None)}
    for t in range(1, cfg.max_num_batched_tokens + 1):
        most = min(t, cfg.max_num_seqs)
        for s in range(1, most + 1):
            bt, bs = bucket_for(t, s, buckets)
            share = (curve(bt, bs) - curve(t, s)) / curve(bt, bs)
            for kind, applies in (("decode", t == s), ("full", s == most), ("any", True)):
                if applies and share > worst[kind][0]:
                    worst[kind] = (share, [t, s, bt, bs])
    return {"forward_buckets": len(buckets),
            **{k: {"time_padding": v, "step_and_bucket": w} for k, (v, w) in worst.items()}}

#!/usr/bin/env python
"""What logit_bias costs a decode step: with no biased row, and with one biased row.

For S live decode sequences (greedy; the step's seqs bucket is S) it builds the step the
engine builds (`build_batch` from a SchedulerOutput of S one-token decodes) and times, each
as the best of --runs after a compile run:
  pack      build_batch on the host (numpy), bias rows included
  sampler   model_runner's jitted sampler on f32[S, V] logits already on the device, with
            the step's sampling arrays placed (the executable the engine runs)
  bytes     the sampling arrays' bytes sent to the device per step (knobs, keys, history,
            logit bias)
  step      ModelRunner.execute end to end (place, forward, sampler, device_get) on a tiny
            random model (2 layers, hidden 64) with a real vocabulary size, so the sampler and
            the lm_head are a visible share of the step
Numbers on a CPU are not GPU numbers; the trend (what a bias-free step still pays) is the
point.

    python scripts/bench/bench_logit_bias.py --seqs 8,64,256 --vocab 49152 --json bias.json
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.device.model_runner import ModelRunner, place_inputs, sample_jit, to_step_inputs
from jaxserve.engine.batch import BatchShape, bitmask_words, build_batch, leaves
from jaxserve.engine.sequence import Sequence
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from jaxserve.models import llama
from jaxserve.models.tiny import tiny_config

CONTEXT, PAGE = 16, 16
PAGES_PER_SEQ = 2  # CONTEXT + 1 tokens


def decode_step(S: int, biased_rows: int, vocab: int) -> SchedulerOutput:
    """S one-token decodes of context CONTEXT; the first `biased_rows` carry a 5-entry bias."""
    rng = np.random.default_rng(S)
    bias = {int(t): float(b) for t, b in zip(rng.choice(vocab, 5, replace=False),
                                             [-100.0, -5.0, 0.5, 5.0, 100.0])}
    seqs = []
    for i in range(S):
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                logit_bias=bias if i < biased_rows else {})
        prompt = [int(x) for x in rng.integers(3, vocab, CONTEXT + 1)]
        req = Sequence(f"r{i}", prompt, params, (2,), 0.0,
                      pages=[1 + PAGES_PER_SEQ * i + j for j in range(PAGES_PER_SEQ)])
        req.num_computed_tokens = CONTEXT
        seqs.append(ScheduledSeq(req, start=CONTEXT, num_new_tokens=1, samples=True))
    return SchedulerOutput(seqs, S, [])


def best_ms(fn, runs: int) -> float:  # noqa: ANN001
    fn()  # compile / warm
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * min(times)


def measure(S: int, biased_rows: int, vocab: int, runner: ModelRunner, runs: int) -> dict:
    out = decode_step(S, biased_rows, vocab)
    batch = build_batch(out, runner.shape)
    _, st, _ = place_inputs(to_step_inputs(batch), None)
    # A step without a grammar gets its bucket's all-zero mask on the device (as the runner
    # places it: never sent, never read).
    st = st.with_mask(jnp.zeros((S, bitmask_words(vocab)), jnp.int32))
    logits = jax.device_put(np.random.default_rng(0).normal(0, 3, (S, vocab)).astype(np.float32))

    def sampler() -> None:
        jax.block_until_ready(sample_jit(logits, st, apply_penalty=False,
                                         feed_len=runner.feed_len))

    sent = sum(array.nbytes for part in (batch.sampling, batch.penalties, batch.bias)
               for _, array in leaves(part))
    return {"num_seqs": S, "biased_rows": biased_rows, "bias_width": batch.bias.ids.shape[1],
            "sampling_bytes": int(sent),
            "pack_ms": best_ms(lambda: build_batch(out, runner.shape), runs),
            "sampler_ms": best_ms(sampler, runs),
            "step_ms": best_ms(lambda: runner.execute(batch), runs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", default="8,64,256")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    seqs = [int(s) for s in a.seqs.split(",")]
    cfg = tiny_config(vocab_size=a.vocab, max_position_embeddings=512)
    params = llama.init_random_params(cfg, jax.random.key(0), jnp.float32)
    shape = BatchShape(buckets=tuple((s, s) for s in sorted(seqs)), page_size=PAGE,
                       max_pages_per_seq=PAGES_PER_SEQ, vocab_size=a.vocab, history_len=256)
    runner = ModelRunner(cfg, params, shape, 1 + PAGES_PER_SEQ * max(seqs), jnp.float32)
    rows = [measure(S, biased, a.vocab, runner, a.runs) for S in seqs for biased in (0, 1)]
    print(f"{'S':>5} {'biased':>6} {'B':>4} {'sent KiB':>9} {'pack ms':>8} {'sampler ms':>11} "
          f"{'step ms':>8}   (V = {a.vocab}, {jax.default_backend()})")
    for r in rows:
        print(f"{r['num_seqs']:5d} {r['biased_rows']:6d} {r['bias_width']:4d} "
              f"{r['sampling_bytes'] / 1024:9.1f} {r['pack_ms']:8.3f} {r['sampler_ms']:11.3f} "
              f"{r['step_ms']:8.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"vocab": a.vocab, "backend": jax.default_backend(), "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""The serving sampler's cost per decode step, under each common sampling setting.

Sections (--sections, comma-separated):
  sampler  model_runner's jitted sampler (the executable the engine runs) alone, on f32[S, V]
           logits already on the device, for S in --seqs and each setting: greedy,
           temperature 1.0, top_p 0.95, top_k 50, min_p 0.05, penalties (repetition 1.1,
           presence 0.5, frequency 0.5 over a 256-token history), each at temperature 1.0.
           Logits are Zipf-shaped (logit = -a log rank, ranks shuffled), one family per
           exponent in --zipf: a = 2 puts 99% of the mass in the top 64 tokens (top-p's
           nucleus fits the sampler's candidates), a = 1 needs ~15k tokens for 0.95 (the exact
           bisection runs). Median of --runs, settings interleaved round robin.
  grammar  the same sampler greedy / temperature 1.0 with no row or every row under a random
           grammar bitmask (30% of tokens allowed).
  engine   a whole engine step (`LLMEngine.step`: schedule, batch, forward, sample, collect) of
           the bundled model with S live decode rows (S in --seqs), the same settings plus
           `seeded` (top_p 0.95 with a per-request seed); median of 3 x --steps // 2 steps,
           in three rounds over the settings, each round's order rotated.
Numbers on a CPU are not accelerator numbers; a sampled step against a greedy one is the point.

    python scripts/bench/bench_sampler.py --seqs 1,32 --json sampler.json
    python scripts/bench/bench_sampler.py --sections engine --seqs 32 --steps 24
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.device.model_runner import sample_jit
from jaxserve.device.sampler import SamplingTensors
from jaxserve.engine.batch import bitmask_words

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=1.0),
    "top_p": dict(temperature=1.0, top_p=0.95),
    "top_k": dict(temperature=1.0, top_k=50),
    "min_p": dict(temperature=1.0, min_p=0.05),
    "penalties": dict(temperature=1.0, repetition_penalty=1.1, presence_penalty=0.5,
                      frequency_penalty=0.5),
}
ENGINE_SETTINGS = {**SETTINGS, "seeded": dict(temperature=1.0, top_p=0.95, seed=0)}
HISTORY = 256


def zipf_logits(S: int, V: int, a: float, rng: np.random.Generator) -> jax.Array:
    ranks = np.stack([rng.permutation(V) for _ in range(S)]) + 1
    return jnp.asarray((-a * np.log(ranks)).astype(np.float32))


def sampler_inputs(S: int, V: int, setting: dict, rng: np.random.Generator,
                   bitmask: np.ndarray | None = None) -> tuple[SamplingTensors, bool]:
    penalties = "repetition_penalty" in setting
    P = HISTORY if penalties else 0
    history = jnp.asarray(rng.integers(0, V, (S, P)).astype(np.int32))
    is_output = jnp.asarray(np.arange(P)[None, :].repeat(S, 0) >= P // 2)
    keys = jnp.stack([jnp.zeros(S, jnp.uint32), jnp.arange(S, dtype=jnp.uint32)], 1)
    extra = {} if bitmask is None else dict(bitmask=jnp.asarray(bitmask),
                                            constrained=jnp.ones((S,), bool))
    cols = {k: jnp.full((S,), v, jnp.float32) for k, v in setting.items()}
    return SamplingTensors.of(keys, history, is_output, **extra, **cols), penalties


def time_round_robin(cases: dict, runs: int) -> dict[str, float]:
    """Median ms of each zero-argument callable, the cases interleaved run by run."""
    for fn in cases.values():
        jax.block_until_ready(fn())  # compile
    times = {name: [] for name in cases}
    for _ in range(runs):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def sampler_call(logits: jax.Array, st: SamplingTensors, penalties: bool):  # noqa: ANN201
    S = logits.shape[0]
    return lambda: sample_jit(logits, st, apply_penalty=penalties, feed_len=S)


def bench_sampler(seqs: list[int], V: int, zipf: list[float], runs: int) -> list[dict]:
    rows = []
    for S in seqs:
        for a in zipf:
            rng = np.random.default_rng(S)
            logits = zipf_logits(S, V, a, rng)
            cases = {name: sampler_call(logits, *sampler_inputs(S, V, s, rng))
                     for name, s in SETTINGS.items()}
            ms = time_round_robin(cases, runs)
            rows.append({"seqs": S, "vocab": V, "zipf": a, "ms": ms,
                         "vs_greedy": {k: v / ms["greedy"] for k, v in ms.items()}})
            print(f"sampler S={S:3d} zipf={a}: " + "  ".join(
                f"{k} {v:6.2f}" for k, v in ms.items()) + "  (ms)")
    return rows


def bench_grammar(seqs: list[int], V: int, runs: int) -> list[dict]:
    rows = []
    for S in seqs:
        rng = np.random.default_rng(S)
        logits = jnp.asarray(rng.normal(size=(S, V)).astype(np.float32))
        words = bitmask_words(V)
        bits = rng.random((S, words * 32)) < 0.3
        weights = np.uint64(1) << np.arange(32, dtype=np.uint64)
        bitmask = (bits.reshape(S, words, 32) * weights).sum(-1).astype(np.uint32).view(np.int32)
        cases = {}
        for t in (0.0, 1.0):
            for constrained in (False, True):
                st, pen = sampler_inputs(S, V, dict(temperature=t), rng,
                                         bitmask if constrained else None)
                if not constrained:  # the runner always sends the full-width bitmask
                    st = st.with_mask(jnp.asarray(bitmask))
                cases[(t, constrained)] = sampler_call(logits, st, pen)
        ms = time_round_robin(cases, runs)
        for t in (0.0, 1.0):
            row = {"seqs": S, "vocab": V, "temperature": t, "plain_ms": ms[(t, False)],
                   "grammar_ms": ms[(t, True)]}
            rows.append(row)
            print(f"grammar S={S:3d} temperature={t}: {row['plain_ms']:7.2f} ms without a "
                  f"grammar, {row['grammar_ms']:7.2f} ms with every row under one")
    return rows


def bench_engine(seqs: list[int], steps: int, prompt_len: int) -> list[dict]:
    from jaxserve import LLM
    from jaxserve.engine.sampling_params import SamplingParams

    llm = LLM(max_num_seqs=max(seqs), max_model_len=prompt_len + 4 * steps + 64)
    eng = llm.engine
    rng = np.random.default_rng(0)
    rows = []
    for S in seqs:
        times: dict[str, list[float]] = {name: [] for name in ENGINE_SETTINGS}
        names = list(ENGINE_SETTINGS)
        for rep in range(3):  # three rounds, the order rotated each round, to spread drift
            for name in names[rep:] + names[:rep]:
                setting = ENGINE_SETTINGS[name]
                ids = []
                for i in range(S):
                    rid = f"{name}-{S}-{rep}-{i}"
                    knobs = dict(setting)
                    if "seed" in knobs:
                        knobs["seed"] = i
                    eng.add_request(rid, [int(x) for x in rng.integers(100, 40000, prompt_len)],
                                    SamplingParams(max_tokens=4 * steps, ignore_eos=True,
                                                   **knobs))
                    ids.append(rid)
                while any(r.num_output_tokens == 0 for r in eng.scheduler.requests.values()):
                    eng.step()
                for _ in range(2):  # every row decoding, the pipeline full
                    eng.step()
                for _ in range(steps // 2):
                    t0 = time.perf_counter()
                    eng.step()
                    times[name].append(time.perf_counter() - t0)
                for rid in ids:
                    eng.abort(rid)
                while eng.has_unfinished():
                    eng.step()
        ms = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
        rows.append({"seqs": S, "prompt_len": prompt_len, "step_ms": ms,
                     "vs_greedy": {k: v / ms["greedy"] for k, v in ms.items()}})
        print(f"engine S={S:3d}: " + "  ".join(f"{k} {v:6.1f}" for k, v in ms.items())
              + "  (ms per step)")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", default="sampler,grammar,engine")
    p.add_argument("--seqs", default="1,32")
    p.add_argument("--vocab", type=int, default=49152, help="the bundled model's: 49152")
    p.add_argument("--zipf", default="2.0,1.0")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--steps", type=int, default=24, help="engine steps timed per setting")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    seqs = [int(x) for x in args.seqs.split(",")]
    sections = set(args.sections.split(","))
    report: dict = {"backend": jax.default_backend(), "jax": jax.__version__,
                    "argv": vars(args)}
    if "sampler" in sections:
        report["sampler"] = bench_sampler(seqs, args.vocab,
                                          [float(a) for a in args.zipf.split(",")], args.runs)
    if "grammar" in sections:
        report["grammar"] = bench_grammar(seqs, args.vocab, args.runs)
    if "engine" in sections:
        report["engine"] = bench_engine(seqs, args.steps, args.prompt_len)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""How long the device sits idle between steps (the host gap), one step at a time vs
overlapped (`EngineConfig.async_scheduling`): prints a table and writes JSON.

Two set-ups, each run with overlap off and on over the same requests:
  fake   the arithmetic fake runner with a simulated device (`ArithmeticRunner(device_time_s)`:
         each step takes --fake-device-ms after the previous one ends or after its dispatch);
         --fake-seqs sequences decoding together, so the host's per-step work (schedule,
         batch build, update, detokenize, outputs) is that of a full batch. The gap is exact:
         the simulated device's idle time before each step.
  real   the bundled model (or --model) with --real-seqs sequences on this machine's device.
         A watcher thread waits on each dispatched step's outputs and stamps when they are
         ready; step k's gap = max(0, time its dispatch returned - time step k-1 was ready),
         an upper bound (the forward was queued a little before its dispatch returned).
Per step: mean / p50 / p99 gap, the device time per step (fake: as simulated; real: ready
time - max(previous ready, dispatch start)), gap share = mean gap / (mean gap + mean device
time), and output tokens/s. Only steps where every sequence decodes are counted (the batch
is full and steady), after the first --skip of them.

    python scripts/bench/bench_host_gap.py --json host_gap.json
    python scripts/bench/bench_host_gap.py --only fake --fake-seqs 256 --fake-device-ms 20
"""

from __future__ import annotations

import argparse
import json
import queue
import threading
import time

import numpy as np

from jaxserve import SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.engine.engine import Engine
from jaxserve.engine.fake_runner import ArithmeticRunner
from jaxserve.engine.outputs import RequestOutputKind
from jaxserve.engine.runner import PendingStep, Runner, StepResult


class ReadyWatcher:
    """Wraps a ModelRunner: stamps each step's dispatch start / return and (from a thread
    that blocks on its outputs) the moment the device finished it."""

    def __init__(self, inner: Runner) -> None:
        self.inner = inner
        self.starts: list[float] = []
        self.dispatched: list[float] = []
        self.ready: list[float] = []
        self.decode_only: list[bool] = []
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def __getattr__(self, name: str):  # noqa: ANN204 - the rest of the Runner protocol
        return getattr(self.inner, name)

    def dispatch(self, batch) -> PendingStep:  # noqa: ANN001
        self.starts.append(time.perf_counter())
        pending = self.inner.dispatch(batch)
        self.dispatched.append(time.perf_counter())
        num = int(batch.forward.num_seqs[0])
        self.decode_only.append(int(batch.forward.cu_q_lens[num]) == num)
        self._queue.put(pending)
        return pending

    def collect(self, pending: PendingStep) -> StepResult:
        return self.inner.collect(pending)

    def _watch(self) -> None:
        import jax
        while True:
            pending = self._queue.get()
            if pending is None:
                return
            jax.block_until_ready(pending.out.tokens)
            self.ready.append(time.perf_counter())

    def close_watch(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def gaps(self) -> tuple[list[float], list[float]]:
        """(gap before step k, device time of step k) for each steady decode step k >= 1."""
        gaps, busy = [], []
        for k in range(1, len(self.ready)):
            if self.decode_only[k] and self.decode_only[k - 1]:
                gaps.append(max(0.0, self.dispatched[k] - self.ready[k - 1]))
                busy.append(self.ready[k] - max(self.ready[k - 1], self.starts[k]))
        return gaps, busy


def stats(gaps: list[float], busy: list[float], tokens: int, wall: float) -> dict:
    g, b = np.asarray(gaps) * 1e3, np.asarray(busy) * 1e3
    return {"steps": len(g), "gap_mean_ms": float(g.mean()), "gap_p50_ms": float(np.median(g)),
            "gap_p99_ms": float(np.percentile(g, 99)), "device_ms": float(b.mean()),
            "gap_share": float(g.mean() / (g.mean() + b.mean())),
            "output_tok_s": tokens / wall}


def drive(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[int, float]:
    for i, p in enumerate(prompts):  # streamed, as the servers ask for them
        engine.add_request(f"r{i}", p, params, output_kind=RequestOutputKind.DELTA)
    t = time.perf_counter()
    tokens = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens += sum(len(c.delta_token_ids) for c in out.outputs)
    return tokens, time.perf_counter() - t


def run_fake(overlap: bool, args: argparse.Namespace) -> dict:
    from jaxserve.engine.sizing import plan_engine
    from jaxserve.models.tiny import tiny_config, word_tokenizer

    vocab = 4096
    tok = word_tokenizer(vocab)
    # A budget that prefills every prompt in a few steps, so all sequences then decode together.
    # decode_token_budget = the whole budget: the default (256) would prefill one prompt a
    # step beside the decodes, and the first streams would finish before the batch is full.
    cfg = EngineConfig(max_num_seqs=args.fake_seqs, max_num_batched_tokens=8192,
                       decode_token_budget=8192, page_size=16, max_model_len=1024,
                       async_scheduling=overlap)
    model = tiny_config(vocab_size=vocab, max_position_embeddings=1024)
    plan = plan_engine(cfg, model, 4, 1 << 34)
    runner = ArithmeticRunner(vocab, device_time_s=args.fake_device_ms / 1e3)
    steady: list[bool] = []
    real_dispatch = runner.dispatch

    def dispatch(batch):  # noqa: ANN001, ANN202 - notes which steps are full decode steps
        num = int(batch.forward.num_seqs[0])
        steady.append(num == args.fake_seqs and int(batch.forward.cu_q_lens[num]) == num)
        return real_dispatch(batch)

    runner.dispatch = dispatch  # type: ignore[method-assign]
    engine = Engine(cfg, plan, runner, tok, (2,))
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(3, vocab, args.prompt_len)]
               for _ in range(args.fake_seqs)]
    tokens, wall = drive(engine, prompts, SamplingParams(max_tokens=args.max_tokens,
                                                         ignore_eos=True))
    # host_gaps[k - 1] is the idle time before step k.
    gaps = [g for k, g in enumerate(runner.host_gaps, 1) if steady[k] and steady[k - 1]]
    gaps = gaps[args.skip:]
    return stats(gaps, [args.fake_device_ms / 1e3] * len(gaps), tokens, wall)


def run_real(overlap: bool, args: argparse.Namespace) -> dict:
    from jaxserve.models import loading
    from jaxserve.serving.build import build_engine

    model = loading.load_model(args.model)
    cfg = EngineConfig(model=args.model, max_num_seqs=args.real_seqs,
                       max_num_batched_tokens=512, async_scheduling=overlap,
                       enable_prefix_caching=False)
    engine = build_engine(cfg, model, progress=True)
    watcher = ReadyWatcher(engine.runner)
    engine.runner = watcher
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(100, 20000, args.prompt_len)]
               for _ in range(args.real_seqs)]
    tokens, wall = drive(engine, prompts, SamplingParams(max_tokens=args.max_tokens,
                                                         ignore_eos=True))
    watcher.close_watch()
    gaps, busy = watcher.gaps()
    return stats(gaps[args.skip:], busy[args.skip:], tokens, wall)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=("fake", "real"))
    ap.add_argument("--fake-seqs", type=int, default=256)
    ap.add_argument("--fake-device-ms", type=float, default=20.0)
    ap.add_argument("--real-seqs", type=int, default=32)
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--skip", type=int, default=2, help="steady steps left out at the start")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results: dict = {"args": vars(args)}
    for setup, fn in (("fake", run_fake), ("real", run_real)):
        if args.only not in (None, setup):
            continue
        for overlap in (False, True):
            key = f"{setup}_{'overlap' if overlap else 'sync'}"
            results[key] = r = fn(overlap, args)
            print(f"{key:14s} steps {r['steps']:4d}  gap mean {r['gap_mean_ms']:7.2f} ms  "
                  f"p50 {r['gap_p50_ms']:7.2f}  p99 {r['gap_p99_ms']:7.2f}  device "
                  f"{r['device_ms']:7.2f} ms/step  gap share {100 * r['gap_share']:5.1f}%  "
                  f"{r['output_tok_s']:8.1f} out tok/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()

"""Multi-host serving with two real processes on localhost (jax.distributed over gloo, CPU).

`jaxserve serve --coordinator ... --num-processes 2 --process-id I` is started twice, each
process with 2 virtual CPU devices, tensor parallel 4 over all of them (KV heads 2: each
replicated twice). Process 0 schedules and serves gRPC; process 1 runs the same compiled steps
on its devices. Checked against the plain full-sequence rollout of the same weights (no pages,
no sharding): the greedy tokens streamed; that neither process compiled after warmup; that
process 1 really ran the steps; and that it exits 0 when process 0 drains on SIGTERM.

In-process (one process, where a broadcast is the identity): the leader's runner gives the
plain runner's results, and every StepBatch field travels in exactly one broadcast.

Each two-process test costs two JAX processes' start-up, distributed init and warmup: the
served one runs by default; `jaxserve batch` and the offline LLM recipe over two processes are
marked slow (JAXSERVE_RUN_SLOW=1).
"""

from __future__ import annotations

import json
import os
import pathlib
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import numpy as np
from support.engine_fixtures import FEW_TOKEN_BUCKETS, device_count_flags, rollout, tiny_model
from support.bpe_tokenizer import train_bpe_tokenizer
from support.oracles import oracle as prompt_logprobs_oracle
from support.numerics import model_logprob_atol

from jaxserve.config import DistributedConfig
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.models.hf_loader import save_hf_dir
from jaxserve.server.client import Client

# The job's model speaks a byte-level BPE tokenizer (its 320 ids, EOS 0), so a grammar can
# run through the two processes: the followers get each step's token mask after its forward.
VOCAB = 320
START_DEADLINE_S = 600.0
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], list(range(20, 70))]
# Two token buckets (engine_fixtures.FEW_TOKEN_BUCKETS): each process compiles 7 executables
# at warmup instead of the default powers of two's 26, most of these tests' time.
SERVE_FLAGS = ("--tensor-parallel-size", "4", "--attention-impl", "reference",
               "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--page-size", "8",
               "--max-model-len", "256", "--kv-cache-memory", "1MiB",
               "--token-buckets", ",".join(map(str, FEW_TOKEN_BUCKETS)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """One `jaxserve serve` process of the job; its stderr lines are collected."""

    def __init__(self, cmd: list[str], env: dict):
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     text=True, env=env)
        self.lines: queue.Queue[str | None] = queue.Queue()  # None: stderr closed
        self.log: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.put(line)
        self.lines.put(None)

    def wait_line(self, pattern: str) -> re.Match:
        deadline = time.monotonic() + START_DEADLINE_S
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:  # timed out, or the process exited without the line
                raise AssertionError(f"no line matching {pattern!r}; stderr:\n" +
                                     "".join(self.log))
            self.log.append(line)
            m = re.search(pattern, line)
            if m:
                return m

    def wait_exit(self, timeout: float = 120.0) -> int:
        rc = self.proc.wait(timeout)
        self._reader.join(10.0)  # stderr is at EOF: the reader hands over the last lines
        while not self.lines.empty():
            line = self.lines.get()
            if line is not None:
                self.log.append(line)
        return rc


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    d = tmp_path_factory.mktemp("tiny-mh")
    model = mh_model()
    save_hf_dir(d, model.config, model.params)
    train_bpe_tokenizer(d, VOCAB)
    return d


def mh_model():  # noqa: ANN201 - LoadedModel
    return tiny_model(num_heads=8, num_kv_heads=2, head_dim=8, hidden_size=64,
                      intermediate_size=128, vocab_size=VOCAB, eos_token_ids=(0,))


def test_two_processes_serve_tp4_and_stop_together(model_dir: pathlib.Path) -> None:
    coordinator, port = free_port(), free_port()
    env = {**os.environ, "XLA_FLAGS": device_count_flags(2),
           "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "JAXSERVE_COMPILATION_CACHE_DIR": ""}
    procs = [Process([sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(model_dir),
                      "--port", str(port), "--no-http", "--metrics-port", "0", *SERVE_FLAGS,
                      "--coordinator", f"127.0.0.1:{coordinator}", "--num-processes", "2",
                      "--process-id", str(i)], env) for i in range(2)]
    try:
        ready = procs[0].wait_line(r"ready: serving .* on (\S+:\d+) metrics=(\S+)")
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        with Client(ready.group(1)) as client:
            got = [client.generate(p, params)[0].token_ids for p in PROMPTS]
            tied = client.generate("id:", {"max_tokens": 24, "temperature": 1.0, "seed": 1,
                                           "structured_outputs": {"regex": r"[a-z]{2,4}-\d{2}"}})
        assert re.fullmatch(r"[a-z]{2,4}-\d{2}", tied[0].text), tied[0].text
        metrics = urllib.request.urlopen(ready.group(2), timeout=10).read().decode()
        procs[0].proc.send_signal(signal.SIGTERM)
        rc0 = procs[0].wait_exit()
        follower = procs[1].wait_line(
            r"ran steps=(\d+) rounds=0 keepalives=\d+ compiles_after_warmup=(\d+)")
        rc1 = procs[1].wait_exit()
    finally:
        for p in procs:
            p.proc.kill()
    model = mh_model()
    assert got == [rollout(model, p, 8) for p in PROMPTS]
    assert rc0 == 0, "".join(procs[0].log)
    assert rc1 == 0, "".join(procs[1].log)
    # Process 1 ran warmup (every bucket) and then the served steps; it compiled nothing since.
    assert int(follower.group(1)) > 3 * 8
    assert int(follower.group(2)) == 0
    assert re.search(r"^jaxserve:compiles_after_warmup\{[^}]*\} 0\.0$", metrics, re.M), metrics


@pytest.mark.slow(reason="a second two-process job; the served one runs by default")
def test_two_processes_run_a_batch_job(model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """`jaxserve batch` over the same two-process TP 4 job: process 0 writes OUT."""
    from jaxserve.models.tokenizer import Tokenizer

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p, "max_tokens": 8,
                                       "temperature": 0.0, "ignore_eos": True}) + "\n"
                           for i, p in enumerate(PROMPTS)))
    coordinator = free_port()
    env = {**os.environ, "XLA_FLAGS": device_count_flags(2),
           "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "JAXSERVE_COMPILATION_CACHE_DIR": ""}
    procs = [Process([sys.executable, "-m", "jaxserve.cli", "batch", str(src), str(out),
                      "--model", str(model_dir), "--no-progress", *SERVE_FLAGS,
                      "--coordinator", f"127.0.0.1:{coordinator}", "--num-processes", "2",
                      "--process-id", str(i)], env) for i in range(2)]
    try:
        rcs = [p.wait_exit(START_DEADLINE_S) for p in procs]
    finally:
        for p in procs:
            p.proc.kill()
    assert rcs == [0, 0], "".join(procs[0].log + procs[1].log)
    model = mh_model()
    tok = Tokenizer.from_hf_dir(model_dir)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == ["q0", "q1", "q2"]
    assert [r["text"] for r in records] == [tok.decode(rollout(model, p, 8)) for p in PROMPTS]


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
@pytest.mark.slow(reason="a two-process job per method; the drafters run on one process in "
                  "tests/serving/test_spec_*_build.py, replicated over a mesh in "
                  "tests/device/test_speculation_tp.py")
def test_two_processes_speculate_with_a_drafter(model_dir: pathlib.Path,
                                                tmp_path: pathlib.Path, method: str) -> None:
    """`jaxserve serve` over the two-process TP 4 job with a draft model (another random
    model of the same shape) or a random EAGLE-3 head: every process runs the drafter's
    rounds (process 0 announces them); greedy equals the rollout, process 1 ran the rounds
    and compiled nothing after warmup."""
    if method == "draft_model":
        path = tmp_path / "draft"
        draft = tiny_model(seed=1, num_heads=8, num_kv_heads=2, head_dim=8, hidden_size=64,
                           intermediate_size=128, vocab_size=VOCAB, eos_token_ids=(0,))
        save_hf_dir(path, draft.config, draft.params)
        train_bpe_tokenizer(path, VOCAB)
    else:
        from support.eagle3_oracle import HEAD_CONFIG, random_weights, write_head

        head = HEAD_CONFIG | {"hidden_size": 64, "num_attention_heads": 4, "head_dim": 16,
                              "intermediate_size": 96, "vocab_size": VOCAB,
                              "eagle_aux_hidden_state_layer_ids": [0, 1, 2]}
        path = write_head(tmp_path / "head", head, random_weights(head, seed=3))
    spec = json.dumps({"method": method, "model": str(path), "num_speculative_tokens": 3})
    coordinator, port = free_port(), free_port()
    env = {**os.environ, "XLA_FLAGS": device_count_flags(2),
           "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "JAXSERVE_COMPILATION_CACHE_DIR": ""}
    procs = [Process([sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(model_dir),
                      "--port", str(port), "--no-http", "--metrics-port", "0", *SERVE_FLAGS,
                      "--speculative-config", spec,
                      "--coordinator", f"127.0.0.1:{coordinator}", "--num-processes", "2",
                      "--process-id", str(i)], env) for i in range(2)]
    try:
        ready = procs[0].wait_line(r"ready: serving .* on (\S+:\d+) metrics=(\S+)")
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        with Client(ready.group(1)) as client:
            got = [client.generate(p, params)[0] for p in PROMPTS]
        procs[0].proc.send_signal(signal.SIGTERM)
        rc0 = procs[0].wait_exit()
        follower = procs[1].wait_line(
            r"ran steps=(\d+) rounds=(\d+) keepalives=\d+ compiles_after_warmup=(\d+)")
        rc1 = procs[1].wait_exit()
    finally:
        for p in procs:
            p.proc.kill()
    assert (rc0, rc1) == (0, 0), "".join(procs[0].log + procs[1].log)
    model = mh_model()
    assert [g.token_ids for g in got] == [rollout(model, p, 12) for p in PROMPTS]
    assert sum(g.timing.spec_num_draft_tokens for g in got) > 0
    assert int(follower.group(2)) > 0  # the drafter's rounds ran on process 1 too
    assert int(follower.group(3)) == 0


@pytest.mark.slow(reason="a third two-process job; the served one runs by default")
def test_two_processes_offline_llm(model_dir: pathlib.Path) -> None:
    """The Python recipe of docs/scaling.md: LLM on process 0, multihost.follow on process 1, with an
    idle spell in between that process 0 bridges with keepalives."""
    coordinator = free_port()
    env = {**os.environ, "XLA_FLAGS": device_count_flags(2),
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(
               [str(pathlib.Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    script = pathlib.Path(__file__).parents[1] / "support" / "workers" / "multihost_llm_worker.py"
    procs = [subprocess.Popen([sys.executable, str(script), str(i), f"127.0.0.1:{coordinator}",
                               str(model_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for i in range(2)]
    try:
        outs = [p.communicate(timeout=START_DEADLINE_S) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    model = mh_model()
    # The last stdout line: gloo prints its connection lines to stdout too.
    lead, follower = (json.loads(o[0].splitlines()[-1]) for o in outs)
    assert lead["tokens"] == [rollout(model, p, 8) for p in PROMPTS[:2]] + [[123] * 8]
    want = prompt_logprobs_oracle(PROMPTS[2], 2, model)[1:]
    got = lead["prompt_logprobs"]
    assert [[int(k) for k in e] for e in got] == [list(e) for e in want]
    # TP 4 over two processes against one device's forward: TP partial sums are another
    # summation order (support.numerics.model_logprob_atol, from the weights).
    tol = model_logprob_atol(model.config, model.params, len(PROMPTS[2]))
    np.testing.assert_allclose([v for e in got for v in e.values()],
                               [v for e in want for v in e.values()], atol=tol, rtol=0)
    assert follower["steps"] > len(PROMPTS)
    # Idle between the two generate calls: every keepalive reached the follower.
    assert lead["keepalives"] >= 3 and follower["keepalives"] == lead["keepalives"]


def test_distributed_config_is_checked() -> None:
    assert not DistributedConfig().enabled
    with pytest.raises(ValueError, match="process_id=2"):
        DistributedConfig("h:1", num_processes=2, process_id=2)
    with pytest.raises(ValueError, match="coordinator=None"):
        DistributedConfig(None, num_processes=2)
    with pytest.raises(ValueError, match="coordinator='host'"):
        DistributedConfig("host", num_processes=2, process_id=1)


def test_follower_flags_need_a_coordinator() -> None:
    out = subprocess.run([sys.executable, "-m", "jaxserve.cli", "serve", "--num-processes", "2",
                          "--process-id", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "coordinator=None must be host:port" in out.stderr


def test_leader_runner_sends_every_field_and_returns_the_runner_results() -> None:
    from support.engine_fixtures import tiny_engine

    from jaxserve.device import multihost
    from jaxserve.engine.batch import BatchShape, empty_batch, leaves, parts

    want = rollout(tiny_model(), [5, 6, 7, 8], 6)  # first: the guard counts every compile
    # Each array of every part travels in exactly one of the three broadcasts, or late (the
    # bitmask): a part walked generically cannot be forgotten, and a new part joins one of
    # the existing broadcasts (its WIRE) rather than adding a collective per step.
    shape = BatchShape(buckets=((8, 4),), page_size=4, max_pages_per_seq=2, vocab_size=64,
                       history_len=8)
    batch = empty_batch(shape, 8, 4, True, bias=True, prompt_lp=True)
    wire = multihost._wire(batch)  # noqa: SLF001
    assert list(wire) == ["forward", "sampler", "prompt_logprobs"]
    sent = [(name, field) for entries in wire.values() for name, field, _ in entries]
    late = [(name, f) for name, part in parts(batch) for f in part.LATE]
    every = [(name, f) for name, part in parts(batch) for f, _ in leaves(part)]
    assert sorted(sent + late) == sorted(every) and len(set(sent + late)) == len(every)
    assert list(multihost._wire(empty_batch(shape, 8, 4, False))) == [  # noqa: SLF001
        "forward", "sampler"]  # no prompt logprobs: that broadcast is skipped
    # Two token buckets: what travels is the same for every bucket; warmup compiles 7
    # executables, not 26.
    plain = tiny_engine(tiny_model(), token_buckets=FEW_TOKEN_BUCKETS)
    lead = tiny_engine(tiny_model(), token_buckets=FEW_TOKEN_BUCKETS)
    lead.runner = multihost.LeaderRunner(lead.runner)
    outs, scored = [], []
    for eng in (plain, lead):
        eng.add_request("a", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=6,
                                                           ignore_eos=True))
        # A prompt logprobs step: its arrays travel in the third broadcast.
        eng.add_request("s", [9, 10, 11], SamplingParams(max_tokens=0, prompt_logprobs=2))
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    (outs if o.request_id == "a" else scored).append(o)
    assert [list(o.outputs[0].token_ids) for o in outs] == [want, want]
    assert scored[0].prompt_logprobs == scored[1].prompt_logprobs
    assert len(scored[0].prompt_logprobs) == 3
    assert lead.runner.compiles_after_warmup == 0
    lead.close()

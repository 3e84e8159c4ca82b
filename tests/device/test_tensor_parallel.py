"""Tensor parallelism on 8 virtual CPU devices: TP 2 / 4 / 8 against TP 1 (the oracle).

The engines run in a subprocess (`tests/support/workers/tp_worker.py`) because the device count is fixed when
jax starts. Checked, for a model whose KV heads divide every TP size (8), one whose do not (2:
replicated) and one with a vocabulary no TP size divides (211: replicated embeddings):
greedy tokens identical to TP 1; top-5 logprobs and top-3 prompt logprobs (the prompt logprobs
pass over vocabulary-sharded LM heads) within 1e-5 relative (max|diff| / max|ref|
per step, as the logits parity tests measure; a top-N id may differ only where two ranks tie
within that tolerance); no compile after warmup;
per-device parameter and KV bytes exactly the sharded share; seeded structured-output requests
(the grammar mask over a vocabulary-sharded LM head) give TP 1's tokens; and the gRPC server
over a TP 4 engine streams the TP 1 tokens. A model of mixed layer specs (sliding-window and
global layers, a soft-cap: `mixed_layers_tp_worker.py`) gives its TP 1 outputs at TP 2 and 4,
and so do the Gemma family's models at TP sizes their KV heads do not divide (Gemma 3 with
Gemma 3 1B's single KV head, Gemma 2 with soft-caps: `gemma_tp_worker.py`), and the MoE
families with each expert's intermediate axis split (`moe_tp_worker.py`).

The default run checks one configuration, 8 KV heads at TP 2 against TP 1 (sharded attention,
KV pages and vocabulary-sharded LM head; the sampler, prompt logprobs and the compile guard
over them), with two token buckets, and the gRPC server over that TP 2 engine; the rest of the
grid, with the default buckets, is marked slow (JAXSERVE_RUN_SLOW=1): it costs ~10 minutes of
compiles on a 2-core machine, in one worker process per model (and per quantization), because
one process compiling the whole grid runs out of memory mappings (vm.max_map_count).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from support.engine_fixtures import run_device_worker, run_slow
from support.workers.tp_worker import DEFAULT_ROWS, MODELS, SLOW_PARTS

# The module's fixture runs subprocess workers with their own 900 s limit each (one in the
# default run, len(SLOW_PARTS) in sequence with JAXSERVE_RUN_SLOW=1); its first test (which
# builds the fixture) may take that long, and the limit lies past it so that a worker's
# TimeoutExpired, with its stderr, is what reports a hang.
pytestmark = pytest.mark.timeout(960 * (len(SLOW_PARTS) if run_slow() else 1))

L, HIDDEN, INTERMEDIATE = 2, 64, 128  # tp_worker's tiny models (8 heads of 8 for each)
# Weights of the quantized matmuls of the 8-KV-head model: q, k, v, o (HIDDEN x HIDDEN each)
# and gate, up, down (HIDDEN x INTERMEDIATE each) per layer; the LM head's (vocabulary x
# HIDDEN) only with quantize_lm_head.
LAYER_WEIGHTS = L * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTERMEDIATE)


def grid(tp_sizes: tuple[int, ...]) -> list:
    """(kv_heads, tp) pairs; those outside tp_worker's default run are marked slow."""
    slow = pytest.mark.slow(reason="the rest of the TP grid: ~10 min of compiles on 2 cores")
    return [pytest.param(kv, tp, marks=() if (kv, tp) in DEFAULT_ROWS else slow)
            for kv in MODELS for tp in tp_sizes]


@pytest.fixture(scope="module")
def parts() -> list[dict]:
    """The worker's documents: the default part, or with JAXSERVE_RUN_SLOW=1 each of SLOW_PARTS
    in its own process (the whole grid in one reaches the kernel's memory-map cap)."""
    names = SLOW_PARTS if run_slow() else ("default",)
    return [run_device_worker("tp_worker.py", args=(name,)) for name in names]


@pytest.fixture(scope="module")
def worker(parts: list[dict]) -> dict:
    """The parts merged: offline rows, the gRPC part, quantized rows."""
    return {"offline": [r for p in parts for r in p.get("offline", ())],
            "grpc": next(p["grpc"] for p in parts if "grpc" in p),
            "quantized": [r for p in parts for r in p.get("quantized", ())]}


def test_each_worker_process_keeps_memory_map_headroom(parts: list[dict]) -> None:
    """Each worker process stays below half of vm.max_map_count: past the cap XLA:CPU's LLVM
    JIT fails with "Cannot allocate memory" and the worker dies without a result, which is
    how the slow grid in one process failed. A part nearing the cap fails here, by name."""
    for p in parts:
        maps = p["memory_maps"]
        assert maps["count"] < maps["limit"] // 2, maps


@pytest.fixture(scope="module")
def rows(worker: dict) -> list[dict]:
    return worker["offline"]


def test_grpc_server_over_a_tp_engine(worker: dict) -> None:
    """Served through gRPC with TP 2 (TP 4 with KV heads replicated in the full grid): the
    offline TP 1 tokens."""
    served = worker["grpc"]
    assert served["tp"] > 1
    base = _by(worker["offline"], served["kv_heads"], 1)["outputs"]
    assert served["tokens"] == {rid: o["tokens"] for rid, o in base.items()}


@pytest.mark.parametrize("tp", [pytest.param(tp, marks=() if (8, tp) in DEFAULT_ROWS else
                                              pytest.mark.slow(reason="the rest of the TP grid"))
                                for tp in (2, 4, 8)])
def test_structured_output_under_tp(rows: list[dict], tp: int) -> None:
    """The grammar mask over a vocabulary-sharded LM head: the seeded constrained requests
    give TP 1's tokens, and their texts satisfy their specs."""
    import json
    import re

    from support.workers.tp_worker import STRUCTURED

    base, got = _by(rows, 8, 1)["structured"], _by(rows, 8, tp)["structured"]
    assert len(base) == len(STRUCTURED)
    assert {k: v["tokens"] for k, v in got.items()} == {k: v["tokens"] for k, v in base.items()}
    for i, spec in enumerate(STRUCTURED):
        out = got[f"s{i}"]
        assert out["finish_reason"] == "stop", out
        if spec.json is not None:
            value = json.loads(out["text"])
            assert set(value) == {"n", "ok"} and 0 <= value["n"] <= 99
        elif spec.regex is not None:
            assert re.fullmatch(spec.regex, out["text"]), out
        else:
            assert out["text"] in spec.choice, out


def _by(rows: list[dict], kv_heads: int, tp: int) -> dict:
    return next(r for r in rows if r["kv_heads"] == kv_heads and r["tp"] == tp)


@pytest.mark.parametrize("kv_heads,tp", grid((2, 4, 8)))
def test_same_tokens_and_logprobs_as_tp1(rows: list[dict], kv_heads: int, tp: int) -> None:
    base, got = _by(rows, kv_heads, 1), _by(rows, kv_heads, tp)
    _assert_same_outputs(base, got, tp)


def test_quantized_weights_under_tp(worker: dict) -> None:
    """Quantized values and scales split like the float weights: TP 2 gives TP 1's greedy
    tokens and logprobs (same tolerance), compiles nothing after warmup, and device 0 holds
    less than the whole quantized model (the split values and scales)."""
    quant = worker["quantized"]
    assert quant
    for options in {json.dumps(r["options"], sort_keys=True) for r in quant}:
        base, got = (next(r for r in quant if json.dumps(r["options"], sort_keys=True) ==
                          options and r["tp"] == tp) for tp in (1, 2))
        _assert_same_outputs(base, got, 2)
        assert got["param_bytes_device0"] < 0.75 * got["param_bytes_total"], options
        assert got["param_bytes_total"] == base["param_bytes_total"]
        # Stored quantized, not as floats: each quantized weight takes at most 1 byte plus its
        # share of the scales (int4 in groups of 32: 0.5 + 4/32 (+ 4/32 zero points); int8 /
        # fp8 per column: 1 + 4/64), i.e. under 2 of float32's 4 bytes, so the model is at
        # least 2 bytes per quantized weight smaller than float32 (a 16-bit copy would not
        # be); the embedding, the norms and an unquantized LM head stay float32.
        head = MODELS[8][1] * HIDDEN if got["options"].get("quantize_lm_head") else 0
        quantized = LAYER_WEIGHTS + head
        float_total = _by(worker["offline"], 8, 1)["param_bytes_total"]
        assert got["param_bytes_total"] < float_total - 2 * quantized, options


def _assert_same_outputs(base: dict, got: dict, tp: int) -> None:
    for rid, want in base["outputs"].items():
        have = got["outputs"][rid]
        assert have["tokens"] == want["tokens"], (rid, tp)
        assert len(have["prompt_logprobs"]) == len(want["prompt_logprobs"]) > 0
        for a, b in zip(have["logprobs"] + have["prompt_logprobs"],
                        want["logprobs"] + want["prompt_logprobs"]):
            # TP only reorders the model's sums (partial sums of o_proj / down / the
            # vocabulary-sharded lm_head): support.numerics.model_logprob_atol of the
            # worker's model, from its weights (computed in the worker).
            tol = base["logprob_atol"]
            assert next(iter(a)) == next(iter(b))  # the sampled / prompt token
            for k in a.keys() ^ b.keys():  # a top-N member only where two ranks tie
                here, other = (a, b) if k in a else (b, a)
                assert any(abs(here[k] - v) <= tol for v in other.values()), (rid, tp, a, b)
            x, y = np.sort(list(a.values())), np.sort(list(b.values()))
            assert len(x) == len(y) and np.abs(x - y).max() <= tol, (rid, tp, x, y)
    assert got["compiles_after_warmup"] == 0


@pytest.mark.slow(reason="mixed layer specs under TP: the Gemma TP test runs Gemma's "
                  "mixed sliding / global layers in the default tier")
def test_mixed_layer_specs_under_tp() -> None:
    """Sliding-window and global layers (groups of specs, a soft-cap) at TP 2 and at TP 4
    (KV heads replicated) give TP 1's tokens and logprobs: each group's scan and each
    layer's window and soft-cap hold under the shard_map'd attention."""
    doc = run_device_worker("mixed_layers_tp_worker.py")
    for tp in (2, 4):
        _assert_same_outputs(doc["1"], doc[str(tp)], tp)


@pytest.mark.parametrize("kv_heads,tp", grid((1, 2, 4, 8)))
def test_each_device_holds_its_share(rows: list[dict], kv_heads: int, tp: int) -> None:
    r, base = _by(rows, kv_heads, tp), _by(rows, kv_heads, 1)
    rep = max(1, tp // kv_heads)  # KV heads replicated when tp > num_kv_heads
    assert r["num_pages"] == base["num_pages"]
    assert r["kv_bytes_total"] == base["kv_bytes_total"] * rep
    assert r["kv_bytes_device0"] * tp == r["kv_bytes_total"]
    vocab = MODELS[kv_heads][1]
    replicated = 4 * (2 * L * HIDDEN + HIDDEN)  # attn/mlp norms + final norm, f32
    if vocab % tp:
        replicated += 4 * 2 * vocab * HIDDEN  # embed + untied lm_head stay whole
    assert r["param_bytes_device0"] == (r["param_bytes_total"] - replicated) // tp + replicated


@pytest.mark.parametrize("part", [
    "default", pytest.param("slow", marks=pytest.mark.slow(
        reason="the rest of the Gemma TP grid (Gemma 3 at TP 4, Gemma 2 at TP 2)"))])
def test_gemma_family_with_kv_heads_tp_does_not_divide(part: str) -> None:
    """Gemma 3 with 1 KV head (Gemma 3 1B's layout: qk-norm, local / global layers with two
    rope bases) and Gemma 2 with soft-caps and 2 KV heads, at TP sizes past their KV heads
    (KV heads replicated; Gemma 2 sharded at TP 2 in the slow part), and Gemma 4 (narrow
    local heads padded into wide global ones, K = V) at TP 2: TP 1's greedy tokens, and its
    logprobs within the model's derived tolerance (`gemma_tp_worker.py`)."""
    from support.workers.gemma_tp_worker import DEFAULT_ROWS, SHARDED_ROWS

    rows = run_device_worker("gemma_tp_worker.py", args=(part,))
    assert {(r["model"], r["tp"]) for r in rows} >= (set(DEFAULT_ROWS) if part == "default"
                                                     else {("gemma3-kv1", 4)})
    by = {(r["model"], r["tp"]): r for r in rows}
    for (name, tp), got in by.items():
        if tp > 1:
            if part == "default" and (name, tp) not in SHARDED_ROWS:
                assert got["kv_heads"] % tp, (name, tp)  # TP does not divide the KV heads
            _assert_same_outputs(by[(name, 1)], got, tp)


@pytest.mark.parametrize("part", [
    pytest.param("default", marks=pytest.mark.slow(
        reason="MoE under TP 2: tests/device/test_expert_parallel.py compares MoE on a mesh "
               "with one device in the default tier")),
    pytest.param("slow", marks=pytest.mark.slow(
        reason="the rest of the MoE TP grid (TP 4, Mixtral)")),
    pytest.param("quant", marks=pytest.mark.slow(
        reason="int8 expert stacks under TP (two more engines)"))])
def test_moe_families_under_tp(part: str) -> None:
    """Qwen3-MoE (a dense layer between sparse ones), Qwen2-MoE (a shared expert) and
    Mixtral with each expert's intermediate axis split over the devices and the router
    replicated: each device holds 1 / tp of every expert stack, TP 1's greedy tokens, its
    logprobs within the model's derived tolerance, no compile after warmup
    (`moe_tp_worker.py`); "quant": the same of Qwen3-MoE with int8 expert stacks."""
    from support.workers.moe_tp_worker import DEFAULT_ROWS

    rows = run_device_worker("moe_tp_worker.py", args=(part,))
    by = {(r["model"], r["tp"]): r for r in rows}
    if part == "default":
        assert set(by) == set(DEFAULT_ROWS)
    for (name, tp), got in by.items():
        for field, (device0, whole) in got["expert_bytes"].items():
            assert device0 * tp == whole, (name, tp, field)  # each device its share
        if tp > 1:
            _assert_same_outputs(by[(name, 1)], got, tp)

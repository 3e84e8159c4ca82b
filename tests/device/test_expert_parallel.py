"""Expert parallelism (`--enable-expert-parallel`, `models/moe_parallel.py`) on 8 virtual CPU
devices against one device (the oracle), and what it refuses.

The engines run in a subprocess (`tests/support/workers/moe_ep_worker.py`: the device count
is fixed when jax starts), loading tiny MoE models from HF safetensors folders. Checked, for
each expert-parallel row (model, tp): greedy tokens identical to one device; top-5 logprobs
and top-3 prompt logprobs within the model's derived tolerance (`model_logprob_atol`: EP
only reorders the model's float32 sums: attention's partial sums over heads, the experts'
k-term combine split over devices and summed by the psum, the vocabulary-sharded LM head);
no compile after warmup; each device holds exactly E / tp whole experts of every stack
(its shard's box: experts d * E / tp .. (d + 1) * E / tp - 1, every column; its bytes
E / tp experts' worth); and the compiled step's collectives, derived:
  - one all-reduce for the embedding lookup (the vocabulary-sharded table), outside the
    layers;
  - per layer body (one per scan group; XLA unrolls one-layer scans, so bodies, not loops,
    are counted): one all-reduce after attention's output projection and one after the
    MLP: on a sparse layer the experts' psum (f32[tokens, hidden]; a shared expert's
    partial sum joins it, no second one), on a dense layer the down projection's;
  - no all-gather, reduce-scatter, all-to-all or collective permute, and no collective
    inside a loop within a layer (the CPU tile loop of the grouped matmul; under TP without
    EP, XLA puts the expert down projection's all-reduce in there, once per tile).
Default tier: Qwen3-MoE (a dense layer between sparse ones) at EP 4 against one device.
JAXSERVE_RUN_SLOW=1: Qwen3-MoE, Qwen2-MoE (shared expert) and Mixtral at EP 2 / 4 / 8 and
TP 2 without EP.
The refusals run in this process: they need no devices.
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
import pytest
from support.engine_fixtures import run_device_worker, run_slow
from support.numerics import gamma

from jaxserve.cli.flags import add_engine_flags, engine_config_from_args
from jaxserve.config import EngineConfig
from jaxserve.models import families, moe_parallel, placement, tiny
from jaxserve.models.config import MoESpec

# The worker's own 900 s limit per part (two parts in the slow tier) lies inside this one,
# so a hang reports as the worker's TimeoutExpired with its stderr.
pytestmark = pytest.mark.timeout(960 * (2 if run_slow() else 1))

FIELDS = ("we_gate", "we_up", "we_down")


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    from support.workers.moe_ep_worker import DEFAULT_ROWS

    parts = ("default", "slow") if run_slow() else ("default",)
    got = [r for part in parts for r in run_device_worker("moe_ep_worker.py", args=(part,))]
    assert {(r["model"], r["tp"], r["ep"]) for r in got} >= set(DEFAULT_ROWS)
    assert any(r["ep"] for r in got)
    return got


def _base(rows: list[dict], model: str) -> dict:
    return next(r for r in rows if r["model"] == model and r["tp"] == 1)


def test_outputs_equal_one_device(rows: list[dict]) -> None:
    for got in rows:
        if got["tp"] == 1:
            continue
        base, tol = _base(rows, got["model"]), _base(rows, got["model"])["logprob_atol"]
        where = (got["model"], got["tp"], got["ep"])
        for rid, want in base["outputs"].items():
            have = got["outputs"][rid]
            assert have["tokens"] == want["tokens"], (rid, where)
            assert len(have["prompt_logprobs"]) == len(want["prompt_logprobs"]) > 0
            for a, b in zip(have["logprobs"] + have["prompt_logprobs"],
                            want["logprobs"] + want["prompt_logprobs"]):
                assert next(iter(a)) == next(iter(b))  # the sampled / prompt token
                for k in a.keys() ^ b.keys():  # a top-N member only where two ranks tie
                    here, other = (a, b) if k in a else (b, a)
                    assert any(abs(here[k] - v) <= tol for v in other.values()), where
                x, y = np.sort(list(a.values())), np.sort(list(b.values()))
                assert np.abs(x - y).max() <= tol, (where, x, y)
        assert got["compiles_after_warmup"] == 0, where


def test_each_device_holds_its_experts_whole(rows: list[dict]) -> None:
    for got in (r for r in rows if r["ep"]):
        tp, layers = got["tp"], got["layer_groups"][-1][1]
        experts, hidden, width = 8, got["hidden"], 32  # the worker's models
        for field in FIELDS:
            per_device, whole = got["expert_bytes"][field]
            assert whole == layers * experts * hidden * width * 4  # float32 stacks
            assert per_device == [whole // tp] * tp, (got["model"], tp, field)
            for d, (e, cols) in enumerate(got["expert_boxes"][field]):
                assert e == [d * experts // tp, (d + 1) * experts // tp], (field, d)
                assert cols == [0, width if field != "we_down" else hidden], (field, d)


def test_collectives_in_the_compiled_step(rows: list[dict]) -> None:
    for got in (r for r in rows if r["ep"]):
        bodies = len(got["layer_groups"])
        c = got["collectives"]
        where = (got["model"], got["tp"])
        assert sum(c["all-reduce"]) == 1 + 2 * bodies, (where, c)
        assert len(c["all-reduce"]) <= 2, (where, c)  # none inside a layer's inner loop
        assert not any(sum(v) for op, v in c.items() if op != "all-reduce"), (where, c)
        tokens = got["bucket"][0]
        assert got["psums"] == [f"f32[{tokens},{got['hidden']}]"] * got["sparse_groups"]
    # the last scan group of the Qwen3-MoE model holds two layers: a real loop, whose body
    # holds attention's all-reduce and the experts' psum
    q3 = next(r for r in rows if r["model"] == "qwen3-moe" and r["ep"])
    assert q3["layer_groups"][-1] == [2, 4] and q3["collectives"]["all-reduce"][1] == 2
    # The slow tier's TP rows without EP, for contrast (what docs/scaling.md says of them):
    # XLA puts the expert down projection's all-reduce inside the CPU tile loop (two loops
    # deep in a scanned layer), and Qwen2-MoE's shared expert adds one more per layer.
    for got in (r for r in rows if r["tp"] > 1 and not r["ep"]):
        c, bodies = got["collectives"]["all-reduce"], len(got["layer_groups"])
        assert len(c) == 3 and c[2] >= 1, (got["model"], c)
        extra = bodies if got["model"] == "qwen2-moe" else 0
        assert sum(c) == 1 + 2 * bodies + extra, (got["model"], c)


# ----------------------------------------------------------------------------- refusals
def _q3(**extra: object) -> dict:
    return {**dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                   vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=4, head_dim=8, num_experts=8,
                   num_experts_per_tok=2, moe_intermediate_size=16), **extra}


@pytest.mark.parametrize("cfg, ep, match", [
    (tiny.tiny_config(), 2, "model_type='llama' has no experts"),
    (families.config_from_hf(_q3(num_experts=6)), 4,
     "num_experts=6 is not divisible by the expert-parallel size 4"),
    (families.config_from_hf({**_q3(), "architectures": ["Qwen2MoeForCausalLM"],
                              "model_type": "qwen2_moe",
                              "shared_expert_intermediate_size": 20}), 8,
     "shared_expert_intermediate_size=20 is not divisible"),
    (families.config_from_hf(_q3()), 1, "needs tensor_parallel_size > 1"),
])
def test_refused_models_say_why(cfg, ep: int, match: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=match):
        moe_parallel.check_expert_parallel(cfg, ep)
    if ep > 1:  # placement checks before it reads a byte
        with pytest.raises(ValueError, match=match):
            placement.param_specs(cfg, ep, expert_parallel=True)


def test_engine_config_and_flag() -> None:
    with pytest.raises(ValueError, match="enable_expert_parallel=True needs "
                                         "tensor_parallel_size > 1"):
        EngineConfig(enable_expert_parallel=True, data_parallel_size=2)
    with pytest.raises(ValueError, match="enable_expert_parallel=1 must be true or false"):
        EngineConfig(enable_expert_parallel=1, tensor_parallel_size=2)  # type: ignore[arg-type]
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    cfg = engine_config_from_args(p.parse_args(["--enable-expert-parallel",
                                                "--tensor-parallel-size", "4"]))
    assert cfg.enable_expert_parallel and cfg.tensor_parallel_size == 4
    assert not engine_config_from_args(p.parse_args([])).enable_expert_parallel


def test_dispatch_by_name() -> None:
    assert moe_parallel.dispatch_fn("psum") is moe_parallel.DISPATCHES["psum"]
    with pytest.raises(ValueError, match="'all_to_all'.*is not implemented"):
        moe_parallel.dispatch_fn("all_to_all")
    with pytest.raises(ValueError, match="dispatch 'gather' is not one of"):
        moe_parallel.dispatch_fn("gather")


def test_expert_parallel_needs_a_mesh() -> None:
    from jaxserve.models import paged

    with pytest.raises(ValueError, match="expert_parallel=True needs a mesh"):
        paged.paged_hidden(None, np.zeros((2, 2, 4, 8), np.float32), None, None, None,
                           tiny.tiny_config(), expert_parallel=True)


def test_device_slices_sum_to_the_whole_moe() -> None:
    """The block each device runs (`moe_block.expert_mlp` on its E / P experts, the other
    experts' pairs sorted past its groups) summed over the P slices is the one-device MoE
    MLP, for P = 2 and 8, with routings that leave some slices no pair: the arithmetic of
    EP without the devices (the psum is this sum)."""
    from jaxserve.models import moe

    rng = np.random.default_rng(7)
    spec = MoESpec(8, 2, 12, True)
    n, hidden = 10, 16
    x = rng.standard_normal((n, hidden)).astype(np.float32)
    router = rng.standard_normal((hidden, 8)).astype(np.float32)
    router[:, 5] += 4.0  # most tokens' first choice: expert 5
    wg, wu = (0.3 * rng.standard_normal((8, hidden, 12)).astype(np.float32) for _ in "gu")
    wd = 0.3 * rng.standard_normal((8, 12, hidden)).astype(np.float32)
    weights, experts = moe.route(spec, router, x)
    block = jax.jit(moe.expert_mlp, static_argnums=(6,))
    whole = np.asarray(block(x, weights, experts, wg, wu, wd, moe.grouped_mlp, 0))
    assert np.abs(whole).max() > 1e-3
    # Each side sums the same products in its own order (each device's tile loop has its
    # own tile, and the k-term combine is split into P partial sums): per token, within
    # gamma(hidden + width + k + 4) of sum_j w_j |MLP_j| on each side, |MLP_j| the expert's
    # MLP of absolute values (|silu(g)| <= |g|), computed in float64.
    e64, w64 = np.asarray(experts), np.asarray(weights, np.float64)
    ax = np.abs(x).astype(np.float64)
    mag = np.zeros_like(whole, np.float64)
    for i, j in np.ndindex(*e64.shape):
        e = e64[i, j]
        g, u = ax[i] @ np.abs(wg[e]), ax[i] @ np.abs(wu[e])
        mag[i] += w64[i, j] * ((g * u) @ np.abs(wd[e]))
    bound = 2 * gamma(hidden + 12 + spec.top_k + 4) * mag + 1e-30
    for p in (2, 8):
        e = 8 // p
        parts = [np.asarray(block(
            x, weights, experts, wg[d * e:(d + 1) * e], wu[d * e:(d + 1) * e],
            wd[d * e:(d + 1) * e], moe.grouped_mlp, d * e)) for d in range(p)]
        err = np.abs(sum(parts) - whole)
        assert np.all(err <= bound), (p, float((err - bound).max()))
        if p == 8:  # a slice whose expert no token chose contributes exact zeros
            unused = set(range(8)) - set(e64.ravel().tolist())
            assert unused and all(not parts[d].any() for d in unused)

"""Speculative decoding with an EAGLE-3 head (method eagle3), built end to end by
`build_engine` from a head directory, with a randomly initialised head (no trained one can
be downloaded here).

Oracles:
- the plain full-sequence greedy rollout (`rollout`): greedy with speculation must emit
  exactly it, whatever the head proposes;
- the head's every proposal against a from-scratch computation of what it should be: the
  target's auxiliary hidden states of the whole sequence from one full-sequence forward
  (`paged.paged_hidden` over fresh pages), then the head run densely in PyTorch
  (`support/eagle3_oracle.reference`, no pages) over all positions and its greedy chain.
  The engine instead feeds the head incrementally, the rows of every step (prefill chunks,
  decodes, the verified part of each verification), across prefix-cache hits, back-off and
  preemption: a row missing, shifted, paired with a rejected token or skipped while backed
  off changes the head's K/V and so its proposals. Where the oracle's top two draft logits
  are closer than `TOL` a flip is allowed (the two computations round differently; see TOL).
Every run checks that no KV page leaked and nothing compiled after warmup.
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.eagle3_oracle import HEAD_CONFIG, random_weights, reference, write_head
from support.engine_fixtures import (FEW_TOKEN_BUCKETS, rollout, run_checked, tiny_engine,
                                     tiny_model)
from support.tiers import slow

from jaxserve import SamplingParams
from jaxserve.config import EngineConfig, SpeculativeConfig
from jaxserve.device.spec_draft import DraftSeq, pack_round
from jaxserve.engine.engine import Engine
from jaxserve.models import paged
from jaxserve.serving.build import build_engine
from jaxserve.serving.eagle3_proposer import Eagle3EngineProposer

# The tiny target has 2 layers: the head reads the embeddings, layer 1's input and the last
# layer's output (the default (2, L // 2, L - 3) needs L >= 6).
HEAD = HEAD_CONFIG | {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}
AUX = (0, 1, 2)
# Chunked prefill (64-token steps), pages of 4, prefix caching on.
SHARED = dict(max_num_seqs=16, max_num_batched_tokens=64, page_size=4, max_model_len=96,
              token_buckets=FEW_TOKEN_BUCKETS, enable_prefix_caching=True)
# Draft logits are O(1) (unit-scale random weights after RMS norms); the engine's and the
# oracle's f32 computations differ by summation order only (~1e-6 relative through the
# target's 2 layers and the head's 1), so 1e-3 is ~100x the expected gap while a wrong row
# (a random draft logit vector) has a top-2 margin of ~0.1.
TOL = 1e-3


def head_weights() -> dict[str, np.ndarray]:
    """The random head, its fc scaled down: the raw fc output is the midlayer's residual,
    and at full scale it outweighs the attention, so the proposals would hardly depend on
    the head's K/V (what the engine's bookkeeping feeds) and the oracle test could not
    tell a missing or shifted row."""
    w = random_weights(HEAD, seed=3)
    w["fc.weight"] = w["fc.weight"] * np.float32(0.05)
    return w


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_head(tmp_path_factory.mktemp("eagle3") / "head", HEAD, head_weights())


def eagle_spec(path: pathlib.Path, k: int, **kw: object) -> SpeculativeConfig:
    return SpeculativeConfig.from_dict({"method": "eagle3", "model": str(path),
                                        "num_speculative_tokens": k, **kw})


class Recorded:
    """The engine's proposals as made: (the sequence's tokens then, its proposals)."""

    def __init__(self, eng: Engine):
        self.proposer = eng._core.speculator.proposer  # type: ignore[union-attr]
        assert isinstance(self.proposer, Eagle3EngineProposer)
        self.made: list[tuple[list[int], list[int]]] = []
        inner = self.proposer.propose

        def propose(seqs):  # noqa: ANN001, ANN202 - the Proposer protocol
            out = inner(seqs)
            self.made += [(list(s.all_token_ids), p) for s, p in zip(seqs, out) if p]
            return out

        self.proposer.propose = propose  # an instance attribute: the engine calls it


def target_aux(tokens: list[int]) -> np.ndarray:
    """The target's aux states f32[n, 3 * H] of `tokens`, one full-sequence forward."""
    model = tiny_model()
    T, ps = 128, 4
    kv = paged.init_kv_cache(model.config, T // ps + 1, ps, jnp.float32)
    rnd = pack_round([DraftSeq(tokens, 0, list(range(1, T // ps + 1)))], [(T, 1)], ps, T // ps)
    step = jax.jit(paged.paged_hidden, static_argnames=("cfg", "attn_impl", "aux_layers"))
    _, _, aux = step(model.params, kv, jnp.asarray(rnd.token_ids), jnp.asarray(rnd.positions),
                     jax.device_put(rnd.md), cfg=model.config, aux_layers=AUX)
    return np.asarray(aux)[:len(tokens)]


def check_proposals(made: list[tuple[list[int], list[int]]], weights: dict) -> int:
    """Each recorded chain against the oracle (module docstring); -> proposals matched."""
    d2t = weights["d2t"]
    fc = weights["fc.weight"]
    matched = 0
    for tokens, props in made:
        n = len(tokens)
        # Head rows 0 .. n - 2: the target's state at p with the token at p + 1.
        hidden = target_aux(tokens[:n - 1]) @ fc.T
        head_tokens = list(tokens[1:])
        for j, got in enumerate(props):
            out, logits = reference(weights, HEAD, np.asarray(head_tokens), hidden_in=hidden)
            last = logits[-1]
            top2 = np.sort(last)[-2:]
            want = int(np.argmax(last))
            want += int(d2t[want])
            if got != want:
                assert top2[1] - top2[0] < TOL, (n, j, got, want, top2)
                break  # the chain followed another token: nothing to compare after it
            matched += 1
            # Chain row j + 1: proposal j at the next position, fed the row's own output.
            head_tokens.append(got)
            hidden = np.concatenate([hidden, out[-1:]])
    return matched


PROMPTS = [[5, 6, 7, 8, 9, 10] * 3,
           [5, 6, 7, 8, 9, 10] * 3 + [40, 41],  # a prefix-cache hit on the first's pages
           [20, 21, 22],
           list(range(30, 100))]  # 70 tokens: two prefill chunks


def _greedy(eng: Engine, max_tokens: list[int]) -> Recorded:
    rec = Recorded(eng)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in max_tokens]
    drafts = eng.stats().spec_num_draft_tokens
    finals = run_checked(eng, PROMPTS, params)
    model = tiny_model()
    for i, p in enumerate(PROMPTS):
        assert finals[f"r{i}"].outputs[0].token_ids == rollout(model, p, max_tokens[i]), i
    assert eng.stats().spec_num_draft_tokens > drafts
    return rec


def preempting(spec: SpeculativeConfig, **cfg: object) -> Engine:
    """An engine of SHARED's with pages for ~2 of the test's sequences: they preempt each
    other mid-speculation (the head's rows are recomputed with the target's)."""
    probe = tiny_engine(speculative_config=spec, warmup=False, **SHARED)
    return tiny_engine(speculative_config=spec, **(SHARED | dict(
        kv_cache_memory=28 * probe.plan.kv_bytes_per_page) | cfg))


@pytest.fixture(scope="module")
def k3(head_dir: pathlib.Path) -> Engine:
    """k = 3, backing off at 3 running sequences, preempting."""
    return preempting(eagle_spec(head_dir, 3, disable_by_batch_size=3))


def test_greedy_equals_rollout_and_every_proposal_the_oracle(k3: Engine) -> None:
    """The first steps only catch up (4 requests: backed off), speculation starts as they
    finish (staggered max_tokens); sequences are preempted on the way."""
    rec = _greedy(k3, [24, 12, 6, 18])
    assert k3.stats().num_preemptions > 0
    assert check_proposals(rec.made, head_weights()) >= len(rec.made)  # most chains start right
    del rec.proposer.propose  # the recorder off: the class's method again


def test_abort_mid_speculation_leaks_no_page(k3: Engine) -> None:
    """Requests aborted while their verification steps are in flight: every page comes back
    and the head's next round skips them."""
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i in range(2):
        k3.add_request(f"a{i}", PROMPTS[i], sp)
    drafts = k3.stats().spec_num_draft_tokens
    while k3.stats().spec_num_draft_tokens == drafts:
        k3.step()
    for i in range(2):
        k3.abort(f"a{i}")
    while k3.has_unfinished():
        k3.step()
    alloc = k3.scheduler.allocator
    assert alloc.num_free_pages == alloc.num_usable_pages
    # The engine goes on serving: greedy still equals the rollout afterwards.
    finals = run_checked(k3, [PROMPTS[2]], [dataclasses.replace(sp, max_tokens=8)])
    assert finals["r0"].outputs[0].token_ids == rollout(tiny_model(), PROMPTS[2], 8)


@pytest.mark.parametrize("k", [1, 5])
@slow("another engine build per k: k = 3 (pipelined, preempting, backing off) runs by default")
def test_other_k_on_the_synchronous_core(head_dir: pathlib.Path, k: int) -> None:
    eng = preempting(eagle_spec(head_dir, k, disable_by_batch_size=17), async_scheduling=False)
    rec = _greedy(eng, [24, 12, 20, 18])
    assert eng.stats().num_preemptions > 0
    assert check_proposals(rec.made, head_weights()) >= len(rec.made)


@pytest.mark.parametrize("change, words", [
    (None, ["model=", "does not load", "config.json"]),
    ({"hidden_size": 48}, ["cannot draft for the target", "hidden states of size 48"]),
    ({"vocab_size": 300}, ["cannot draft for the target", "vocab_size=300"]),
], ids=["no-config", "hidden", "vocab"])
def test_a_head_that_does_not_fit_is_refused_naming_it(tmp_path: pathlib.Path,
                                                        change: dict | None,
                                                        words: list[str]) -> None:
    cfg = HEAD | (change or {})
    d = write_head(tmp_path / "head", cfg, random_weights(cfg, seed=3))
    if change is None:
        (d / "config.json").unlink()
    config = EngineConfig(speculative_config=eagle_spec(d, 2), max_model_len=64,
                          attention_impl="reference")
    with pytest.raises(ValueError) as e:
        build_engine(config, tiny_model(), warmup=False, progress=False)
    for w in words:
        assert w in str(e.value)

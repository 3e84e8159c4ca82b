"""The real bundled SmolLM2-135M-Instruct GGUF: greedy parity with HF transformers and the CLI.

Oracle: transformers loads the same GGUF file (its own dequantizer and q/k un-permutation;
support.bundled_hf converts it once per session),
runs in float32 and decodes greedily; jaxserve must produce the same 48 tokens for each prompt.
By default two prompts (plain text and the chat format's special tokens, in one batched call
of different lengths); the other six (code, non-ASCII text, ...) with JAXSERVE_RUN_SLOW=1
(each prompt costs transformers a 48-token generate, ~8 s on 2 cores).
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from support.bundled_hf import bundled_hf_model, bundled_hf_tokenizer  # noqa: E402
from support.cached_generate import generate  # noqa: E402
from support.numerics import logits_atol  # noqa: E402

from jaxserve import cli  # noqa: E402
from jaxserve.models import decoder, loading  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
    "Les fleurs du printemps sont",
    "List of prime numbers: 2, 3, 5, 7,",
]
NEW_TOKENS = 48
DEFAULT_PROMPTS = [PROMPTS[i] for i in (0, 5)]
MORE_PROMPTS = [p for p in PROMPTS if p not in DEFAULT_PROMPTS]


@pytest.fixture(scope="module")
def ours() -> loading.LoadedModel:
    return loading.load_model(None, "float32")


@pytest.fixture(scope="module")
def hf():
    return bundled_hf_tokenizer(), bundled_hf_model()


def test_bundled_config(ours: loading.LoadedModel) -> None:
    cfg = ours.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.tie_word_embeddings and ours.params.lm_head is None
    assert ours.format == "gguf"


def test_logits_match_transformers(ours: loading.LoadedModel, hf) -> None:
    tok, model = hf
    ids = tok(PROMPTS[2], return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model(ids).logits[0].numpy()
    got = np.asarray(decoder.forward_jit(ours.params, ids.numpy().astype(np.int32),
                                         np.array([ids.shape[1]], np.int32), cfg=ours.config))[0]
    # XLA against torch over 30 layers: support.numerics.logits_atol, from the weights.
    err, tol = np.max(np.abs(got - ref)), logits_atol(ours.config, ours.params, ids.shape[1])
    print(f"bundled SmolLM2 logits: max|diff| = {err:.2e}, {err / tol:.1e} of its bound")
    assert err <= tol


@pytest.mark.parametrize("prompts", [
    pytest.param(DEFAULT_PROMPTS, id="default"),
    pytest.param(MORE_PROMPTS, id="more", marks=pytest.mark.slow(
        reason="six more prompts: a 48-token transformers generate each")),
])
def test_greedy_matches_transformers(ours: loading.LoadedModel, hf, prompts: list[str]) -> None:
    tok, model = hf
    prompt_ids = [tok(p).input_ids for p in prompts]
    # One batched call on our side: rows of different lengths exercise padding too.
    got = generate(ours.params, ours.config, prompt_ids, NEW_TOKENS,
                   stop_token_ids=ours.config.eos_token_ids)
    mismatches = []
    for p, ids, g in zip(prompts, prompt_ids, got):
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=list(ours.config.eos_token_ids),
                                 pad_token_id=tok.pad_token_id)
        ref = out[0, len(ids):].tolist()
        if g != ref:
            mismatches.append((p, tok.decode(g), tok.decode(ref)))
    assert not mismatches, mismatches


def test_cli_generate_says_paris(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["generate", "The capital of France is", "--max-tokens", "12"])
    assert rc == 0
    assert "Paris" in capsys.readouterr().out


def test_cli_reports_bad_model_path(tmp_path: pathlib.Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["generate", "hi", "--model", str(tmp_path / "nope")])
    assert rc == 2
    assert "no such file or directory" in capsys.readouterr().err

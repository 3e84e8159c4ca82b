"""Gemma 4 (text) GGUF files, as llama.cpp's converter writes them, against transformers.

Each model is one of test_gemma4's random `Gemma4ForCausalLM`s (support.hf_models'
GEMMA4_ARCHS, here with the tiny GGUF vocabulary): K = V with one global KV head and a final
soft-cap; separate V with biases and an untied head; per-layer embeddings with the last two
layers reusing earlier layers' K/V and double-wide MLPs. Each is written to a GGUF by
`support.gguf_files.write_gemma4_gguf` (gguf's GEMMA4 tensor-name map, the converter's keys:
per-layer KV-head counts and sliding pattern, `_swa` head sizes, the `rope_freqs` tensor of
the proportional global RoPE, norms unshifted). transformers has no gemma4 GGUF reader, so the
oracle is the HF model itself (for Q8_0 files, with its 2-D weights replaced by gguf-py's own
dequantization of the same blocks).

Checked: the config read from the file equals the HF model's; the tensors equal the HF
weights (bit for bit in F32); full-sequence logits within test_gemma4's bound
(support.numerics.logits_atol), and far outside it when the file's `rope_freqs` is ignored
(the proportional RoPE is read, not assumed); greedy decoding through `LLM(model=PATH.gguf)`
equal to transformers' greedy `generate`; the metadata and tensors refused, each naming why.
"""

from __future__ import annotations

import copy
import dataclasses
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from support import gemma4_bpe  # noqa: E402
from support.engine_fixtures import few_token_buckets  # noqa: E402
from support.gguf_files import Q, TINY, tiny_gguf_vocab, write_gemma4_gguf  # noqa: E402
from support.hf_models import GEMMA4_ARCHS, build_gemma_model, hf_greedy  # noqa: E402
from support.numerics import logits_atol  # noqa: E402
from support.tiers import run_slow  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.models import decoder, families, loading  # noqa: E402
from jaxserve.models.gguf_loader import CheckpointError, open_gguf, read_gguf  # noqa: E402
from jaxserve.models.quant import WeightQuant  # noqa: E402

PROMPTS = [[5, 17, 90, 3, 42, 8, 75, 7, 61, 33, 12, 88, 4], [9, 9, 60, 23, 77, 6],
           list(range(20, 39))]
# (arch, weight type): every arch in F32; Q8_0 on the one with the most kinds of tensor.
CASES = [(a, "F32") for a in sorted(GEMMA4_ARCHS)] + [("gemma4_ple", "Q8_0")]
QTYPES = {"F32": Q.F32, "Q8_0": Q.Q8_0}
# Quantized weights read as floats ("none"): the file's values exactly. Under "auto" the
# Q8_0 blocks are kept where a field's layers map onto them exactly; here the sliding layers'
# 16-wide heads, zero-padded to the global 32 (`PaddedHeads`), straddle Q8_0's 32-blocks on
# wo's input axis, so that field mixes padded and plain layers and "auto" falls back to
# requantizing it to int8 (`quantized_params.quantize_leaf`, logged), an error of its own
# that this float bound does not cover. Released Gemma 4 heads (256 / 512) are whole blocks:
# there the padded blocks stay aligned and "auto" keeps the values
# (test_whole_block_heads_keep_q8_0_values_under_auto).
_QUANT = WeightQuant(scheme="none")
_VOCAB = dict(vocab_size=TINY["vocab"], vocab_size_per_layer_input=TINY["vocab"])


def _weights(model) -> dict[str, np.ndarray]:  # noqa: ANN001 - a transformers model
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def _dequantized(model, qtype: Q):  # noqa: ANN001, ANN202 - transformers models
    """The model with each 2-D weight of whole-block rows as gguf-py quantizes and
    dequantizes it: the reference for a file whose such weights are stored in `qtype`."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.ndim == 2 and p.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
                w = p.detach().numpy().astype(np.float32)
                back = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)
                p.copy_(torch.from_numpy(np.asarray(back, np.float32).reshape(w.shape)))
    return ref


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def gguf_file(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """(arch, qtype name, the HF reference model, the GGUF path)."""
    arch, qname = request.param
    d = tmp_path_factory.mktemp(f"{arch}-{qname}")
    model = build_gemma_model(arch, d / "hf", **_VOCAB)
    path = d / "model.gguf"
    write_gemma4_gguf(path, _weights(model), model.config.to_dict(), qtype=QTYPES[qname])
    ref = model if qname == "F32" else _dequantized(model, QTYPES[qname])
    # transformers' generate stops at the config's eos unless its own config is cleared
    ref.generation_config.eos_token_id = None
    return arch, qname, ref, path


def _ours(model: loading.LoadedModel, tokens: np.ndarray) -> np.ndarray:
    return np.asarray(decoder.forward_jit(model.params, tokens,
                                          np.array([tokens.shape[1]], np.int32),
                                          cfg=model.config))


def _ref(model, tokens: np.ndarray) -> np.ndarray:  # noqa: ANN001 - a transformers model
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def test_config_equals_the_hf_models(gguf_file) -> None:  # noqa: ANN001
    arch, _, ref, path = gguf_file
    ours = families.config_from_hf(open_gguf(path).hf_config, source=str(path))
    hf = families.config_from_hf(ref.config.to_dict())
    # the file holds the eps as float32, as llama.cpp's converter writes it
    assert ours.rms_norm_eps == float(np.float32(hf.rms_norm_eps))
    assert dataclasses.replace(ours, rms_norm_eps=hf.rms_norm_eps) == hf
    glob = next(s for s in ours.layer_specs if s.sliding_window is None)
    assert glob.rope_scaling.rope_type == "proportional"
    assert any(s.v_from_k for s in ours.layer_specs) == (arch == "gemma4_kv")
    assert bool(ours.per_layer_input_size) == (arch == "gemma4_ple")


def test_tensors_equal_the_hf_weights(gguf_file) -> None:  # noqa: ANN001
    """Norms are stored as they are (no 1 + w for Gemma 4): every tensor the file holds
    reads back as the HF weight (F32 files bit for bit; Q8_0 as gguf-py dequantizes); a
    per-device box (half the rows) equals the whole-file read."""
    _, qname, ref, path = gguf_file
    ckpt = read_gguf(path)
    want = _weights(ref)
    tied = ref.config.tie_word_embeddings
    assert set(ckpt.tensors) == set(want) - ({"lm_head.weight"} if tied else set())
    for name, got in ckpt.tensors.items():
        np.testing.assert_array_equal(got, want[name].reshape(got.shape), err_msg=name)
    lazy = open_gguf(path)
    assert not any(t.shift for t in lazy.tensors.values())
    for name, t in lazy.tensors.items():
        half = t.shape[0] // 2
        np.testing.assert_array_equal(t[half:], ckpt.tensors[name][half:], err_msg=name)


def test_logits_match_transformers(gguf_file) -> None:  # noqa: ANN001
    arch, qname, ref, path = gguf_file
    ours = loading.load_model(path, quant=_QUANT)
    tokens = np.array([PROMPTS[0]], np.int32)  # 13 tokens: three windows
    err = float(np.max(np.abs(_ours(ours, tokens) - _ref(ref, tokens))))
    tol = logits_atol(ours.config, ours.params, tokens.shape[1])
    print(f"{arch} {qname}: max|diff| = {err:.2e}, bound {tol:.2e}")
    assert err <= tol


def test_logits_are_wrong_without_rope_freqs(gguf_file,  # noqa: ANN001
                                             tmp_path: pathlib.Path) -> None:
    """Guard against a vacuous pass: the same weights in a file without `rope_freqs` (global
    layers then rotate every pair) give logits outside the bound. The pairs proportional
    RoPE leaves unrotated are the slow ones (angles of position x theta^-2j/d, j past the
    rotated ones), so a 60-token prompt, where they turn enough to show."""
    arch, qname, ref, _ = gguf_file
    if qname != "F32":
        pytest.skip("one weight type suffices")
    path = tmp_path / "plain.gguf"
    write_gemma4_gguf(path, _weights(ref), ref.config.to_dict(), rope_freqs=False)
    wrong = loading.load_model(path)
    tokens = np.array([[(7 * i) % 90 + 3 for i in range(60)]], np.int32)
    err = float(np.max(np.abs(_ours(wrong, tokens) - _ref(ref, tokens))))
    tol = logits_atol(wrong.config, wrong.params, tokens.shape[1])
    print(f"{arch}: without rope_freqs max|diff| = {err:.2e}, bound {tol:.2e}")
    assert err > 10 * tol, arch


def test_greedy_through_llm_equals_transformers_generate(gguf_file) -> None:  # noqa: ANN001
    arch, qname, ref, path = gguf_file
    # Default tier: the file with the most kinds of tensor, quantized (gemma4_ple Q8_0).
    if qname == "F32" and not run_slow():
        pytest.skip("slow test (the F32 files' logits are tested against transformers; the "
                    "Q8_0 file runs greedy): set JAXSERVE_RUN_SLOW=1 to run it")
    n = 6
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    # Tiny pages and a small step budget: windows span pages, prompts prefill in chunks;
    # one token bucket, the whole 8-token step (each bucket is a whole-model compile).
    with LLM(model=str(path), max_num_seqs=4, max_num_batched_tokens=8, page_size=4,
             max_model_len=64, kv_cache_memory=1 << 20, quantization=_QUANT.scheme,
             token_buckets=few_token_buckets(8)) as llm:
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(ref, p, n)
                                                      for p in PROMPTS], (arch, qname)


def test_whole_block_heads_keep_q8_0_values_under_auto(tmp_path: pathlib.Path) -> None:
    """Heads of 32 / 64 (whole Q8_0 blocks, as released Gemma 4's 256 / 512): under the
    default "auto" the padded layers' blocks stay aligned, so the logits are the dequantized
    file's within the float bound."""
    model = build_gemma_model("gemma4_kv", tmp_path / "hf", head_dim=32, global_head_dim=64,
                              **_VOCAB)
    path = tmp_path / "q8.gguf"
    write_gemma4_gguf(path, _weights(model), model.config.to_dict(), qtype=Q.Q8_0)
    ref = _dequantized(model, Q.Q8_0)
    ours = loading.load_model(path)  # quantization "auto"
    tokens = np.array([PROMPTS[0]], np.int32)
    err = float(np.max(np.abs(_ours(ours, tokens) - _ref(ref, tokens))))
    assert err <= logits_atol(ours.config, ours.params, tokens.shape[1])


# --------------------------------------------------------------------------- refused
@pytest.fixture(scope="module")
def bias_model(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    d = tmp_path_factory.mktemp("refused")
    return build_gemma_model("gemma4_bias", d / "hf", **_VOCAB)


@pytest.mark.parametrize("meta, match", [
    ({"expert_count": 4}, "expert_count"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"rope.dimension_count_swa": 8}, "rope.dimension_count_swa=8"),
    ({"rope.dimension_count": 16}, "rope.dimension_count=16"),
    ({"attention.value_length_swa": 8}, "value_length_swa=8"),
    ({"feed_forward_length": [96, 96, 96, 96, 192]}, "feed_forward_length"),
    ({"attention.head_count_kv": [2, 2]}, "head_count_kv"),
    ({"attention.sliding_window_pattern": [True, False]}, "sliding_window_pattern"),
])
def test_refused_metadata_names_the_key(bias_model, meta: dict, match: str,  # noqa: ANN001
                                        tmp_path: pathlib.Path) -> None:
    path = tmp_path / "bad.gguf"
    write_gemma4_gguf(path, _weights(bias_model), bias_model.config.to_dict(),
                      meta_override=meta)
    with pytest.raises(CheckpointError, match=match):
        open_gguf(path)


@pytest.mark.parametrize("freqs", [
    np.linspace(1.0, 8.0, 16),  # llama 3's kind of factors
    np.array([1.0] * 8 + [1e30] * 7),  # one factor short of the global head's 16 pairs
    np.array([1.0] * 4 + [1e30] * 4 + [1.0] * 8),  # rotated pairs not a prefix
])
def test_rope_freqs_other_than_proportional_are_refused(
        bias_model, freqs: np.ndarray, tmp_path: pathlib.Path) -> None:  # noqa: ANN001
    path = tmp_path / "freqs.gguf"
    write_gemma4_gguf(path, _weights(bias_model), bias_model.config.to_dict(), rope_freqs=freqs)
    with pytest.raises(CheckpointError, match="rope_freqs"):
        open_gguf(path)


def test_model_wide_rope_scaling_is_refused(bias_model,  # noqa: ANN001
                                            tmp_path: pathlib.Path) -> None:
    path = tmp_path / "scaled.gguf"
    write_gemma4_gguf(path, _weights(bias_model), bias_model.config.to_dict(),
                      meta_override={"rope.scaling.type": "linear", "rope.scaling.factor": 2.0})
    with pytest.raises(CheckpointError, match="rope.scaling.type='linear'"):
        open_gguf(path)


def test_k_eq_v_on_only_some_layers_is_refused(bias_model,  # noqa: ANN001
                                               tmp_path: pathlib.Path) -> None:
    """Separate V on layer 4 but not on layer 2 (both global): no config says that."""
    weights = {k: v for k, v in _weights(bias_model).items()
               if not k.startswith("model.layers.2.self_attn.v_proj.")}
    path = tmp_path / "half.gguf"
    write_gemma4_gguf(path, weights, bias_model.config.to_dict())
    with pytest.raises(CheckpointError, match="attn_v.weight is missing"):
        open_gguf(path)


def test_gemma4_vocabulary_kind_loads_with_the_model(bias_model,  # noqa: ANN001
                                                      tmp_path: pathlib.Path) -> None:
    """The converter writes Gemma 4's vocabulary as tokenizer.ggml.model "gemma4": the whole
    file loads, its tokenizer encoding as llama.cpp's reading of that kind does
    (support.gemma4_bpe; the kind itself: test_gguf_gemma4_tokenizer) and BOS on."""
    path = tmp_path / "vocab.gguf"
    write_gemma4_gguf(path, _weights(bias_model), bias_model.config.to_dict(),
                      tokenizer_model="gemma4")
    assert open_gguf(path).hf_config["model_type"] == "gemma4_text"
    model = loading.load_model(path)
    tokens, merges = tiny_gguf_vocab()
    for text in ("the cat", "sat on the mat"):
        want = gemma4_bpe.encode(tokens, merges, [], text.replace(" ", "\u0120"), bos=1)
        # the tiny vocabulary spells a space as GPT-2's "Ġ", which the text here spells itself
        assert model.tokenizer.encode(text.replace(" ", "\u0120")) == want

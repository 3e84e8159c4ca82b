"""Gemma 2 and Gemma 3 (text) GGUF files against transformers' own GGUF loader.

Each model is built at random by transformers (Gemma's default layer patterns: Gemma 2
alternating from a sliding layer, Gemma 3 five sliding then one global; a window of 4 tokens,
shorter than the prompts; head_dim 256, Gemma's, so that llama.cpp's query scale and the
default `query_pre_attn_scalar` transformers' GGUF loader leaves agree), written to a GGUF as
llama.cpp's converter writes it (`support.gguf_files.write_gemma_gguf`: norms stored as 1 + w,
gguf's tensor names, the converter's metadata keys), in F32 and with Q8_0 linear weights.

Oracle: `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` on the same file, which
reads the metadata, dequantizes with gguf-py and subtracts the 1 with its own code. Checked:
the config from the GGUF equals the HF model's; the tensors equal transformers' reading of the
file, through the whole-file and the per-box (per-device) paths alike; full-sequence logits
within the Gemma bound of `support.numerics`, and far outside it without the norm shift;
greedy decoding through `LLM` equal to transformers' `generate`; the metadata llama.cpp reads
(window, layer pattern keys, soft-caps, rope bases and scaling, the 27B query scale); and the
Gemma-line GGUF architectures that are refused, each with its reason.
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from support.engine_fixtures import few_token_buckets  # noqa: E402
from support.gguf_files import Q, TINY, write_arch_gguf, write_gemma_gguf  # noqa: E402
from support.numerics import gemma_logits_atol  # noqa: E402
from support.spm_vocab import gemma_vocab  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.models import decoder, families, gemma, loading  # noqa: E402
from jaxserve.models.config import ConfigError  # noqa: E402
from jaxserve.models.gguf_loader import CheckpointError, _hf_config, open_gguf, read_gguf  # noqa: E402

WINDOW = 4
_BASE = dict(vocab_size=TINY["vocab"], hidden_size=64, intermediate_size=96,
             num_attention_heads=2, num_key_value_heads=1, head_dim=256,
             query_pre_attn_scalar=256, max_position_embeddings=256, sliding_window=WINDOW,
             rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
ARCHS = {
    "gemma2": ("Gemma2Config", dict(_BASE, num_hidden_layers=4)),
    "gemma3": ("Gemma3TextConfig", dict(_BASE, num_hidden_layers=7)),
}
QTYPES = {"F32": Q.F32, "Q8_0": Q.Q8_0}
PROMPTS = [[5, 17, 90, 3, 42, 8, 75, 7, 61, 33, 12, 88, 4], [9, 9, 60, 23, 77, 6],
           list(range(20, 39))]


def _build(arch: str):  # noqa: ANN202 - the torch model
    cls, kwargs = ARCHS[arch]
    config = getattr(transformers, cls)(**kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # as test_gemma: norm offsets away from 0, the rest scaled up
        for name, p in model.named_parameters():
            p.add_(0.3 * torch.randn_like(p)) if "norm" in name else p.mul_(2.0)
    return model


@pytest.fixture(scope="module", params=[(a, q) for a in sorted(ARCHS) for q in QTYPES],
                ids=lambda p: f"{p[0]}-{p[1]}")
def gguf_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """(arch, qtype name, the HF model, the GGUF path, transformers' model from that GGUF)."""
    arch, qname = request.param
    model = _build(arch)
    d = tmp_path_factory.mktemp(f"{arch}-{qname}")
    path = d / "model.gguf"
    weights = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    write_gemma_gguf(path, weights, model.config.to_dict(), qtype=QTYPES[qname])
    # eager: the reference for the soft-cap and the window (as test_gemma)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        d, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager").eval()
    return arch, qname, model, path, ref


def _ours(model: loading.LoadedModel, tokens: np.ndarray) -> np.ndarray:
    return np.asarray(decoder.forward_jit(model.params, tokens,
                                          np.array([tokens.shape[1]], np.int32),
                                          cfg=model.config))


def test_config_equals_the_hf_models(gguf_file) -> None:  # noqa: ANN001
    arch, _, model, path, ref = gguf_file
    ours = families.config_from_hf(open_gguf(path).hf_config, source=str(path))
    hf = families.config_from_hf(model.config.to_dict())
    # the file holds the eps as float32, as llama.cpp's converter writes it
    assert ours.rms_norm_eps == float(np.float32(hf.rms_norm_eps))
    assert dataclasses.replace(ours, rms_norm_eps=hf.rms_norm_eps) == hf
    # transformers' reading of the file agrees on the fields it reads
    assert ours.model_type == ref.config.model_type
    assert [s.attention_type for s in ours.layer_specs] == ref.config.layer_types
    assert ours.layer_specs[0].sliding_window == WINDOW and ours.tie_word_embeddings
    if arch == "gemma2":
        assert ours.final_soft_cap == 30.0 and ours.layer_specs[0].soft_cap == 50.0
    else:
        kinds = [s.attention_type for s in ours.layer_specs]
        assert kinds == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
        assert (ours.layer_specs[0].rope_theta, ours.layer_specs[5].rope_theta) == (1e4, 1e6)


def test_tensors_equal_transformers_reading(gguf_file) -> None:  # noqa: ANN001
    """Both sides dequantize with gguf-py's arithmetic and subtract the 1 in float32, so the
    tensors agree bit for bit; a per-device box of every tensor (half its rows) equals the
    whole-file read's."""
    _, _, _, path, ref = gguf_file
    ckpt = read_gguf(path)
    want = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    assert set(ckpt.tensors) == set(want) - {"lm_head.weight"}
    for name, got in ckpt.tensors.items():
        np.testing.assert_array_equal(got, want[name], err_msg=name)
    lazy = open_gguf(path)
    for name, t in lazy.tensors.items():
        half = t.shape[0] // 2
        np.testing.assert_array_equal(t[half:], ckpt.tensors[name][half:], err_msg=name)
    # the shifted tensors are the norms, and only they
    assert {n for n, t in lazy.tensors.items() if t.shift} == {n for n in lazy.tensors
                                                                if "norm" in n}


def test_logits_match_transformers(gguf_file) -> None:  # noqa: ANN001
    arch, qname, _, path, ref = gguf_file
    ours_model = loading.load_model(path)
    tokens = np.array([PROMPTS[0]], np.int32)  # 13 tokens: three windows
    with torch.no_grad():
        want = ref(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    err = float(np.max(np.abs(_ours(ours_model, tokens) - want)))
    tol = gemma_logits_atol(ours_model.config, ours_model.params, tokens.shape[1])
    print(f"{arch} {qname}: max|diff| = {err:.2e}, bound {tol:.2e}")
    assert err <= tol


def test_logits_are_wrong_without_the_norm_shift(gguf_file, monkeypatch) -> None:  # noqa: ANN001
    """Guard against a vacuous pass: with the 1 + w norms read as stored, the logits move
    far past the bound (each norm's scale doubles, roughly)."""
    arch, qname, _, path, ref = gguf_file
    if qname != "F32":
        pytest.skip("one weight type suffices")
    monkeypatch.setattr(gemma, "GGUF_NORM_SHIFTS", {})
    wrong = loading.load_model(path)
    tokens = np.array([PROMPTS[0]], np.int32)
    with torch.no_grad():
        want = ref(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    err = float(np.max(np.abs(_ours(wrong, tokens) - want)))
    assert err > 100 * gemma_logits_atol(wrong.config, wrong.params, tokens.shape[1]), arch


def test_greedy_through_llm_equals_transformers_generate(gguf_file) -> None:  # noqa: ANN001
    arch, qname, _, path, ref = gguf_file
    n = 6
    gen = transformers.GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None,
                                        pad_token_id=0)

    # The GGUF-loaded model's own generation config carries the file's eos id, which a
    # GenerationConfig's None does not override: clear it, as ignore_eos does on our side.
    ref.generation_config.eos_token_id = None

    def hf_greedy(p: list[int]) -> list[int]:
        with torch.no_grad():
            out = ref.generate(torch.tensor([p], dtype=torch.long), generation_config=gen)
        return out[0, len(p):].tolist()

    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    # Tiny pages and a small step budget: windows span pages, prompts prefill in chunks;
    # one token bucket, the whole 8-token step (each bucket is a whole-model compile).
    # Float activations: the oracle is transformers' float model over the same weights, and
    # int8 activations (the CPU default for Q8_0 blocks) would round every layer's input.
    with LLM(model=str(path), max_num_seqs=4, max_num_batched_tokens=8, page_size=4,
             max_model_len=64, kv_cache_memory=8 << 20, int8_activations="off",
             token_buckets=few_token_buckets(8)) as llm:
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(p) for p in PROMPTS], \
        (arch, qname)


@pytest.mark.slow(reason="text through a served Gemma GGUF: its SentencePiece vocabulary is "
                  "tested against transformers in test_gguf_spm_tokenizer.py, the model's "
                  "greedy here on ids")
def test_a_gemma_gguf_with_its_sentencepiece_vocabulary_serves_text(tmp_path) -> None:  # noqa: ANN001
    """A Gemma 3 GGUF as llama.cpp writes real ones: a SentencePiece vocabulary (Gemma's
    layout, with merges) beside the weights. `LLM` on the file alone tokenizes a text prompt
    as transformers' tokenizer for that file does, and generates transformers' greedy tokens
    from the same file, decoded to the same text."""
    vocab = gemma_vocab(with_merges=True)
    cls, kwargs = ARCHS["gemma3"]
    kwargs = dict(kwargs, vocab_size=len(vocab.tokens), bos_token_id=vocab.bos,
                  eos_token_id=vocab.eos, pad_token_id=vocab.pad)
    config = getattr(transformers, cls)(**kwargs)
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(0.3 * torch.randn_like(p)) if "norm" in name else p.mul_(2.0)
    path = tmp_path / "gemma3.gguf"
    write_gemma_gguf(path, {k: v.detach().numpy() for k, v in model.state_dict().items()},
                     model.config.to_dict(), vocab=vocab)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager").eval()
    ref.generation_config.eos_token_id = None
    prompt, n = "Hello, world! The weather, together with 你好 😀", 6
    ids = tok(prompt)["input_ids"]
    with torch.no_grad():
        want = ref.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                            pad_token_id=vocab.pad)[0, len(ids):].tolist()
    with LLM(model=str(path), max_num_seqs=4, max_num_batched_tokens=8, page_size=4,
             max_model_len=64, kv_cache_memory=8 << 20) as llm:
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n,
                                                    ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == want
    assert out.outputs[0].text == tok.decode(want, skip_special_tokens=True)


# ------------------------------------------------------------------ metadata, as llama.cpp
def _md(arch: str, layers: int = 8, **extra: object) -> dict[str, object]:
    md: dict[str, object] = {
        "general.architecture": arch, f"{arch}.block_count": layers,
        f"{arch}.context_length": 8192, f"{arch}.embedding_length": 256,
        f"{arch}.feed_forward_length": 512, f"{arch}.attention.head_count": 4,
        f"{arch}.attention.head_count_kv": 2, f"{arch}.attention.key_length": 32,
        f"{arch}.attention.value_length": 32, f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.vocab_size": 64}
    md.update({f"{arch}.{k}": v for k, v in extra.items()})
    return md


def _cfg(md: dict[str, object]):  # noqa: ANN202 - a ModelConfig
    return families.config_from_hf(_hf_config(md, set(), "m.gguf"), source="m.gguf")


def _kinds(cfg) -> str:  # noqa: ANN001
    return "".join("s" if s.sliding_window else "f" for s in cfg.layer_specs)


def test_gemma2_metadata_as_llama_cpp_reads_it() -> None:
    # absent keys: window 4096, soft-caps 50 / 30, alternation from a sliding layer
    cfg = _cfg(_md("gemma2"))
    assert _kinds(cfg) == "sfsfsfsf" and cfg.layer_specs[0].sliding_window == 4096
    assert cfg.final_soft_cap == 30.0 and {s.soft_cap for s in cfg.layer_specs} == {50.0}
    assert {s.query_scale for s in cfg.layer_specs} == {32 ** -0.5}  # head_dim
    assert {s.rope_theta for s in cfg.layer_specs} == {10000.0}
    cfg = _cfg(_md("gemma2", **{"attention.sliding_window": 16, "attn_logit_softcapping": 20.0,
                                "final_logit_softcapping": 10.0, "rope.freq_base": 5e4}))
    assert cfg.layer_specs[0].sliding_window == 16 and cfg.final_soft_cap == 10.0
    assert {s.soft_cap for s in cfg.layer_specs} == {20.0}
    assert {s.rope_theta for s in cfg.layer_specs} == {5e4}
    # 27B-shaped (46 layers): the query scale is hidden / heads (llama.cpp, the checkpoint's
    # query_pre_attn_scalar 144 = 4608 / 32); here 256 / 4
    cfg = _cfg(_md("gemma2", layers=46))
    assert {s.query_scale for s in cfg.layer_specs} == {64 ** -0.5}


def test_gemma3_metadata_as_llama_cpp_reads_it() -> None:
    cfg = _cfg(_md("gemma3", layers=13, **{"attention.sliding_window": 512}))
    assert _kinds(cfg) == "sssssfsssssfs"
    local, glob = cfg.layer_specs[0], cfg.layer_specs[5]
    assert (local.rope_theta, glob.rope_theta) == (10000.0, 1e6)  # the defaults
    assert cfg.final_soft_cap is None and local.soft_cap is None and local.qk_norm
    assert {s.query_scale for s in cfg.layer_specs} == {32 ** -0.5}
    # linear rope scaling (Gemma 3 4B+) on the global layers only; the local base key
    cfg = _cfg(_md("gemma3", layers=6, **{
        "attention.sliding_window": 512, "rope.freq_base": 2e6, "rope.freq_base_swa": 2e4,
        "rope.scaling.type": "linear", "rope.scaling.factor": 8.0}))
    local, glob = cfg.layer_specs[0], cfg.layer_specs[5]
    assert (glob.rope_theta, glob.rope_scaling.rope_type, glob.rope_scaling.factor) == (
        2e6, "linear", 8.0)
    assert (local.rope_theta, local.rope_scaling.rope_type) == (2e4, "default")
    # no window (or 0): every layer full
    assert _kinds(_cfg(_md("gemma3", layers=6))) == "ffffff"
    assert _kinds(_cfg(_md("gemma3", layers=6, **{"attention.sliding_window": 0}))) == "ffffff"
    # 27B-shaped (62 layers): hidden / heads
    cfg = _cfg(_md("gemma3", layers=62, **{"attention.sliding_window": 1024}))
    assert {s.query_scale for s in cfg.layer_specs} == {64 ** -0.5}


def test_sliding_window_pattern_key_is_honoured() -> None:
    w = {"attention.sliding_window": 64}
    # a per-layer array: true = sliding
    pattern = [True, False, False, True, True, False]
    cfg = _cfg(_md("gemma3", layers=6, **w, **{"attention.sliding_window_pattern": pattern}))
    assert _kinds(cfg) == "sffssf"
    # a period: layer i slides iff i % p < p - 1; 0: every layer slides
    cfg = _cfg(_md("gemma2", layers=6, **w, **{"attention.sliding_window_pattern": 3}))
    assert _kinds(cfg) == "ssfssf"
    cfg = _cfg(_md("gemma3", layers=4, **w, **{"attention.sliding_window_pattern": 0}))
    assert _kinds(cfg) == "ssss"
    with pytest.raises(CheckpointError, match="sliding_window_pattern"):
        _cfg(_md("gemma3", layers=6, **w, **{"attention.sliding_window_pattern": [True]}))


def test_pattern_array_in_a_written_file(tmp_path: pathlib.Path) -> None:
    """The array form as gguf's writer stores it (bools) reaches the config."""
    model = _build("gemma3")
    weights = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    pattern = [True, True, False, True, False, True, True]
    path = tmp_path / "p.gguf"
    write_gemma_gguf(path, weights, model.config.to_dict(),
                     meta_override={"attention.sliding_window_pattern": pattern})
    cfg = families.config_from_hf(open_gguf(path).hf_config)
    assert _kinds(cfg) == "ssfsfss"


@pytest.mark.parametrize("arch, match", [
    ("gemma", "Gemma 1"), ("gemma3n", "Gemma 3n"),
    ("gemma-embedding", "EmbeddingGemma"), ("clip", "multimodal projector"),
])
def test_refused_gguf_architectures_say_why(arch: str, match: str,
                                            tmp_path: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match=match) as e:
        families.family_for_gguf(arch, "x.gguf")
    assert "gemma2" in str(e.value) and repr(arch) in str(e.value)
    path = tmp_path / f"{arch}.gguf"
    write_arch_gguf(path, arch, {"clip.projector_type": "gemma3"} if arch == "clip" else {})
    with pytest.raises(CheckpointError, match=match):
        open_gguf(path)

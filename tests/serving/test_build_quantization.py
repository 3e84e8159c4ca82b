"""Every `--quantization` x every `--kv-cache-dtype` x every checkpoint kind, through every
way an engine is built: `LLM(path)`, `LLM(loaded=load_model(path))` (a model already in
memory, stored quantized or not, as `jaxserve bench` and researchers hand it over) and
`jaxserve generate` (in process).

The checkpoints are one tiny random llama written five ways: a GGUF with quantized blocks
(Q8_0, Q4_1 for up_proj), the float GGUF, an HF float directory and an Orbax checkpoint
(`loading.convert` of the float GGUF), and a compressed-tensors INT8 directory
(`support.compressed_ckpt`, independent of the loader). Oracles:
  - the stored scheme of every linear field, from the table of what each quantization means
    for each kind (`_expected_scheme`), and the KV pages' dtype;
  - `jaxserve generate` and `LLM(path)` build the same engine (same config, same path), so
    their greedy texts are equal;
  - `LLM(loaded=...)` quantizes from the loaded weights (quantized ones dequantized first):
    its weights equal `LLM(path)`'s bit for bit where the dequantization rounds the same
    (then the texts are equal too), and otherwise differ by at most one quantization step
    (a value at a rounding boundary that went to the neighbouring level) plus the float32
    roundings of the two dequantizations.
"""

from __future__ import annotations

import functools
import pathlib
import shutil

import gguf
import jax
import numpy as np
import pytest

from support.compressed_ckpt import write_compressed
from support.gguf_files import tiny_weights, write_tiny_gguf
from support.tiers import grid, slow, split_tiers

from jaxserve.cli.main import main as cli_main
from jaxserve.config import KV_CACHE_DTYPES, QUANTIZATIONS
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.llm import LLM
from jaxserve.models import loading
from jaxserve.models.linear import PackedWeight
from jaxserve.models.packing import LINEAR_FIELDS
from jaxserve.models.quant import QuantizedWeight

Q = gguf.GGMLQuantizationType
KINDS = ("gguf_quant", "gguf_float", "hf", "compressed", "orbax")
PROMPT = "the cat sat on the mat"
MAX_TOKENS = 4
# One small engine for all: a single token bucket (one compile per step kind), the
# reference attention, XLA's dots (so the stored QuantizedWeights can be read back; the
# packed C++ kernels get their own test below).
ENGINE = dict(max_num_seqs=2, max_num_batched_tokens=8, token_buckets=(8,), page_size=8,
              max_model_len=64, kv_cache_memory=2**20, attention_impl="reference",
              dense_impl="xla")
ENGINE_FLAGS = ["--max-num-seqs", "2", "--max-num-batched-tokens", "8", "--token-buckets", "8",
                "--page-size", "8", "--max-model-len", "64", "--kv-cache-memory", "1MiB",
                "--attention-impl", "reference", "--dense-impl", "xla",
                "--max-tokens", str(MAX_TOKENS), "--temperature", "0"]
F32_U = 2.0 ** -24

# The default tier: each kind once, each quantization and each KV dtype at least once,
# where they meet a stored quantization (the crash of #29 was a requantization).
DEFAULT = ("gguf_quant-int8-int8", "gguf_quant-none-auto", "gguf_quant-auto-auto",
           "hf-int8-auto", "compressed-fp8-bfloat16",
           "hf-auto-float16", "orbax-int4-fp8", "gguf_float-fp8-float32")
CASES = grid([[(k, k) for k in KINDS], [(q, q) for q in QUANTIZATIONS],
              [(d, d) for d in KV_CACHE_DTYPES]], DEFAULT,
             "the rest of the kind x quantization x KV dtype grid")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("ckpts")
    weights = tiny_weights(np.random.default_rng(0))
    write_tiny_gguf(root / "float.gguf", weights, tokenizer=True)
    linear = [k for k in weights if k.endswith("_proj.weight")]
    types = {k: Q.Q4_1 if "up_proj" in k else Q.Q8_0 for k in linear}
    write_tiny_gguf(root / "quant.gguf", weights, types=types, tokenizer=True)
    hf = loading.convert(root / "float.gguf", root / "hf", fmt="hf")
    orbax = loading.convert(root / "float.gguf", root / "orbax", fmt="orbax")
    write_compressed(hf, root / "compressed", "int8", "channel")
    shutil.rmtree(root / "compressed-float")
    return {"gguf_quant": root / "quant.gguf", "gguf_float": root / "float.gguf", "hf": hf,
            "compressed": root / "compressed", "orbax": orbax}


@functools.cache
def _loaded(path: pathlib.Path) -> loading.LoadedModel:
    """The checkpoint as `load_model` gives it (quantization "auto": stored quantization
    kept), once per module: every LLM(loaded=...) of the grid starts from the same object."""
    return loading.load_model(path)


def _expected_scheme(kind: str, quantization: str, field: str) -> str:
    if quantization == "none":
        return "float"
    if quantization != "auto":
        return quantization
    stored = {"gguf_quant": "int4" if field == "w_up" else "int8", "compressed": "int8"}
    return stored.get(kind, "float")


def _scheme(w: object) -> str:
    if isinstance(w, QuantizedWeight):
        return w.scheme
    if isinstance(w, PackedWeight):
        return getattr(w.panels, "scheme", "float")
    return "float"


def _float(w: object) -> np.ndarray:
    return np.asarray(w.dequantize() if isinstance(w, QuantizedWeight) else w, np.float32)


def _step_bound(w: object) -> np.ndarray:
    """One quantization step of each element's group (0 for a float weight)."""
    if not isinstance(w, QuantizedWeight):
        return np.zeros(w.shape, np.float32)
    return np.repeat(np.abs(np.asarray(w.scales, np.float32)), w.group_size, axis=-2)


def _greedy(llm: LLM) -> str:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text


def _cli_text(path: pathlib.Path, quantization: str, kv: str,
              capsys: pytest.CaptureFixture) -> str:
    capsys.readouterr()
    rc = cli_main(["generate", PROMPT, "--model", str(path), "--quantization", quantization,
                   "--kv-cache-dtype", kv, *ENGINE_FLAGS])
    assert rc == 0
    return capsys.readouterr().out.removesuffix("\n")


def _kv_dtype(llm: LLM) -> np.dtype:
    kv = llm.engine.runner.kv_pages
    return np.dtype(getattr(kv, "pages", kv).dtype)


@pytest.mark.parametrize("kind,quantization,kv", CASES)
def test_every_entry_point_builds_the_same_engine(
        checkpoints: dict[str, pathlib.Path], kind: str, quantization: str, kv: str,
        capsys: pytest.CaptureFixture) -> None:
    path = checkpoints[kind]
    kw = dict(ENGINE, quantization=quantization, kv_cache_dtype=kv)
    # "auto" pages: the model's float32, or bfloat16 under quantized weights.
    quantized = any(_expected_scheme(kind, quantization, f) != "float" for f in LINEAR_FIELDS)
    want_kv = np.dtype({"auto": "bfloat16" if quantized else "float32",
                        "fp8": "float8_e4m3fn"}.get(kv, kv))
    with LLM(str(path), **kw) as by_path, LLM(loaded=_loaded(path), **kw) as by_loaded:
        for llm in (by_path, by_loaded):
            layers = llm.engine.runner.params.layers
            got = {f: _scheme(getattr(layers, f)) for f in LINEAR_FIELDS}
            assert got == {f: _expected_scheme(kind, quantization, f) for f in LINEAR_FIELDS}
            assert _kv_dtype(llm) == want_kv
        text = _greedy(by_path)
        same = True
        for f in LINEAR_FIELDS:
            a = getattr(by_path.engine.runner.params.layers, f)
            b = getattr(by_loaded.engine.runner.params.layers, f)
            if all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))):
                continue
            fa, fb = _float(a), _float(b)
            same = False
            # One level apart at most, plus each side's dequantization roundings (two of
            # them for a scale-and-offset scheme) on a value of its magnitude.
            bound = (np.maximum(_step_bound(a), _step_bound(b))
                     + 4 * F32_U * (np.abs(fa) + np.abs(fb)))
            assert (np.abs(fa - fb) <= bound).all(), f
        if same:
            assert _greedy(by_loaded) == text
    assert _cli_text(path, quantization, kv, capsys) == text


@pytest.mark.parametrize("quantization", split_tiers(
    QUANTIZATIONS, QUANTIZATIONS, ("int4", "none"), "the other schemes' packing"))
def test_the_packed_cpu_kernels_take_a_requantized_model(
        checkpoints: dict[str, pathlib.Path], quantization: str) -> None:
    """The C++ dense kernels' packing (dense_impl auto on CPU) of weights requantized from a
    model loaded with its quantized blocks: the same schemes, and the same greedy text as the
    XLA dots where the two agree on the argmax (the kernels sum in another order)."""
    path = checkpoints["gguf_quant"]
    if jax.devices()[0].platform != "cpu":
        pytest.skip("the packed dense kernels run on CPU only")
    kw = dict(ENGINE, quantization=quantization, dense_impl="cpu")
    with LLM(loaded=_loaded(path), **kw) as llm:
        layers = llm.engine.runner.params.layers
        assert {f: _scheme(getattr(layers, f)) for f in LINEAR_FIELDS} == {
            f: _expected_scheme("gguf_quant", quantization, f) for f in LINEAR_FIELDS}
        assert all(isinstance(getattr(layers, f), PackedWeight) for f in LINEAR_FIELDS)
        assert len(_greedy(llm)) > 0


def test_batch_job_takes_quantization_and_kv_dtype(checkpoints: dict[str, pathlib.Path],
                                                   tmp_path: pathlib.Path) -> None:
    """`jaxserve batch` builds by the same path: int4 weights from Q8_0 and Q4_1 blocks,
    int8 KV pages; its text is LLM(path)'s."""
    import json

    path = checkpoints["gguf_quant"]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"id": "a", "prompt": PROMPT}) + "\n")
    rc = cli_main(["batch", str(src), str(dst), "--model", str(path), "--quantization", "int4",
                   "--kv-cache-dtype", "int8", "--no-progress", *ENGINE_FLAGS])
    assert rc == 0
    with LLM(str(path), **ENGINE, quantization="int4", kv_cache_dtype="int8") as llm:
        want = _greedy(llm)
    assert json.loads(dst.read_text().splitlines()[0])["text"] == want


@slow("the bundled 135M model: a full load and quantization per case")
@pytest.mark.parametrize("quantization,kv", [("int8", "int8"), ("int4", "fp8"),
                                             ("none", "auto")])
def test_the_bundled_model_from_the_cli(quantization: str, kv: str,
                                        capsys: pytest.CaptureFixture) -> None:
    """The issue's reproduction: the bundled GGUF (Q8_0 blocks) requantized from the CLI."""
    rc = cli_main(["generate", "The best way to learn a new language is", "--quantization",
                   quantization, "--kv-cache-dtype", kv, "--max-tokens", "8"])
    assert rc == 0
    assert capsys.readouterr().out.strip()

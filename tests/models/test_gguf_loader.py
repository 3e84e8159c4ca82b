"""GGUF loader tests.

Oracles: transformers' own GGUF loading of the same file (it dequantizes and un-permutes the
llama q/k rows with its own code), torch's bfloat16 rounding, and the float arrays a test writes
into small synthetic GGUF files with `gguf.GGUFWriter`. Malformed files must fail with
`CheckpointError` naming the file and the key or tensor, never a raw IndexError/struct.error.
"""

from __future__ import annotations

import pathlib

import gguf
import numpy as np
import pytest
from support.gguf_files import Q, TINY, llama_cpp_permute, tiny_weights, write_tiny_gguf
from support.numerics import F32_UNIT_ROUNDOFF

from jaxserve.models.bundled import bundled_model_path
from jaxserve.models.config import ConfigError
from jaxserve.models.gguf_loader import CheckpointError, read_gguf, read_gguf_metadata


@pytest.fixture(scope="module")
def bundled() -> pathlib.Path:
    return bundled_model_path()


@pytest.fixture(scope="module")
def checkpoint(bundled):
    return read_gguf(bundled)


@pytest.fixture(scope="module")
def hf_state_dict(bundled):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from support.bundled_hf import bundled_hf_model  # transformers' reading of `bundled`

    return {k: v.detach().numpy() for k, v in bundled_hf_model().state_dict().items()}


# ---------------------------------------------------------------------------- bundled file
def test_bundled_config(checkpoint):
    c = checkpoint.hf_config
    assert c["model_type"] == "llama"
    assert (c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"],
            c["num_key_value_heads"], c["head_dim"]) == (30, 576, 9, 3, 64)
    assert c["intermediate_size"] == 1536 and c["vocab_size"] == 49152
    assert c["tie_word_embeddings"] is True and "lm_head.weight" not in checkpoint.tensors
    assert c["rope_theta"] == 100000.0 and c["max_position_embeddings"] == 8192
    assert (c["bos_token_id"], c["eos_token_id"], c["pad_token_id"]) == (1, 2, 2)
    assert abs(c["rms_norm_eps"] - 1e-5) < 1e-9
    assert len(checkpoint.tensors) == 272
    assert checkpoint.tensor_types["model.embed_tokens.weight"] == "Q8_0"
    assert checkpoint.tensor_types["model.layers.0.self_attn.q_proj.weight"] == "Q4_1"
    assert all(t.dtype == np.float32 for t in checkpoint.tensors.values())


def block_atol(ref: np.ndarray) -> float:
    """Our dequantization of a GGUF tensor against gguf-py's (transformers' loader), both in
    float32: a block's value is at most two terms (d * sc * q - dmin * m, the richest, K-quant
    form), each a product of up to three factors, so each side rounds at most 3 times, terms no
    larger than 2 max|w| (dmin * m is minus the block's minimum, d * sc * q at most its
    range): two sides differ by at most 2 * 3 * u * 2 max|w|. (Q8_0 / Q4_x products of an
    fp16 scale and a code are exact in float32; this bounds every type alike.)"""
    return 12 * F32_UNIT_ROUNDOFF * float(np.abs(ref).max())


def _f16_rounding(x: np.ndarray) -> np.ndarray:
    """|fl16(x) - x|: half an fp16 ulp, 2^-11 |x| when normal, 2^-25 below (subnormals)."""
    return np.maximum(2.0 ** -11 * np.abs(x), 2.0 ** -25)


def block_quant_bound(ref: np.ndarray, got: np.ndarray, qtype: Q) -> np.ndarray:
    """Per element [blocks, 32]: |got - ref| for gguf-py's quantizer (float32 scale d, codes
    rounded against it, then d (and Q4_1's block minimum m) stored as float16) and our float32
    dequantization. Q8_0: q = round(w * fl(1 / d)), d = max|w| / 127: two float32 roundings
    before round() put q within 1/2 + 2u |w| / d of w / d; q * d16 adds |q| |d16 - d| <= 127
    halves of an fp16 ulp of d; one float32 rounding of the result. Q4_1: q = trunc(fl(w - m)
    * fl(1 / d) + 1/2), d = (max - min) / 15: three roundings on w - m and one on the + 1/2
    (<= 16 u, the sum is at most 15.5), so q d + m is within d / 2 + 3u |w - m| + 16 u d of w;
    storing d and m as float16 adds 15 |d16 - d| + |m16 - m|; q * d16 + m16 rounds once more
    in float32. Here d is computed in float64: gguf-py's float32 d is within 2u d of it (one
    rounding for Q8_0, two for Q4_1; m, a block element, is exact), which moves q * d by up
    to q_max * 2u d and d / 2 by u d: 128 u d for Q8_0, 31 u d for Q4_1. First-order bounds,
    each u term doubled for the products of (1 + u) factors."""
    u = F32_UNIT_ROUNDOFF
    blocks = ref.reshape(-1, 32).astype(np.float64)
    got = np.abs(got.reshape(-1, 32).astype(np.float64))
    if qtype == Q.Q8_0:
        d = np.abs(blocks).max(1, keepdims=True) / 127
        return (d / 2 + 127 * _f16_rounding(d) + 4 * u * np.abs(blocks) + 128 * u * d
                + 2 * u * got)
    if qtype == Q.Q4_1:
        m = blocks.min(1, keepdims=True)
        d = (blocks.max(1, keepdims=True) - m) / 15
        return (d / 2 + 6 * u * (blocks - m) + (32 + 31) * u * d + 15 * _f16_rounding(d)
                + _f16_rounding(m) + 2 * u * got)
    raise ValueError(f"no bound for {qtype.name}")


def test_bundled_tensors_match_transformers(checkpoint, hf_state_dict):
    ours = checkpoint.tensors
    for name, ref in hf_state_dict.items():
        mine = ours["model.embed_tokens.weight"] if name == "lm_head.weight" else ours[name]
        assert mine.shape == ref.shape, name
        np.testing.assert_allclose(mine, ref, atol=block_atol(ref), rtol=0, err_msg=name)
    assert set(ours) == set(hf_state_dict) - {"lm_head.weight"}


def test_bundled_qk_rows_really_are_unpermuted(bundled, checkpoint):
    # Guard against a vacuous pass: the file's raw q/k row order differs from the HF order.
    reader = gguf.GGUFReader(bundled)
    raw = {t.name: t for t in reader.tensors}
    for layer, proj, heads in ((0, "q", 9), (7, "k", 3), (29, "q", 9)):
        t = raw[f"blk.{layer}.attn_{proj}.weight"]
        stored = gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1, 576)
        hf = checkpoint.tensors[f"model.layers.{layer}.self_attn.{proj}_proj.weight"]
        assert not np.allclose(stored, hf)
        np.testing.assert_array_equal(llama_cpp_permute(hf, heads), stored)


def test_bundled_metadata(bundled):
    md = read_gguf_metadata(bundled)
    assert md["general.architecture"] == "llama"
    assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == "smollm"
    assert len(md["tokenizer.ggml.tokens"]) == 49152 and len(md["tokenizer.ggml.merges"]) == 48900
    assert md["tokenizer.ggml.token_type"][:3] == [3, 3, 3]
    assert md["tokenizer.ggml.add_bos_token"] is False
    assert "{% for message in messages %}" in md["tokenizer.chat_template"]


# ---------------------------------------------------------------------------- synthetic files
def test_tiny_llama_all_types(tmp_path):
    rng = np.random.default_rng(0)
    weights = tiny_weights(rng)
    types = {"model.embed_tokens.weight": Q.Q8_0, "lm_head.weight": Q.BF16,
             "model.layers.0.self_attn.q_proj.weight": Q.F16,
             "model.layers.0.self_attn.k_proj.weight": Q.Q8_0,
             "model.layers.1.self_attn.q_proj.weight": Q.BF16,
             "model.layers.1.self_attn.k_proj.weight": Q.Q4_1,
             "model.layers.1.mlp.down_proj.weight": Q.Q8_0,
             "model.layers.0.mlp.up_proj.weight": Q.F16}
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, weights, types=types)
    ck = read_gguf(path)
    assert ck.hf_config["tie_word_embeddings"] is False and ck.hf_config["head_dim"] == 16
    assert set(ck.tensors) == set(weights)
    torch = pytest.importorskip("torch")
    for name, ref in weights.items():
        got, qtype = ck.tensors[name], types.get(name, Q.F32)
        assert got.shape == ref.shape and got.dtype == np.float32, name
        assert ck.tensor_types[name] == qtype.name
        if qtype == Q.F32:
            np.testing.assert_array_equal(got, ref, err_msg=name)
        elif qtype == Q.F16:
            np.testing.assert_array_equal(got, ref.astype(np.float16).astype(np.float32))
        elif qtype == Q.BF16:
            expect = torch.from_numpy(ref).to(torch.bfloat16).float().numpy()
            np.testing.assert_array_equal(got, expect, err_msg=name)
        else:  # block quantization: error per element within half a step, and roundings
            err = np.abs(got - ref).reshape(-1, 32)
            assert (err <= block_quant_bound(ref, got, qtype)).all(), name


def test_tiny_llama_matches_transformers(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    weights = tiny_weights(np.random.default_rng(1))
    types = {"model.layers.1.self_attn.k_proj.weight": Q.Q8_0}
    write_tiny_gguf(tmp_path / "t.gguf", weights, types=types)
    ours = read_gguf(tmp_path / "t.gguf").tensors
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="t.gguf", dtype=torch.float32)
    for name, ref in model.state_dict().items():
        np.testing.assert_allclose(ours[name], ref.numpy(), atol=block_atol(ref.numpy()), rtol=0,
                                   err_msg=name)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_tiny_qwen_not_permuted(tmp_path, arch):
    weights = tiny_weights(np.random.default_rng(2), arch)
    write_tiny_gguf(tmp_path / "q.gguf", weights, arch=arch)
    ck = read_gguf(tmp_path / "q.gguf")
    assert ck.hf_config["model_type"] == arch
    assert ck.hf_config["attention_bias"] is (arch == "qwen2")
    for name, ref in weights.items():
        np.testing.assert_array_equal(ck.tensors[name], ref, err_msg=name)


def test_llama3_rope_freqs_recovered(tmp_path):
    head_dim, theta = TINY["head_dim"], 10000.0
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * np.pi / inv
    # Compute llama.cpp's factors for factor=8, low=1, high=4, original=8192, point by point.
    factors = []
    for wl in wavelen:
        if wl < 8192 / 4:
            factors.append(1.0)
        elif wl > 8192 / 1:
            factors.append(8.0)
        else:
            smooth = (8192 / wl - 1) / (4 - 1)
            factors.append(1 / ((1 - smooth) / 8 + smooth))
    freqs = np.array(factors, dtype=np.float32)
    write_tiny_gguf(tmp_path / "r.gguf", tiny_weights(np.random.default_rng(3)),
                    extra_tensors={"rope_freqs.weight": freqs})
    rs = read_gguf(tmp_path / "r.gguf").hf_config["rope_scaling"]
    assert rs["rope_type"] == "llama3" and rs["factor"] == 8.0
    write_tiny_gguf(tmp_path / "bad.gguf", tiny_weights(np.random.default_rng(3)),
                    extra_tensors={"rope_freqs.weight": freqs[::-1].copy()})
    with pytest.raises(CheckpointError, match="rope_freqs"):
        read_gguf(tmp_path / "bad.gguf")


# ---------------------------------------------------------------------------- malformed input
def test_truncated_bundled_header(bundled, tmp_path):
    cut = tmp_path / "cut.gguf"
    with open(bundled, "rb") as f:
        cut.write_bytes(f.read(1 << 20))
    for reader in (read_gguf, read_gguf_metadata):
        with pytest.raises(CheckpointError, match="truncated") as e:
            reader(cut)
        assert str(cut) in str(e.value)


def test_truncated_mid_tensor(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tiny_weights(np.random.default_rng(4)))
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 3000])
    assert read_gguf_metadata(cut)["llama.block_count"] == 2  # the header is intact
    with pytest.raises(CheckpointError, match=r"tensor '.*'.*truncated") as e:
        read_gguf(cut)
    assert str(cut) in str(e.value)


@pytest.mark.parametrize("content", [b"", b"GGU", bytes(range(256)) * 40, b"GGUF\x03\x00\x00\x00"])
def test_not_gguf(tmp_path, content):
    path = tmp_path / "junk.gguf"
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as e:
        read_gguf(path)
    assert str(path) in str(e.value)


def test_random_bytes_after_magic(tmp_path):
    rng = np.random.default_rng(5)
    for n in range(20):  # a valid magic/version, then garbage: must still be a clean error
        path = tmp_path / f"r{n}.gguf"
        path.write_bytes(b"GGUF\x03\x00\x00\x00" + rng.bytes(int(rng.integers(1, 5000))))
        with pytest.raises(CheckpointError):
            read_gguf(path)


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="nope.gguf"):
        read_gguf(tmp_path / "nope.gguf")


def test_missing_block_count(tmp_path):
    path = tmp_path / "nokey.gguf"
    write_tiny_gguf(path, tiny_weights(np.random.default_rng(6)), drop_keys=("llama.block_count",))
    with pytest.raises(CheckpointError, match="'llama.block_count'") as e:
        read_gguf(path)
    assert str(path) in str(e.value)


def test_wrong_tensor_shape(tmp_path):
    weights = tiny_weights(np.random.default_rng(7))
    bad = {"model.layers.1.self_attn.v_proj.weight": np.zeros((48, 64), np.float32)}
    path = tmp_path / "shape.gguf"
    write_tiny_gguf(path, weights, shape_override=bad)
    with pytest.raises(CheckpointError, match=r"blk\.1\.attn_v\.weight.*\[48, 64\].*\[32, 64\]") as e:
        read_gguf(path)
    assert str(path) in str(e.value)


def test_missing_tensor_and_inconsistent_config(tmp_path):
    weights = tiny_weights(np.random.default_rng(8))
    del weights["model.layers.0.mlp.up_proj.weight"]
    write_tiny_gguf(tmp_path / "m.gguf", weights)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.up_proj\.weight"):
        read_gguf(tmp_path / "m.gguf")
    weights = tiny_weights(np.random.default_rng(8))
    # no head_count_kv -> kv heads = heads -> the stored k/v shapes contradict the config
    write_tiny_gguf(tmp_path / "kv.gguf", weights, drop_keys=("llama.attention.head_count_kv",))
    with pytest.raises(CheckpointError, match=r"blk\.0\.attn_k\.weight"):
        read_gguf(tmp_path / "kv.gguf")
    # kv heads not dividing heads: config.py's validation, naming the file as its source
    path = tmp_path / "div.gguf"
    write_tiny_gguf(path, weights, meta_override={"llama.attention.head_count_kv": 3})
    with pytest.raises(ConfigError, match="num_key_value_heads") as e:
        read_gguf(path)
    assert str(path) in str(e.value)


def test_unsupported_tensor_type(tmp_path):
    weights = tiny_weights(np.random.default_rng(9))
    path = tmp_path / "i8.gguf"
    write_tiny_gguf(path, weights, shape_override={
        "model.norm.weight": np.ones(64, dtype=np.int8)})
    with pytest.raises(ValueError, match=r"output_norm\.weight.*I8") as e:
        read_gguf(path)
    assert str(path) in str(e.value)


def test_corrupted_header_bytes_give_clean_errors(tmp_path):
    # Random byte flips in the metadata/tensor table must end in our errors (or a valid read),
    # never IndexError/struct.error/MemoryError from a garbage count or dimension.
    path = tmp_path / "base.gguf"
    write_tiny_gguf(path, tiny_weights(np.random.default_rng(10)),
                    types={"model.embed_tokens.weight": Q.Q8_0})
    base = path.read_bytes()
    header_end = base.index(b"output_norm") + 64  # inside the tensor table
    rng = np.random.default_rng(11)
    mutated = tmp_path / "m.gguf"
    for _ in range(300):
        data = bytearray(base)
        for i in rng.integers(0, header_end, size=int(rng.integers(1, 4))):
            data[int(i)] = int(rng.integers(0, 256))
        mutated.write_bytes(bytes(data))
        try:
            read_gguf(mutated)
        except (CheckpointError, ConfigError) as e:
            assert str(mutated) in str(e)

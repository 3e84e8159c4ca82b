"""Checkpoint round trips (Orbax, HF export) and the errors promised for malformed files."""

from __future__ import annotations

import json
import pathlib
import struct

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from support.hf_models import build_hf_model, save_tiny_tokenizer  # noqa: E402
from support.numerics import logits_atol  # noqa: E402

from jaxserve import cli  # noqa: E402
from jaxserve.models import decoder, hf_loader, llama, loading  # noqa: E402
from jaxserve.models.config import ConfigError  # noqa: E402
from jaxserve.models.safetensors_io import CheckpointError, read_safetensors  # noqa: E402

TOKENS = np.array([[5, 17, 99, 3, 42, 8, 150, 7]], np.int32)


@pytest.fixture()
def hf_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    d = tmp_path / "hf"
    build_hf_model("qwen3_qknorm", d)
    save_tiny_tokenizer(d, 211)
    return d


def _logits(model: loading.LoadedModel) -> np.ndarray:
    return np.asarray(decoder.forward_jit(model.params, TOKENS,
                                          np.array([TOKENS.shape[1]], np.int32),
                                          cfg=model.config))


def test_orbax_convert_round_trip_identical_logits(hf_dir: pathlib.Path, tmp_path) -> None:
    src = loading.load_model(hf_dir)
    dst = loading.convert(hf_dir, tmp_path / "orbax", fmt="orbax")
    back = loading.load_model(dst)
    assert back.format == "orbax" and back.config == src.config
    np.testing.assert_array_equal(_logits(back), _logits(src))
    assert back.tokenizer.encode("w5 w9 w200") == src.tokenizer.encode("w5 w9 w200")
    # A second convert onto the same directory refuses unless asked to overwrite.
    with pytest.raises(FileExistsError):
        loading.convert(hf_dir, dst)
    loading.convert(hf_dir, dst, overwrite=True)


def test_orbax_restore_casts_to_bfloat16(hf_dir: pathlib.Path, tmp_path) -> None:
    dst = loading.convert(hf_dir, tmp_path / "orbax", fmt="orbax")
    back = loading.load_model(dst, dtype="bfloat16")
    assert back.params.layers.wq.dtype == jnp.bfloat16


def test_hf_export_loads_in_transformers(hf_dir: pathlib.Path, tmp_path) -> None:
    dst = tmp_path / "export"
    assert cli.main(["convert", str(hf_dir), str(dst), "--format", "hf"]) == 0
    ours = _logits(loading.load_model(hf_dir))
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32)
    with torch.no_grad():
        ref = ref_model(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
    # jaxserve on XLA against transformers on torch: support.numerics.logits_atol.
    src = loading.load_model(hf_dir)
    assert np.max(np.abs(ours - ref)) <= logits_atol(src.config, src.params, TOKENS.shape[1])
    ref_tok = transformers.AutoTokenizer.from_pretrained(dst)
    assert ref_tok("w5 w9 w200").input_ids == loading.load_model(dst).tokenizer.encode("w5 w9 w200")


def test_sharded_hf_export_round_trips(hf_dir: pathlib.Path, tmp_path) -> None:
    src = loading.load_model(hf_dir)
    out = tmp_path / "sharded"
    hf_loader.save_hf_dir(out, src.config, src.params, max_shard_bytes=50_000)
    assert (out / "model.safetensors.index.json").exists()
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    params = hf_loader.params_from_hf(src.config, hf_loader.read_hf_tensors(out))
    for a, b in zip(*(jax_leaves(p) for p in (params, src.params))):
        np.testing.assert_array_equal(a, b)


def jax_leaves(p: llama.LlamaParams) -> list[np.ndarray]:
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(p)]


# ----------------------------------------------------------------------------- malformed input
def _weights(d: pathlib.Path) -> pathlib.Path:
    return d / "model.safetensors"


def test_truncated_safetensors_names_file_and_tensor(hf_dir: pathlib.Path) -> None:
    f = _weights(hf_dir)
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*tensor '.*'.*truncated"):
        loading.load_model(hf_dir)


def test_header_cut_short(hf_dir: pathlib.Path) -> None:
    f = _weights(hf_dir)
    f.write_bytes(f.read_bytes()[:20])
    with pytest.raises(CheckpointError, match="header length"):
        read_safetensors(f)
    f.write_bytes(b"abc")
    with pytest.raises(CheckpointError, match="truncated"):
        read_safetensors(f)


def _rewrite_header(f: pathlib.Path, edit) -> None:
    data = f.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def test_unknown_dtype(hf_dir: pathlib.Path) -> None:
    _rewrite_header(_weights(hf_dir), lambda h: h["model.norm.weight"].update(dtype="F12"))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight'.*unknown dtype 'F12'"):
        loading.load_model(hf_dir)


def test_shape_mismatch_names_tensor(hf_dir: pathlib.Path) -> None:
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.gate_proj\.weight' has shape"):
        loading.load_model(hf_dir)


def test_missing_tensor(hf_dir: pathlib.Path) -> None:
    _rewrite_header(_weights(hf_dir), lambda h: h.pop("model.norm.weight"))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' is missing"):
        loading.load_model(hf_dir)


@pytest.mark.parametrize("key", ["hidden_size", "num_hidden_layers", "vocab_size"])
def test_missing_config_key(hf_dir: pathlib.Path, key: str) -> None:
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg.pop(key)
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=f"config.json: required field '{key}' is missing"):
        loading.load_model(hf_dir)


def test_unsupported_architecture(hf_dir: pathlib.Path) -> None:
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="model_type='gpt_neox'.*not supported"):
        loading.load_model(hf_dir)


def test_pickle_checkpoints_are_refused(hf_dir: pathlib.Path) -> None:
    _weights(hf_dir).unlink()
    (hf_dir / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(CheckpointError, match="pickled .bin checkpoints are not loaded"):
        loading.load_model(hf_dir)


def test_not_a_model(tmp_path: pathlib.Path) -> None:
    f = tmp_path / "random.bin"
    f.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(CheckpointError, match="not GGUF"):
        loading.load_model(f)
    with pytest.raises(CheckpointError, match="no config.json"):
        loading.load_model(tmp_path)
